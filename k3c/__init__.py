"""k3c: an ahead-of-time compiler for the Kimi K3 model family."""

__version__ = "0.1.0"
