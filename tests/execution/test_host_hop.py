"""The CPU's expert layers as host nodes of a decode step's CUDA graph (kernels/host_hop.py):
on a GPU, a tiny MoE model with its experts in RAM decodes through captured graphs as it does
eagerly, token for token and logprob for logprob (both run the same kernels and the same native
layer); without one, the bookkeeping that needs no device."""

from __future__ import annotations

import ctypes

import pytest
import torch

from hetero.kernels import cpu_qdot, host_hop
from hetero.llm import LLM
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic

pytestmark = pytest.mark.skipif(not cpu_qdot.available(), reason="the qdot kernel did not build")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
PROMPTS = [[5 + i for i in range(n)] for n in (5, 17, 9)]


class _Args(ctypes.Structure):
    _fields_ = [("rc", ctypes.c_int32)]


def test_a_call_needs_an_owner_and_a_failed_one_is_reported():
    with pytest.raises(RuntimeError, match="owner"):
        host_hop.run_on_host(torch.zeros(1, 4), 0, lambda i, o, t: _Args())
    with host_hop.recording() as outer:
        with host_hop.recording() as inner:
            pass
        assert outer is not inner and outer == [] and inner == []
    host_hop.check([_Args(0), _Args(0)])
    with pytest.raises(RuntimeError, match="result code -2"):
        host_hop.check([_Args(0), _Args(-2)])
    assert not host_hop.capturing(torch.zeros(2))


@pytest.mark.gpu
@pytest.mark.parametrize("n_cpu_moe", [0, 1])  # all layers' experts in RAM (--cpu-moe); the first
def test_gpu_graphs_with_experts_in_ram_equal_eager(tmp_path, n_cpu_moe):
    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen3moe", "q4_k_m", progress=False)
    where = dict(n_cpu_moe=n_cpu_moe) if n_cpu_moe else dict(cpu_moe=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(
            str(path), device="cuda", enforce_eager=eager, num_kv_blocks=64, max_num_seqs=4,
            max_model_len=256, **where,
        )  # fmt: skip
        outs[eager] = llm.generate(PROMPTS, GREEDY)
        graphs = llm.engine.executor.runner.graphs
        if not eager:
            assert graphs is not None, "the steps with experts in RAM were captured"
            calls = [a for c in graphs.host_calls.values() for a in c]
            assert calls and all(a.rc == 0 for a in calls)
            assert sum(a.calls for a in calls) > 0, "graphs with host nodes replayed"
            assert llm.engine.stats.graphed > 0
    # the same tokens; logprobs within the prompt's attention rounding (a graph's prompt rows
    # attend in tiles, the eager prefill kernel in one pass: measured 3e-5 on the H200)
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = torch.tensor([x.logprob for x in a.outputs[0].logprobs])
        lb = torch.tensor([x.logprob for x in b.outputs[0].logprobs])
        assert torch.allclose(la, lb, atol=1e-3)


@pytest.mark.gpu
def test_gpu_pinned_room_grows_by_powers_of_two():
    dev, width = torch.device("cuda"), 24  # a width no model here has
    for rows, room in ((130, 256), (131, 256), (256, 256), (257, 512), (5000, 512)):
        host_hop.reserve(dev, width, rows)
        inp, out = host_hop._buffers[(dev.index or 0, width)]
        assert inp.shape == out.shape == (room, width) and inp.is_pinned()
