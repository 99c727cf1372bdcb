"""k3c: an ahead-of-time compiler for the Kimi K3 model family."""

__version__ = "0.1.0"


def load(path, device="cpu", *, cuda_graphs=True, finalize=False):
    """Load a compiled artifact for execution: `k3c.load(path, device).prefill(tokens)` (see k3c.runtime.session)."""
    from k3c.runtime.session import load as _load

    return _load(path, device, cuda_graphs=cuda_graphs, finalize=finalize)
