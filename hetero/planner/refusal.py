"""Why no plan fits, in numbers: the weights that fit nowhere, or the KV that does not fit."""

from __future__ import annotations

from dataclasses import replace

from hetero.planner.cost import kv_layer_slots, kv_token_bytes, seq_blocks
from hetero.planner.search import search

GB = 1e9


def explain(setup) -> str:
    """The reason the last (widest, most compact) attempt of placement found no split."""
    desc, cfg, n = setup.desc, setup.config, setup.desc.n_layers
    n_dev = len(setup.costs)

    def weights_fit(i: int, a: int, b: int) -> bool:
        return setup.base_bytes(i, a, b) <= setup.budgets[i]

    use_all = cfg.use_all_devices
    split = search(n_dev, n, 1, weights_fit, lambda i, a, b, m: 1.0 / max(b - a, 1), use_all)
    offered = sum(max(b, 0.0) for b in setup.budgets)
    names = ", ".join(
        f"{c.dev.id} {max(b, 0) / GB:.1f} GB" for c, b in zip(setup.costs, setup.budgets)
    )
    if split is None:
        need = min(
            c.weights_bytes(0, n, True, True)
            + c.activation_bytes(
                cfg.engine.scheduler.max_num_batched_tokens, cfg.engine.scheduler.max_num_seqs, True
            )
            for c in setup.costs
        )
        short = max(need - offered, 0.0)
        return (
            f"{desc.name} fits nowhere: its weights and activations need {need / GB:.2f} GB "
            f"in the most compact weights mode; the devices offer {offered / GB:.2f} GB after "
            f"the safety margin ({names}): short by {short / GB:.2f} GB"
            + ("" if short else " (no contiguous split fits each device)")
        )
    per_seq = seq_blocks(desc, setup.context, cfg.engine) * cfg.engine.block_size
    need = sum(
        kv_token_bytes(desc, c.kv_dtype) * kv_layer_slots(desc, a, b) * per_seq * cfg.concurrency
        for c, (a, b) in zip(setup.costs, split.ranges)
    )
    blocks = setup.context // cfg.engine.block_size
    tokens = _largest(lambda k: _fits(setup, k, cfg.engine.block_size)) * cfg.engine.block_size
    max_context = _largest(
        lambda k: _fits(setup, cfg.concurrency, k * cfg.engine.block_size), blocks
    )
    max_concurrency = _largest(lambda k: _fits(setup, k, setup.context))
    return (
        f"context {setup.context} x concurrency {cfg.concurrency} needs {need / GB:.2f} GB of KV; "
        f"after the weights at most {tokens} tokens fit ({names}): max context at concurrency "
        f"{cfg.concurrency} is {max_context * cfg.engine.block_size}, max concurrency at context "
        f"{setup.context} is {max_concurrency}"
    )


def _fits(setup, concurrency: int, context: int) -> bool:
    """Whether some split holds the weights and KV for `concurrency` sequences of `context`."""
    cfg = replace(setup.config, concurrency=max(concurrency, 1))
    s = replace(setup, config=cfg, context=context if concurrency else 0, _prefix={})
    n_dev, use_all = len(s.costs), cfg.use_all_devices
    return search(n_dev, s.desc.n_layers, 1, s.fits, lambda i, a, b, m: 1.0, use_all) is not None


def _largest(ok, hi: int | None = None) -> int:
    """The largest k in [0, hi] with ok(k), for ok true at 0 and monotone (hi None: unbounded)."""
    lo = 0
    if hi is None:
        hi = 1
        while ok(hi):
            lo, hi = hi, hi * 2
        hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo
