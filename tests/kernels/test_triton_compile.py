"""The Triton kernels compile for an sm_90 GPU (front end and ptxas), checked on any machine.

The interpreter tests run the kernels' Python and never meet the compiler's front end, which
refuses constructs Python accepts (tests/support/triton_compile_check.py): this compiles the
launches of a Q4_K_M file's types (Q4_K, Q6_K), Q8_0 and the codebook types (IQ4_XS with K-quant
scales, MXFP4 with E8M0 ones) in a process without the interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("triton") is None:  # not imported here: the interpreter's switch is
    pytest.skip("needs triton", allow_module_level=True)  # read at triton's first import


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    types = "Q4_K,Q6_K,Q8_0,IQ4_XS,MXFP4"
    cmd = [sys.executable, "-m", "tests.support.triton_compile_check", "--types", types]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "0 failed" in done.stdout
