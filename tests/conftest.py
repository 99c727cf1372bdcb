"""Suite-wide settings: the on-disk import memo (`k3c.frontend.cache`) is off, so every test (and every CLI it
starts, which inherits the environment) runs the real importer; tests/frontend/test_import_cache.py turns it on.
Without a GPU, Triton kernels run in its interpreter, with nested jit calls not re-patching the language
(triton_interp.py)."""

import os

os.environ["K3C_CACHE_DIR"] = "off"

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on CPU; set before anything imports triton.language, whose own jit
    # functions (tl.sigmoid, tl.cdiv, ...) are made interpreted or compiled when it is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton_interp import skip_nested_repatching

    skip_nested_repatching()
