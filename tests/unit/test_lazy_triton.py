"""The CPU model path must not import Triton: it is an extra (`gpu`, `dev`), not a base dependency, so the
layers import their one-launch kernels (`tqserve.ops`) only when they run on CUDA tensors."""

from __future__ import annotations

import subprocess
import sys


def test_model_layers_do_not_import_triton():
    code = (
        "import sys\n"
        "import tqserve.engine.model_runner, tqserve.engine.llm_engine, tqserve.models.llama\n"
        "import tqserve.layers.norm, tqserve.layers.rotary, tqserve.layers.gated_attention\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
