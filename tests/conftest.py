import os

# Tests share the 2 cores with nothing else; keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

# Without a GPU, the Triton kernels of the CUDA path run in Triton's interpreter (set before the
# first import of triton, which reads it when it builds each kernel).
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreted_loop_bounds() -> None:
    """Triton 3.6's interpreter holds a scalar as a one-element array and turns it into a loop bound
    with int(), which NumPy 2 refuses for arrays of one dimension: take the element instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:  # another Triton: nothing to mend
        return

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreted_loop_bounds()
