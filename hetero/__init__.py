"""hetero: LLM inference for the GPUs (and CPUs) that offices actually own."""

from __future__ import annotations

import os as _os
import sys as _sys

# torch's OpenMP team must sleep, not spin, between its ops: on a CPU the native kernels run on
# their own pool (kernels/cpu_pool.c), and the two spinning against each other (and the server)
# took decode from 40 to 0.4 tok/s on 2 busy cores. libgomp reads this once, when torch loads
# it, so it is set before hetero imports torch; a user's own value is kept.
# Where torch came first, only a policy set before the process started applied
# (kernels/cpu_threads.configure then keeps torch's team at one thread).
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
TORCH_OMP_PASSIVE = _os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    # Lazy: `import hetero` stays cheap (no torch) for the command line's --help and --version.
    if name == "LLM":
        from hetero.llm import LLM

        return LLM
    if name == "SamplingParams":
        from hetero.sampling import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from hetero.structured_outputs import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'hetero' has no attribute {name!r}")
