"""Links between two real stage ranks over gloo (two spawned processes): payloads below, at and
beyond the part carried in a message's first piece, with and without activations, forward and
back, arrive whole and in order."""

from __future__ import annotations

import multiprocessing as mp

import torch

from hetero.pipeline.links import _INLINE
from hetero.pipeline.processes import free_port
from hetero.pipeline.stages import StageSpec

SIZES = [1, 600, _INLINE - 1, _INLINE, _INLINE + 1, 3 * _INLINE + 17]


def _payload(n: int) -> bytes:
    return bytes((i * 7 + n) % 256 for i in range(n))


def _hidden(i: int) -> torch.Tensor | None:
    return None if i % 2 else torch.arange(6 * 4, dtype=torch.bfloat16).view(6, 4) + i


def _rank(rank: int, init: str, q) -> None:
    from hetero.pipeline.links import Links

    links = Links(rank, (StageSpec("cpu", 0, 1), StageSpec("cpu", 1, 2)), init)
    if rank == 0:  # results come back on their own thread, as in stage 0
        import threading

        back: list = []
        thread = threading.Thread(target=lambda: back.extend(links.recv_result() for _ in SIZES))
        thread.start()
        for i, n in enumerate(SIZES):
            links.send_next(_payload(n), _hidden(i))
        thread.join()
        q.put(back)
    else:
        got = []
        for _ in SIZES:
            payload, hidden = links.recv_prev(torch.device("cpu"), torch.float32)
            # plain values: a tensor through a queue would be shared memory of an exited process
            got.append((payload, None if hidden is None else (str(hidden.dtype), hidden.tolist())))
            links.send_result(payload[::-1])
        q.put(got)
    links.flush()


def test_payloads_of_every_size_arrive_whole_with_their_activations() -> None:
    ctx = mp.get_context("spawn")
    q0, q1 = ctx.Queue(), ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, init, q)) for r, q in ((0, q0), (1, q1))]
    for p in procs:
        p.start()
    try:
        forward, back = q1.get(timeout=120), q0.get(timeout=120)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for i, ((payload, hidden), n) in enumerate(zip(forward, SIZES)):
        assert payload == _payload(n)
        want = _hidden(i)
        if want is None:
            assert hidden is None
        else:  # bf16 sent, float32 asked for (a GPU stage's activations reaching a CPU stage)
            assert hidden == (str(torch.float32), want.float().tolist())
    assert back == [_payload(n)[::-1] for n in SIZES]
