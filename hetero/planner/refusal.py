"""Why no plan fits, in numbers: the weights that fit nowhere, or the KV that does not fit."""

from __future__ import annotations

from hetero.planner.cost import kv_token_bytes
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
            + c.activation_bytes(cfg.max_num_batched_tokens, cfg.max_num_seqs, True)
            for c in setup.costs
        )
        short = max(need - offered, 0.0)
        return (
            f"{desc.name} fits nowhere: its weights and activations need {need / GB:.2f} GB "
            f"in the most compact weights mode; the devices offer {offered / GB:.2f} GB after "
            f"the safety margin ({names}): short by {short / GB:.2f} GB"
            + ("" if short else " (no contiguous split fits each device)")
        )
    tokens = _kv_tokens(setup, split.ranges)
    per_seq = -(-setup.context // cfg.block_size) * cfg.block_size
    need = sum(
        kv_token_bytes(desc, c.kv_dtype) * (b - a) * per_seq * cfg.concurrency
        for c, (a, b) in zip(setup.costs, split.ranges)
    )
    return (
        f"context {setup.context} x concurrency {cfg.concurrency} needs {need / GB:.2f} GB of KV; "
        f"after the weights at most {tokens} tokens fit ({names}): max context at concurrency "
        f"{cfg.concurrency} is {tokens // cfg.concurrency}, max concurrency at context "
        f"{setup.context} is {tokens // per_seq}"
    )


def _kv_tokens(setup, ranges) -> int:
    """Tokens of KV the split holds: the stages' minimum, in whole blocks."""
    cfg, blocks = setup.config, None
    for i, (a, b) in enumerate(ranges):
        if b == a:
            continue
        per_block = kv_token_bytes(setup.desc, setup.costs[i].kv_dtype) * (b - a) * cfg.block_size
        left = max(setup.budgets[i] - setup.base_bytes(i, a, b), 0.0)
        room = int(left * cfg.kv_memory_fraction // per_block)
        blocks = room if blocks is None else min(blocks, room)
    return (blocks or 0) * cfg.block_size
