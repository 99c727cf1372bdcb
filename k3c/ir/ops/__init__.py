"""The k3c op registry, split by family. Importing this package registers every core and model-level op.

Public: `get_op(name) -> OpDef` (raises `UnsupportedError`), `all_ops()`, the `op` decorator and `Attr` for
registering more ops from other modules, and `simulate_collective` for multi-rank tests.
Families: elementwise, reduce, shape, linalg (incl. creation), model_kda, model_attn, model_moe, collective.
"""

from k3c.ir.ops.registry import REQUIRED, Attr, OpDef, all_ops, broadcast_shapes, get_op, op  # noqa: F401
from k3c.ir.ops import elementwise, reduce, shape, linalg, model_kda, model_attn, model_moe, collective  # noqa: F401,E402
from k3c.ir.ops import einsum, norm  # noqa: F401,E402  (frontend: torch.einsum, LayerNorm of the DSA indexer)
from k3c.ir.ops.collective import simulate_collective  # noqa: F401,E402

__all__ = ["REQUIRED", "Attr", "OpDef", "all_ops", "broadcast_shapes", "get_op", "op", "simulate_collective"]
