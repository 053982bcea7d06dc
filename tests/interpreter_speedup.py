"""A faster Triton interpreter for the CPU test runs: the same semantics, less Python.

Triton's interpreter (3.x) re-patches `triton.language` on every call of one `@triton.jit` function from
another: `_patch_builtin` walks `inspect.getmembers` of the language modules each time and wraps every
builtin it finds. The narrow decode kernel calls dozens of helpers per key tile, so under
TRITON_INTERPRET=1 about a third of a kernel test went to `getmembers` (profile of
test_narrow_decode_matches_reference, forty-fifth session). Here the names of each module's builtins are
listed once, on the first (unpatched) walk; every later call wraps exactly the members that are builtins at
that moment, as the original does, so which functions get wrapped, and how, does not change."""

from __future__ import annotations

import inspect


def install() -> bool:
    """Swap in the cached walk where this Triton has the function it replaces; True if it did."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original, patch_attr = getattr(interpreter, "_patch_builtin", None), getattr(interpreter, "_patch_attr", None)
    if getattr(original, "cached_walk", False):
        return True
    # only the internals this was written against (Triton 3.9); other versions keep their own walk
    if not (
        _params(original) == ["pkg", "builder", "scope"]
        and _params(patch_attr) == ["obj", "name", "member", "builder", "scope"]
    ):
        return False
    is_builtin = tl.core.is_builtin
    names: dict[object, list[str]] = {}

    def patch_builtin(pkg, builder, scope) -> None:
        if pkg not in names:
            names[pkg] = [name for name, member in inspect.getmembers(pkg) if is_builtin(member)]
        for name in names[pkg]:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    patch_builtin.cached_walk = True
    interpreter._patch_builtin = patch_builtin
    return True


def _params(fn) -> list[str] | None:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
