"""Triton's interpreter (TRITON_INTERPRET=1, how the suite runs the Triton kernels on CPU) re-patches
`triton.language` on every call of a nested `@triton.jit` function (`triton/runtime/interpreter.py`:
`InterpretedFunction.__call__` calls `_patch_lang`, which walks `tl`, `tl.tensor` and `tl.math` with
`inspect.getmembers`: about 2.5 ms a call). The model kernels call small jit helpers inside their loops (the KDA
delta-rule step, the MXFP4 decoding, the radix digits), so an interpreted model run spent about 30 % of its time
re-applying patches that were already in place.

`skip_nested_repatching()` wraps `_patch_lang`: while a kernel launch holds the patches (between the launch's
`_patch_lang` and its `scope.restore()`), a nested call whose language modules the launch already patched returns
an empty scope. Any other call goes to Triton's function unchanged, so the semantics are Triton's: the patches a
nested call would apply are the ones in place (the same functions over the same modules)."""

from __future__ import annotations

import inspect


class _NoPatches:
    """The scope of a nested call that patched nothing: nothing to restore."""

    def restore(self) -> None:
        pass


def skip_nested_repatching() -> bool:
    """Install the wrapper; returns False (and changes nothing) when this Triton's interpreter lacks `_patch_lang`
    or `_LangPatchScope.restore`, so another Triton version runs as it is, only slower."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "_k3c_wrapped", False) or \
            not hasattr(getattr(interpreter, "_LangPatchScope", None), "restore"):
        return False
    held: list[set[int]] = []  # the language modules (ids) the running launch patched; empty between launches

    def langs_of(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang(fn):
        langs = langs_of(fn)
        if held and langs <= held[-1]:
            return _NoPatches()
        scope = original(fn)
        if not held:  # a launch: hold its modules until it restores them
            held.append(langs)
            restore = scope.restore

            def restore_and_release():
                held.clear()
                restore()

            scope.restore = restore_and_release
        return scope

    patch_lang._k3c_wrapped = True
    interpreter._patch_lang = patch_lang
    return True
