"""Persistent pools: caches that outlive one call (decode states, KV) or one whole forward (AttnRes blocks).

A pure function of plain numbers (layer counts, widths, dtypes, bounds), so it can be checked against the
arithmetic of K3-SPEC.md ("Sizes to check a memory plan against") without building a model. Under tensor
parallelism pass the per-rank head counts (KDA heads are sharded; the MLA latent and the DSA index key are
shared by all heads, so they are replicated per rank).

Pools (shapes; B = max_batch, S = max_seq):
- kda_state       [L_kda, B, H, K, V]   recurrent state S of the delta rule (K3-SPEC "KDA layer"; fp32 by default,
                                        bf16 with `k3c compile --kda-state bf16`)
- kda_conv        [L_kda, B, 3·H·K, W]  last W inputs of the q, k and v short convolutions (kernel W = 4)
- mla_latent_kv   [L_global, B, S, kv_lora_rank + qk_rope_head_dim]   576 values per token (K3-SPEC "Gated MLA")
- dsa_index_keys  [L_dsa, B, S, index_head_dim]   the indexer's key per token (K3-SPEC "Gated DSA"; FP8 default)
- dsa_index_scales [L_dsa, B, S]                  f32 scale per FP8 key (`k3c compile --dsa-index-keys fp8`)
- dsa_index_residuals [L_dsa, B, S, index_head_dim / 2]   4-bit low residual per FP8 key element, two a byte
                                                  (`--dsa-index-keys fp8-rerank`)
- attn_res_blocks [sources, T_max, hidden]   Block AttnRes sources (sealed blocks + partial sum) for every token
                                              in flight (T_max = max tokens per call, e.g. B × max_prefill)
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from k3c.errors import ConfigError

#: bytes per element of the dtypes a pool may use (torch names, so `getattr(torch, dtype)` works)
DTYPE_BYTES = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1, "int32": 4, "int64": 8,
}
_ALIASES = {"fp64": "float64", "fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
            "half": "float16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def dtype_name(dtype: str) -> str:
    """Canonical torch dtype name for `dtype` ('bf16', 'torch.bfloat16', 'bfloat16' -> 'bfloat16').
    Raises ConfigError for a dtype not in DTYPE_BYTES."""
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name.lower(), name)
    if name not in DTYPE_BYTES:
        raise ConfigError(f"unknown pool dtype '{dtype}'; known: {sorted(DTYPE_BYTES)} (aliases {sorted(_ALIASES)})")
    return name


@dataclass(frozen=True)
class Pool:
    """One persistent buffer: `shape` in elements, `dtype` a torch dtype name, `nbytes` = prod(shape) × itemsize."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    doc: str

    def to_json(self) -> dict:
        """Plain JSON data for plan.json's `pools`."""
        return {"shape": list(self.shape), "dtype": self.dtype, "bytes": self.nbytes, "doc": self.doc}


def _pool(name: str, shape: tuple[int, ...], dtype: str, doc: str) -> Pool:
    dtype = dtype_name(dtype)
    return Pool(name, tuple(shape), dtype, prod(shape) * DTYPE_BYTES[dtype], doc)


