"""Running Triton kernels in tests: compiled on a CUDA device, else under Triton's interpreter.

Import this module before anything imports triton: without CUDA it sets TRITON_INTERPRET=1,
which triton reads once, at its first import. If triton was imported earlier in the process
(another test file), kernels cannot run here: `kernels_runnable` skips them and
`rerun_test` runs the test file again in a process of its own. A test module imports both:

    from tests.support.triton_interp import kernels_runnable, rerun_test  # noqa: F401 (autouse)
    test_in_a_fresh_interpreter_process = rerun_test(__file__)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
RERUN = not CUDA and not INTERPRETED
DEVICE = torch.device("cuda" if CUDA else "cpu")
RERUN_TEST = "test_in_a_fresh_interpreter_process"


def fix_interpreter_index() -> None:
    """Triton <= 3.6's interpreter turns 1-element arrays into Python ints with int(array),
    which numpy >= 2.4 refuses; upstream fixed it in triton-lang/triton#9172. Scalars in
    dynamic loop bounds need it."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "_hetero_index_fix", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._hetero_index_fix = True
    interpreter._patch_lang_tensor = patched


if INTERPRETED:
    fix_interpreter_index()


@pytest.fixture(autouse=True)
def kernels_runnable(request: pytest.FixtureRequest) -> None:
    """Autouse in a test module that imports it: skips kernel tests that cannot run here."""
    if RERUN and request.node.name != RERUN_TEST:
        pytest.skip("triton was imported without the interpreter: see the rerun test")


def rerun_test(test_file: str):
    """The module's `test_in_a_fresh_interpreter_process`: the file again, in a process of its
    own, when this one cannot run its kernels."""

    @pytest.mark.skipif(not RERUN, reason="the kernels run in this process")
    def test_in_a_fresh_interpreter_process() -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

    return test_in_a_fresh_interpreter_process
