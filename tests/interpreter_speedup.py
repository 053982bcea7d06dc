"""A faster Triton interpreter for the CPU test runs: the same semantics, less Python.

Triton's interpreter (3.x) re-patches `triton.language` on every call of one `@triton.jit` function from
another: `_patch_builtin` walks `inspect.getmembers` of the language modules each time and wraps every
builtin it finds. The narrow decode kernel calls dozens of helpers per key tile, so under
TRITON_INTERPRET=1 about a third of a kernel test went to `getmembers` (profile of
test_narrow_decode_matches_reference, forty-fifth session). Here the names of each module's builtins are
listed once, on the first (unpatched) walk; every later call wraps exactly the members that are builtins at
that moment, as the original does, so which functions get wrapped, and how, does not change.

It also patches the language on every such call, although the kernel's launch patched it already and keeps
it patched until the grid is done: each nested call rebuilt the same wrappers over every builtin (a fifth
of `test_narrow_tail_loops`, after the cached walk). A nested call whose module sees only language modules
the launch patched now reuses the launch's patches; any other call patches as before.

And `_get_np_dtype`, which every interpreted operation calls, builds its table of 18 numpy dtypes anew on
each call; here each scalar type's answer is kept after its first call."""

from __future__ import annotations

import inspect


def install() -> bool:
    """Swap in the cached walk where this Triton has the function it replaces, and the other shortcuts where
    their internals are as expected (each checks its own); True if the walk went in."""
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
    _reuse_launch_patches(interpreter, tl)
    _cache_np_dtypes(interpreter, tl)
    return True


def _cache_np_dtypes(interpreter, tl) -> None:
    """`_get_np_dtype(t)` depends on t's scalar type only (a block's element type; pointers are uint64)."""
    original = interpreter._get_np_dtype
    if _params(original) != ["tt_dtype"]:
        return
    found: dict = {}

    def get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return original(scalar)
        if scalar not in found:
            found[scalar] = original(scalar)
        return found[scalar]

    interpreter._get_np_dtype = get_np_dtype


class _KeptPatches:
    """The scope a nested call gets when the launch's patches cover it: nothing of its own to restore."""

    def restore(self) -> None:
        pass


def _reuse_launch_patches(interpreter, tl) -> None:
    """Wrap `_patch_lang(fn)`: the launch (`GridExecutor`, no patches active) patches as before and its
    scope's restore ends the grid; a nested call (patches active) whose globals hold only language modules
    patched already gets `_KeptPatches`. Triton's nested calls replaced each wrapper with an equal one and
    never restored theirs (the launch's scope restores the originals), so the patched state is the same."""
    original = interpreter._patch_lang
    if _params(original) != ["fn"]:
        return
    patched: set[int] = set()  # ids of the language modules patched for the running grid
    langs_of: dict[tuple[int, int], frozenset[int]] = {}  # (globals, their size) -> language modules seen
    kept = _KeptPatches()

    def langs(fn) -> frozenset[int]:
        g = fn.__globals__
        key = (id(g), len(g))
        if key not in langs_of:
            langs_of[key] = frozenset(id(v) for v in g.values() if v is tl or v is tl.core)
        return langs_of[key]

    def patch_lang(fn):
        seen = langs(fn)
        if patched and seen <= patched:
            return kept
        launch = not patched
        scope = original(fn)
        patched.update(seen)
        if launch:
            restore = scope.restore

            def restore_and_end() -> None:
                patched.clear()
                restore()

            scope.restore = restore_and_end
        return scope

    interpreter._patch_lang = patch_lang


def _params(fn) -> list[str] | None:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
