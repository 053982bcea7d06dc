"""Record the compile keys of Triton kernel launches without running them (CPU, no GPU needed).

Triton compiles one binary per kernel per *specialization*: the constexpr values, each tensor's
dtype and 16-byte alignment, each int's width and whether it is 1 or a multiple of 16, and the
launch options (warps, stages). `LaunchRecorder` replaces the engine's kernels by proxies that work
those keys out the same way and skip the launch, so a CPU run of the engine shows which binaries a
GPU run would need, and whether the startup warm-up already built them.
"""

from __future__ import annotations

import torch

# (module, kernel attribute) of every kernel the engine launches.
KERNELS = [
    ("tqserve.attention.paged", "_paged_attn_kernel"),
    ("tqserve.attention.finish", "_split_reduce_kernel"),
    ("tqserve.attention.finish", "_split_rows_kernel"),
    ("tqserve.attention.finish", "_finish_kernel"),
    ("tqserve.attention.paged_decode", "_decode_kernel"),
    ("tqserve.attention.paged_decode_narrow", "_narrow_decode_kernel"),
    ("tqserve.attention.paged_extend", "_extend_kernel"),
    ("tqserve.kvquant.store_triton", "_store_kv_kernel"),
    ("tqserve.attention.exact_refresh", "_snapshot_kernel"),
    ("tqserve.attention.exact_refresh", "_refresh_kernel"),
]


def _arg_key(value, constexpr: bool, specialize: bool):
    if constexpr:
        return ("constexpr", value)
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("i1",)
    if isinstance(value, int):
        width = "i32" if -(2**31) <= value < 2**31 else "i64"
        if not specialize:
            return (width,)
        return (width, "1" if value == 1 else "D" if value % 16 == 0 else "")
    if isinstance(value, float):
        return ("fp32",)
    if value is None:
        return ("none",)
    return (type(value).__name__,)


class _Proxy:
    def __init__(self, name: str, kernel, sink: set) -> None:
        from triton.runtime.jit import JITFunction

        # Under TRITON_INTERPRET=1 the module holds an interpreter wrapper: read the parameter kinds
        # (constexpr, do_not_specialize) from a JITFunction of the same function and decorator options.
        jit_fn = kernel if hasattr(kernel, "params") else JITFunction(kernel.fn, **kernel.kwargs)
        self.name, self.sink = name, sink
        self.params = jit_fn.params
        self.signature = jit_fn.signature

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = {k: v for k, v in kwargs.items() if k in self.signature.parameters}
            bound = self.signature.bind_partial(*args, **named)
            bound.apply_defaults()
            key = tuple(
                _arg_key(bound.arguments.get(p.name), p.is_constexpr, not p.do_not_specialize) for p in self.params
            )
            options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.signature.parameters))
            self.sink.add((self.name, key, options))
            return None

        return launch


class LaunchRecorder:
    """Context manager: inside it every listed kernel records its compile key into `self.keys`
    (a set of (kernel, argument keys, launch options)) instead of running."""

    def __init__(self) -> None:
        self.keys: set = set()
        self._saved: list = []

    def __enter__(self) -> LaunchRecorder:
        import importlib

        for mod_name, attr in KERNELS:
            mod = importlib.import_module(mod_name)
            fn = getattr(mod, attr)
            self._saved.append((mod, attr, fn))
            setattr(mod, attr, _Proxy(attr, fn, self.keys))
        return self

    def __exit__(self, *exc) -> None:
        for mod, attr, fn in self._saved:
            setattr(mod, attr, fn)

    def take(self) -> set:
        """The keys recorded since the last call."""
        keys = set(self.keys)
        self.keys.clear()
        return keys
