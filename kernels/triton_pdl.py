"""The device side of kernels/pdl.py (imports triton: first use only)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the kernel before it to finish (its
    writes visible), then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