def attn_res_sources(num_layers: int, block_size: int) -> int:
    """Sources the final AttnRes readout sees: blocks sealed at layers 0, block_size, ... plus the partial sum.
    K3-SPEC "Decoder layer": 93 layers in blocks of 12 -> 8 sealed blocks + partial = 9."""
    if num_layers <= 0 or block_size <= 0:
        raise ConfigError(f"attn_res_sources: num_layers ({num_layers}) and block_size ({block_size}) must be > 0")
    return -(-num_layers // block_size) + 1


def cache_pools(*, max_batch: int, max_seq: int,
                kda_layers: int = 0, kda_heads: int = 0, kda_head_dim: int = 0, kda_conv_kernel: int = 4,
                global_layers: int = 0, kv_lora_rank: int = 0, qk_rope_head_dim: int = 0,
                dsa_layers: int = 0, index_head_dim: int = 0,
                attn_res_sources: int = 0, hidden_size: int = 0, max_tokens_in_flight: int = 0,
                state_dtype: str = "float32", conv_dtype: str = "bfloat16", kv_dtype: str = "bfloat16",
                index_dtype: str = "float8_e4m3fn", index_scale_dtype: str | None = None, index_residuals: bool = False,
                attn_res_dtype: str = "bfloat16") -> dict[str, Pool]:
    """The persistent pools of one rank, by name, in a fixed order; kinds with zero layers are left out.

    Units: counts in elements/tokens/sequences; `max_batch` sequences of up to `max_seq` tokens each.
    Sizes: K3-SPEC.md "Sizes to check a memory plan against" (e.g. K3.1 Pro: kda_state 69×96×128×128×2 B
    ≈ 207 MiB in bf16 per sequence; mla_latent_kv 1152 B per token per global layer; dsa_index_keys 128 B per
    token per layer in FP8; attn_res_blocks 9×7168×2 B per token in flight). index_scale_dtype: None, or the dtype of
    one scale per index key (f32 with the compiler's FP8 keys: 4 B per token per layer more); index_residuals: the
    4-bit residuals of `fp8-rerank` (index_head_dim / 2 B per token per layer more).
    Raises: ConfigError on a negative count, a missing width for a kind that has layers, or an unknown dtype.
    """
    ints = dict(max_batch=max_batch, max_seq=max_seq, kda_layers=kda_layers, kda_heads=kda_heads,
                kda_head_dim=kda_head_dim, kda_conv_kernel=kda_conv_kernel, global_layers=global_layers,
                kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, dsa_layers=dsa_layers,
                index_head_dim=index_head_dim, attn_res_sources=attn_res_sources, hidden_size=hidden_size,
                max_tokens_in_flight=max_tokens_in_flight)
    for key, value in ints.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"cache_pools: {key} must be a non-negative int, got {value!r}")
    for key in ("max_batch", "max_seq"):
        if ints[key] == 0:
            raise ConfigError(f"cache_pools: {key} must be > 0")

    def need(kind: str, *keys: str) -> None:
        missing = [k for k in keys if ints[k] == 0]
        if missing:
            raise ConfigError(f"cache_pools: {kind} is set but {', '.join(missing)} is 0")

    B, S = max_batch, max_seq
    pools: dict[str, Pool] = {}
    if kda_layers:
        need("kda_layers", "kda_heads", "kda_head_dim", "kda_conv_kernel")
        H, K = kda_heads, kda_head_dim
        pools["kda_state"] = _pool("kda_state", (kda_layers, B, H, K, K), state_dtype,
                                   "KDA recurrent state S [L_kda, B, H, K, V] (K3-SPEC 'KDA layer')")
        pools["kda_conv"] = _pool("kda_conv", (kda_layers, B, 3 * H * K, kda_conv_kernel), conv_dtype,
                                  "KDA q/k/v short-conv inputs [L_kda, B, 3*H*K, W]")
    if global_layers:
        need("global_layers", "kv_lora_rank")
        pools["mla_latent_kv"] = _pool("mla_latent_kv", (global_layers, B, S, kv_lora_rank + qk_rope_head_dim),
                                       kv_dtype, "MLA latent c ++ k_pe per token [L_global, B, S, R + rope]")
    if dsa_layers:
        need("dsa_layers", "index_head_dim")
        pools["dsa_index_keys"] = _pool("dsa_index_keys", (dsa_layers, B, S, index_head_dim), index_dtype,
                                        "DSA lightning-indexer keys k_I per token [L_dsa, B, S, D_I]")
        if index_scale_dtype is not None:
            pools["dsa_index_scales"] = _pool("dsa_index_scales", (dsa_layers, B, S), index_scale_dtype,
                                              "one scale per FP8 index key [L_dsa, B, S]")
        if index_residuals:
            pools["dsa_index_residuals"] = _pool("dsa_index_residuals", (dsa_layers, B, S, index_head_dim // 2),
                                                 "uint8", "4-bit residuals of the FP8 index keys, two a byte "
                                                 "[L_dsa, B, S, D_I / 2]")
    if attn_res_sources:
        need("attn_res_sources", "hidden_size", "max_tokens_in_flight")
        pools["attn_res_blocks"] = _pool("attn_res_blocks", (attn_res_sources, max_tokens_in_flight, hidden_size),
                                         attn_res_dtype, "Block AttnRes sources per token in flight [N, T_max, D]")
    return pools


def pools_total_bytes(pools: dict[str, Pool]) -> int:
    """Sum of the pools' sizes in bytes."""
    return sum(p.nbytes for p in pools.values())
