"""Triton's interpreter on CPU tensors, as the tests run every Triton kernel without a GPU: the fix
it needs under NumPy 2, applied once on import by every module that defines kernels (the
attention's tiles, the fused element-wise ops), and whether it is on."""

from __future__ import annotations

import os

# Whether the kernels are run by Triton's interpreter (CPU tensors).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _patch_interpreter_for_numpy2() -> None:
    """Triton 3.6's interpreter turns a scalar into a loop bound with `int(array)`, which NumPy
    2.4 refuses for its 1-element (not 0-d) arrays; loops with runtime bounds then fail. Only
    the interpreter (CPU testing) is touched, and only when it is enabled."""
    if not INTERPRETED:
        return
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - a Triton without the interpreter
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_kvserve_patched", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._kvserve_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


_patch_interpreter_for_numpy2()
