"""Counter-based random numbers for sampling: splitmix64 computed in torch int64.

A sampled row's noise is a pure function of (request key, token index), never of a generator's
position, so a seeded request draws the same numbers alone or at any row of any batch, and one
call covers the whole batch without a per-row `torch.Generator`.

    key   = mix64(mix64(seed ^ SALT) + (step + 1) * GOLDEN)          one per (request, step)
    bits  = mix64(key + (v + 1) * GOLDEN)                             one per token v
    u     = ((bits >>> 12) + 0.5) * 2**-52                             in (0, 1), exact in float64

`bits` is the splitmix64 stream started at `key` (Steele, Lea, Flood 2014), whose outputs pass
BigCrush. torch has no uint64 arithmetic, so the same bits live in int64: multiplication and
addition wrap modulo 2**64 identically for signed and unsigned, and the only difference is the
right shift, which torch makes arithmetic; `_shr` masks off the copied sign bits.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: splitmix64's Weyl increment
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_SALT = 0x5EED5A3B1E0F7C21  # keeps seed 0's keys away from the all-zero state
_UNIT = 2.0**-52


def to_int64(value: int) -> int:
    """The int64 that has the same 64 bits as `value` taken modulo 2**64."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def mix64(value: int) -> int:
    """splitmix64's finalizer on Python ints (the reference for `mix64_tensor`); in [0, 2**64)."""
    z = value & MASK64
    z = ((z ^ (z >> 30)) * _C1) & MASK64
    z = ((z ^ (z >> 27)) * _C2) & MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, step: int) -> int:
    """The int64 key of one request's draw at one step (host side, once per row and step)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return to_int64(mix64(mix64(seed ^ _SALT) + (step + 1) * GOLDEN))


def uniform_reference(key: int, index: int) -> float:
    """Pure-Python value of `uniform(...)[row, index]` for a row with this key (for tests)."""
    bits = mix64(key + (index + 1) * GOLDEN)
    return ((bits >> 12) + 0.5) * _UNIT


def _shr(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` copies the sign bit)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer elementwise on an int64 tensor (bit patterns as in `mix64`)."""
    if x.dtype != torch.int64:
        raise ValueError(f"mix64_tensor needs int64, got {x.dtype}")
    x = (x ^ _shr(x, 30)) * to_int64(_C1)
    x = (x ^ _shr(x, 27)) * to_int64(_C2)
    return x ^ _shr(x, 31)


def uniform(keys: torch.Tensor, n: int) -> torch.Tensor:
    """keys [B] int64 -> [B, n] float64 uniforms in the open interval (0, 1).

    52 bits per number so that `k + 0.5` is exact in float64: u never rounds to 0 or 1.
    """
    if keys.dim() != 1 or keys.dtype != torch.int64:
        raise ValueError(f"keys must be a 1-D int64 tensor, got {keys.dtype} {tuple(keys.shape)}")
    counters = torch.arange(1, n + 1, dtype=torch.int64, device=keys.device) * to_int64(GOLDEN)
    bits = mix64_tensor(keys[:, None] + counters[None, :])  # [B, n], wraps modulo 2**64
    return (_shr(bits, 12).to(torch.float64) + 0.5) * _UNIT


def gumbel(keys: torch.Tensor, n: int) -> torch.Tensor:
    """keys [B] int64 -> [B, n] float32 standard Gumbel noise, g = -log(E), E ~ Exp(1).

    argmax(logits + g) samples softmax(logits) (the exponential race argmin E_v / p_v). E is
    `-log1p(-u)`, exact for small u, which are the draws that win: the largest g is about 36.7,
    so a token is out of reach only below ~1e-16 of the top token's probability.
    """
    e = -torch.log1p(-uniform(keys, n))
    return (-torch.log(e)).to(torch.float32)


def random_keys(batch: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """[batch] int64 fresh keys from a generator on `device` (no host sync)."""
    keys = torch.empty(batch, dtype=torch.int64, device=device)
    return mix64_tensor(keys.random_(generator=generator))
