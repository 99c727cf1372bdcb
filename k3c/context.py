"""The compile context: the one way options reach passes, code generators and the driver (DESIGN.md "Seams").

A `CompileContext` is immutable data: the target, the storage dtype, the compile bounds, the parallel layout and
the backends in the order they may claim kernel groups. The driver builds one per compile and derives one per entry
point (`ctx.for_entry("decode")`), which fixes the symbol bounds {"B", "T", "L"} that cost choices (`absorb_mla`)
and the memory plan (`plan_memory`) are made at. Passes read it; they never stash options on the graph.

    ctx = CompileContext(target=load_target("h200"), dtype="bf16", max_batch=8, max_seq=32768, max_prefill=4096)
    graph, report = run_pipeline(graph, ctx=ctx.for_entry("prefill"))

Backends are objects with a `name` and `claims(kind, nodes) -> bool` (see `k3c.codegen.backend.Backend`); the
context holds them so that `form_kernels` can ask them without importing the code generators.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from k3c.errors import ConfigError

#: entry points: `prefill` returns the last position's logits, `prefill_all` every position's (compiled on request)
ENTRIES = ("prefill", "prefill_all", "decode")
DTYPES = ("bf16", "f32")
#: storage of the KDA recurrent state (`kda_state_dtype`): the kernels load it, compute in f32 and round it on store
KDA_STATE_DTYPES = ("f32", "bf16")
#: storage of the DSA indexer's key cache (`dsa_index_keys`): "bf16" = the model's dtype; "fp8" = e4m3 keys with one
#: f32 scale per key (`fp8_quantize`), scored with e4m3 queries (`dsa_index_topk_ref`); "fp8-rerank" = e4m3 keys with a
#: power-of-two scale and a 4-bit low residual per element (`fp8_split`), the topk + DSA_RERANK_EXTRA best by the
#: e4m3 scan re-ranked by their joined keys' exact scores
DSA_INDEX_KEYS = ("bf16", "fp8", "fp8-rerank")
#: E of "fp8-rerank" (the op's `rerank` attr): Gaussian keys at 128K-1M keep >= 99.6 % of the exact top-2048 with
#: 512 (BENCHMARKS.md "FP8 index keys + 4-bit residual")
DSA_RERANK_EXTRA = 512


def bounds_bindings(entry: str, max_batch: int, max_seq: int, max_prefill: int) -> dict[str, int]:
    """Symbol values {"B", "T", "L"} at the compile bounds for `entry` (one of `ENTRIES`).

    T is the tokens of one call (max_prefill for the prefill entries, 1 for decode); L the context already cached, so that
    L + T = max_seq. Raises ConfigError (naming the flags) unless 1 <= max_prefill <= max_seq and max_batch >= 1,
    all below 2^31.
    """
    if entry not in ENTRIES:
        raise ConfigError(f"entry {entry!r}: expected one of {', '.join(ENTRIES)}")
    if min(max_batch, max_seq, max_prefill) < 1 or max_prefill > max_seq:
        raise ConfigError(f"bounds must satisfy 1 <= --max-prefill ({max_prefill}) <= --max-seq ({max_seq}) and "
                          f"--max-batch ({max_batch}) >= 1")
    for flag, value in (("--max-batch", max_batch), ("--max-seq", max_seq), ("--max-prefill", max_prefill)):
        if value >= 2 ** 31:  # token positions and rows are int32 in the kernels
            raise ConfigError(f"{flag} {value}: must be below 2^31 (token positions and rows are 32-bit)")
    T = 1 if entry == "decode" else max_prefill
    return {"B": max_batch, "T": T, "L": max_seq - T}


def check_kda_state(dtype: str) -> str:
    """`dtype` if it is one of KDA_STATE_DTYPES; else ConfigError naming the flag, the option and the choices."""
    if dtype not in KDA_STATE_DTYPES:
        raise ConfigError(f"--kda-state {dtype} (kda_state_dtype): expected one of {', '.join(KDA_STATE_DTYPES)}")
    return dtype


def check_dsa_index_keys(keys: str) -> str:
    """`keys` if it is one of DSA_INDEX_KEYS; else ConfigError naming the flag, the option and the choices."""
    if keys not in DSA_INDEX_KEYS:
        raise ConfigError(f"--dsa-index-keys {keys} (dsa_index_keys): expected one of {', '.join(DSA_INDEX_KEYS)}")
    return keys


def check_dsa_index_keys_for(cfg, keys: str) -> str:
    """`check_dsa_index_keys`, and ConfigError for a storage other than bf16 on a model `cfg` (a
    models.config.K3Config) without DSA layers: it has no index-key cache to store."""
    check_dsa_index_keys(keys)
    if keys != "bf16" and not cfg.dsa_layers:
        raise ConfigError(f"--dsa-index-keys {keys} (dsa_index_keys): {cfg.name} has no DSA layers "
                          f"(config: dsa_config.dsa_layers), so there is no index-key cache to store; leave it at bf16")
    return keys


@dataclass(frozen=True)
class CompileContext:
    """Options of one compile (see the module docstring).

    target: a `k3c.targets.Target` (None: the default "h200"). dtype: storage dtype of activations and weights
    ("bf16" | "f32"). max_batch / max_seq / max_prefill: bounds in sequences and tokens. entry: the entry point
    being compiled ("prefill" | "decode"), None before `for_entry`. tp / ep: tensor- and expert-parallel degrees;
    rank: this rank's index in [0, tp). backend: the preferred code-generating backend ("triton", "tvm"), None for
    the target's own order. backends: resolved backend objects in claim order (filled by `resolve`).
    experts_dtype: storage of routed experts ("bf16" keeps them dense; "mxfp4" keeps a 4-bit checkpoint 4-bit;
    None: as the checkpoint stores them). kda_state_dtype: storage of the KDA recurrent state S [B,H,K,V] in its
    pool ("f32" | "bf16": half the bytes; every update still computes in f32 and rounds the new state once per
    call, `kda_fused_ref`); independent of `dtype` (an f32 model with a bf16 state keeps everything else f32).
    dsa_index_keys: storage of every DSA layer's index-key cache ("bf16": the model's dtype; "fp8": e4m3 keys
    [B,L,D] + f32 scales [B,L], 132 instead of 256 bytes per token at D = 128; "fp8-rerank": the same + 4-bit
    residuals u8 [B,L,D/2], 196 bytes, the scan still reading 132; the import carries it in the cache values'
    dtypes, `k3c.frontend.index_keys`).
    mxfp4_scale_max: the largest E8M0 scale byte of the checkpoint's MXFP4 experts, which the driver reads with
    them (`k3c.compile`); None: not known (no weights, or dense experts). `pack_experts` records it on the
    `moe_experts` nodes as `scale_max`, where code generators may use it (it never changes a value).
    """

    target: Any = None
    dtype: str = "f32"
    max_batch: int = 1
    max_seq: int = 4096
    max_prefill: int = 1024
    entry: str | None = None
    tp: int = 1
    ep: int = 1
    rank: int = 0
    backend: str | None = None
    experts_dtype: str | None = None
    kda_state_dtype: str = "f32"
    dsa_index_keys: str = "bf16"
    mxfp4_scale_max: int | None = None
    backends: tuple = field(default=(), compare=False)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype}: expected one of {', '.join(DTYPES)}")
        check_kda_state(self.kda_state_dtype)
        check_dsa_index_keys(self.dsa_index_keys)
        if self.mxfp4_scale_max is not None and not 0 <= self.mxfp4_scale_max <= 255:
            raise ConfigError(f"mxfp4_scale_max {self.mxfp4_scale_max}: expected an E8M0 byte, 0..255")
        for flag, v in (("--tp", self.tp), ("--ep", self.ep)):
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{flag} {v}: expected an integer >= 1")
        if not 0 <= self.rank < self.tp:
            raise ConfigError(f"rank {self.rank}: expected 0 <= rank < tp ({self.tp})")
        bounds_bindings("decode", self.max_batch, self.max_seq, self.max_prefill)  # validates the bounds

    # ---- derived contexts ---------------------------------------------------------------------------------------
    def for_entry(self, entry: str) -> "CompileContext":
        """This context for one entry point (fixes `bounds`); raises ConfigError for an unknown entry."""
        if entry not in ENTRIES:
            raise ConfigError(f"entry {entry!r}: expected one of {', '.join(ENTRIES)}")
        return replace(self, entry=entry)

    def replace(self, **changes) -> "CompileContext":
        """A copy with `changes` applied (validated again)."""
        return replace(self, **changes)

    def resolve(self) -> "CompileContext":
        """This context with `target` loaded (default "h200") and `backends` resolved from the code generators'
        registry in the target's claim order (`k3c.codegen.backend.backends_for`). Idempotent."""
        from k3c.codegen.backend import backends_for
        from k3c.targets import load_target

        target = load_target(self.target if self.target is not None else "h200")
        backends = self.backends or backends_for(target, self.backend)
        return replace(self, target=target, backends=tuple(backends))

    # ---- views --------------------------------------------------------------------------------------------------
    @property
    def bounds(self) -> dict[str, int]:
        """{"B", "T", "L"} at the compile bounds of `entry` (prefill when no entry is set)."""
        return bounds_bindings(self.entry or "prefill", self.max_batch, self.max_seq, self.max_prefill)

    @property
    def bounds_json(self) -> dict[str, int]:
        """The bounds as the artifact records them (flags' names)."""
        return {"max_batch": self.max_batch, "max_seq": self.max_seq, "max_prefill": self.max_prefill}
