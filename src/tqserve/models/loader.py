"""`load_model`: a Hugging Face directory (config.json + *.safetensors), a GGUF file, or the default model."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from tqdm import tqdm

from tqserve.models.registry import model_class_for_config
from tqserve.tokenizer import Tokenizer


def check_dtype(dtype: torch.dtype, device: torch.device) -> None:
    allowed = (torch.float32, torch.bfloat16) if device.type == "cpu" else (torch.bfloat16,)
    if dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"dtype {dtype} is not supported on {device.type} (supported: {names})")


def build_model(hf_config, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """An unloaded model with every tensor allocated directly on `device`."""
    cls = model_class_for_config(hf_config)
    with torch.device(device):
        model = cls(hf_config, dtype)
    return model.eval()


def iter_safetensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    handles = [safe_open(f, framework="pt", device="cpu") for f in files]
    names = [(h, n) for h in handles for n in h.keys()]  # noqa: SIM118 (safe_open is not iterable)
    for handle, name in tqdm(names, desc="Loading weights", unit="tensor", leave=False):
        yield name, handle.get_tensor(name)


def load_hf_directory(directory: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(directory)
    model = build_model(hf_config, dtype, device)
    model.load_weights(iter_safetensors(directory))
    return model, hf_config, Tokenizer.from_pretrained(directory)


def load_gguf_file(path: str, dtype: torch.dtype, device: torch.device):
    from tqserve.models.gguf_loader import iter_gguf_weights, load_gguf_config, load_gguf_tokenizer
    from tqserve.models.gguf_reader import GGUFFile

    reader = GGUFFile(path)
    hf_config = load_gguf_config(path, reader)
    model = build_model(hf_config, dtype, device)
    # Dequantize on the target device: much faster on a GPU than gguf-py's numpy path.
    model.load_weights(iter_gguf_weights(reader, hf_config, device))
    return model, hf_config, load_gguf_tokenizer(path, reader)


def load_model(model: str | None, dtype: torch.dtype, device: torch.device | str = "cpu"):
    """-> (model, hf_config, tokenizer). `model` is an HF directory, a .gguf file, a directory with
    exactly one .gguf file, or None for the default model (models/default_model.py)."""
    from tqserve.models.default_model import default_model_path

    device = torch.device(device)
    check_dtype(dtype, device)
    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path}: expected a .gguf file or a model directory")
        return load_gguf_file(path, dtype, device)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "config.json")):
            return load_hf_directory(path, dtype, device)
        ggufs = glob.glob(os.path.join(path, "*.gguf"))
        if len(ggufs) == 1:
            return load_gguf_file(ggufs[0], dtype, device)
        raise ValueError(f"{path}: no config.json and {len(ggufs)} .gguf files; pass the file to load")
    raise FileNotFoundError(
        f"model {model!r} not found: pass a local Hugging Face model directory or a .gguf file "
        "(models are not downloaded)"
    )
