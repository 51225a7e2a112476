"""The slots of a MoE layer sorted by expert into blocks: the layout of triton_moe's grouped
matmul (its module docstring), vLLM's moe_align_block_size.

`sort_by_expert` runs `moe_align_kernel` (triton_moe_kernels), one launch; torch's ops for the
same layout (`sort_by_expert_ref`, the reference it is tested against entry for entry) took
about twenty small kernels, 5 ms of a 20 ms 32-stream Qwen3-30B-A3B decode step on the H200,
twice a layer. Within `kernels.moe.routing_scope()` (one MoE layer's calls) one sort serves
every call on the same topk_ids. Shapes depend on (T, k, E) alone, nothing is read back: the
bound on blocks is that of vLLM, min(S, E) * (BT - 1) + S rows.
"""

from __future__ import annotations

import torch

from hetero.kernels.moe import routing_memo

# Up to this many slots sort_by_expert runs its one kernel (whose programs each count every slot:
# quadratic in S), more (long prompts) torch's sort
ALIGN_MAX_SLOTS = 4096


def n_blocks(n_slots: int, n_experts: int, bt: int) -> int:
    """The static bound on blocks of bt rows: every expert's last block padded."""
    return -(-(min(n_slots, n_experts) * (bt - 1) + n_slots) // bt)


def sort_by_expert(
    topk_ids: torch.Tensor, n_experts: int, bt: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [blocks * bt] int32, expert_ids [blocks] int32) of topk_ids' slots (the
    module docstring)."""
    key = (id(topk_ids), n_experts, bt)
    memo = routing_memo()
    if memo is not None and key in memo and memo[key][0] is topk_ids:
        return memo[key][1]
    flat = topk_ids.reshape(-1)
    s = flat.numel()
    if s > ALIGN_MAX_SLOTS:
        result = sort_by_expert_ref(topk_ids, n_experts, bt)
    else:
        blocks = n_blocks(s, n_experts, bt)
        result = (
            torch.empty(blocks * bt, dtype=torch.int32, device=flat.device),
            torch.empty(blocks, dtype=torch.int32, device=flat.device),
        )
        from hetero.kernels.triton_moe_kernels import moe_align_kernel  # (imports triton)

        bs = 128
        moe_align_kernel[(-(-s // bs) + 1,)](
            flat, *result, s, n_experts, blocks, -(-s // bt), BT=bt, BS=bs,
            BE=max(16, 1 << (n_experts - 1).bit_length()),
        )  # fmt: skip
    if memo is not None:
        memo[key] = (topk_ids, result)  # (holds topk_ids: its id stays its own)
    return result


def sort_by_expert_ref(
    topk_ids: torch.Tensor, n_experts: int, bt: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sort_by_expert` in torch ops, without reading anything back."""
    flat = topk_ids.reshape(-1).long()
    s, dev = flat.numel(), flat.device
    counts = torch.zeros(n_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bt - 1) // bt * bt
    ends = padded.cumsum(0)  # end row of each expert's blocks
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, in slot order
    by_expert = flat[order]
    first = counts.cumsum(0) - counts  # rank of each expert's first slot in `order`
    rank = torch.arange(s, device=dev) - first[by_expert]
    blocks = n_blocks(s, n_experts, bt)
    sorted_ids = torch.full((blocks * bt,), s, dtype=torch.int32, device=dev)
    sorted_ids[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=dev) * bt
    expert_ids = torch.searchsorted(ends, starts, right=True)
    expert_ids = torch.where(expert_ids < n_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids
