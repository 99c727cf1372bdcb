"""Hardware retargeting: what a K3-family model needs on a given chip and GPU count, without the hardware.

`estimate(cfg, target, tp, max_batch, max_seq, context)` returns per-GPU memory (weights + persistent cache pools)
and a roofline estimate of one decode step. Assumptions, each stated where it is used:
- weights are split over `tp` GPUs by the layout the compiler uses (`k3c.parallel`: column/row-parallel
  attention, KDA and dense projections, vocabulary-parallel embedding and lm_head, routed experts partitioned
  (ep = tp), norms, low-rank down projections, router and DSA indexer replicated); a tp that layout cannot split
  is refused as `k3c compile --tp` refuses it; routed experts are stored as MXFP4 (4 bits + one E8M0 byte per 32
  values = 4.25 bits) when the config's `quantization_config` says so (as `k3c compile` keeps them;
  `experts_dtype` "bf16" sizes a dequantized build), fp32 for the published fp32 parameters, bf16 for the rest;
- the fewest GPUs (`min_gpus`): each holds the replicated weights whole, its share of the rest and its own caches
  (the KDA heads split, the latent caches whole); `min_tp`: the fewest of at least that many the layout splits;
- a decode step reads every non-expert weight once, and the experts that the batch touches: with uniform routing,
  the expected number of distinct experts of E chosen by B tokens taking k each is E·(1 − (1 − k/E)^B);
- caches: KDA state read + written (in `kda_state_dtype`: f32 by default, bf16 half the bytes), MLA latent read
  for every visible token (DSA: the top-k only, plus the index keys of every token), per `k3c.memory.pools`;
- FLOPs: 2 per active parameter per token, plus attention (latent scores and outputs, indexer scores);
- tensor parallelism adds, per layer, two reduce-scatter + all-gather pairs over tokens of [B, D] bf16 (the
  `split_allreduce` form: each rank holds ceil(B/tp) rows), ring cost 2 · 2·(tp−1)·ceil(B/tp)·D·2 bytes / link
  bandwidth (equal to two all-reduces when tp divides B; more below, where the padded shards still travel).
Roofline: Williams, Waterman & Patterson (2009); time = max(FLOPs / peak, bytes / bandwidth) + communication.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from k3c.context import DSA_RERANK_EXTRA, check_dsa_index_keys_for, check_kda_state
from k3c.errors import ConfigError
from k3c.ir.formats import MXFP4_BITS
from k3c.memory.pools import cache_pools, pools_total_bytes
from k3c.parallel import check_layout, param_split
from k3c.targets import Target, load_target
from models.config import K3Config
from models.layers import FP32_PARAM_SUFFIXES


@dataclass
class Estimate:
    """Per-GPU figures in bytes, FLOP and seconds; `fits` compares weights + pools with the target's memory."""

    model: str
    target: str
    tp: int
    params: int
    active_params_per_token: int
    weight_bytes_per_gpu: int
    pool_bytes_per_gpu: int
    pools: dict
    memory_bytes: int
    fits: bool
    min_gpus: int | None        # the fewest GPUs whose memory holds it (any count)
    min_tp: int | None          # the fewest of at least that many that `k3c compile --tp` splits it over
    decode_batch: int
    decode_context: int
    decode_bytes_per_gpu: float
    decode_flops_per_gpu: float
    decode_comm_s: float
    decode_step_s: float
    decode_bound: str
    decode_tokens_per_s: float

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Weights:
    """Parameter counts and bytes as published (see the module docstring for the storage assumptions)."""

    params: int
    expert_params: int
    nbytes: int
    expert_bytes: int
    bytes_per_expert_layer: float  # one routed expert of one MoE layer (w1 + w2 + w3)
    bytes_per_rank: int = 0  # at the `tp` given to `weights`, split as `k3c.parallel.param_split` says
    replicated_bytes: int = 0  # whole on every rank (`param_split`'s REPLICATED): a rank holds these + the rest / tp

    def rank_bytes(self, ranks: int) -> float:
        """One rank's bytes over `ranks` ranks: the replicated tensors whole, the others split."""
        return self.replicated_bytes + (self.nbytes - self.replicated_bytes) / ranks


def weights(cfg: K3Config, tp: int = 1, experts_dtype: str | None = None) -> Weights:
    """Count the parameters of `cfg` on the meta device and size them as the published checkpoint stores them;
    routed experts as `experts_dtype` ("mxfp4" | "bf16"; default: the checkpoint's); `bytes_per_rank`: one rank's
    share over `tp` ranks (replicated tensors whole on every rank). Raises ConfigError for another experts dtype."""
    from k3c.frontend import build_meta_model

    experts_dtype = experts_dtype or ("mxfp4" if cfg.expert_quantization == "mxfp4" else "bf16")
    if experts_dtype not in ("mxfp4", "bf16"):
        raise ConfigError(f"experts dtype {experts_dtype!r}: expected mxfp4 or bf16")
    w = Weights(0, 0, 0, 0, 0.0)
    per_rank = 0.0
    for name, p in build_meta_model(cfg).named_parameters():
        n = p.numel()
        w.params += n
        if ".experts.w" in name:
            b = n * MXFP4_BITS / 8 if experts_dtype == "mxfp4" else n * 2
            w.expert_params += n
            w.expert_bytes += int(b)
            w.bytes_per_expert_layer += b / p.shape[0]
        else:
            b = n * (4 if name.endswith(FP32_PARAM_SUFFIXES) else 2)
        w.nbytes += int(b)
        sharded = param_split(name, ep=tp).sharded
        per_rank += b / tp if sharded else b
        w.replicated_bytes += 0 if sharded else int(b)
    w.bytes_per_rank = int(per_rank)
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    w.bytes_per_expert_layer /= max(moe_layers, 1)
    return w


def estimate(cfg: K3Config, target: Target | str, tp: int = 1, max_batch: int = 1, max_seq: int = 1 << 20,
             context: int | None = None, dtype: str = "bfloat16", experts_dtype: str | None = None,
             kda_state_dtype: str = "f32", dsa_index_keys: str | None = None) -> Estimate:
    """Memory per GPU and a decode-step roofline for `cfg` on `tp` GPUs of `target` (see the module docstring).

    max_batch / max_seq bound the caches; the decode step is estimated at batch `max_batch` and `context` cached
    tokens (default max_seq); routed experts sized as `experts_dtype` (see `weights`); the KDA state stored as
    `kda_state_dtype` ("f32" | "bf16", `k3c compile --kda-state`); the DSA index keys as `dsa_index_keys` ("fp8":
    e4m3 + one f32 scale per key, K3-SPEC.md's sizes; "fp8-rerank": + a 4-bit residual per element, the scan
    reading the fp8 part and the re-rank the topk + E candidates' residuals; "bf16"; `k3c compile
    --dsa-index-keys`, whose default is bf16; None: fp8 for a model with DSA layers, else bf16).
    Raises ConfigError for tp < 1, bounds < 1 or >= 2^31, max_seq beyond the model's context, a context outside
    [0, max_seq], a bad experts, KDA state or index-key dtype, index keys other than bf16 on a model without DSA
    layers.
    """
    check_kda_state(kda_state_dtype)
    dsa_index_keys = check_dsa_index_keys_for(cfg, dsa_index_keys or ("fp8" if cfg.dsa_layers else "bf16"))
    fp8_keys = dsa_index_keys != "bf16"
    residuals = dsa_index_keys == "fp8-rerank"
    target = load_target(target)
    if tp < 1 or max_batch < 1 or max_seq < 1:
        raise ConfigError(f"tp ({tp}), max_batch ({max_batch}) and max_seq ({max_seq}) must be >= 1")
    if max(tp, max_batch, max_seq) >= 2 ** 31:  # as `k3c compile` bounds them (`bounds_bindings`)
        raise ConfigError(f"tp ({tp}), max_batch ({max_batch}) and max_seq ({max_seq}) must be below 2^31")
    check_layout(cfg, tp, tp)
    if cfg.max_position_embeddings and max_seq > cfg.max_position_embeddings:
        raise ConfigError(f"max_seq {max_seq} exceeds the model's context of {cfg.max_position_embeddings} tokens "
                          f"(config: max_position_embeddings)")
    context = max_seq if context is None else context
    if not 0 <= context <= max_seq:
        raise ConfigError(f"context {context}: the cached tokens of the decode estimate must be in [0, max_seq "
                          f"{max_seq}]")
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
    n_kda, n_dsa = kinds.count("kda"), kinds.count("dsa")
    n_global = len(kinds) - n_kda
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    w = weights(cfg, tp, experts_dtype)
    weight_bytes, expert_bytes, per_expert = w.nbytes, w.expert_bytes, w.bytes_per_expert_layer
    E, k = cfg.num_experts, cfg.num_experts_per_token
    active = w.params - w.expert_params + w.expert_params * k // E

    def pools_at(ranks):        # one rank's caches: the KDA heads split over the ranks, the latent caches whole
        return cache_pools(max_batch=max_batch, max_seq=max_seq, kda_layers=n_kda,
                           kda_heads=-(-cfg.kda_num_heads // ranks), kda_head_dim=cfg.kda_head_dim,
                           kda_conv_kernel=cfg.conv_kernel_size, global_layers=n_global, kv_lora_rank=cfg.kv_lora_rank,
                           qk_rope_head_dim=cfg.qk_rope_head_dim, dsa_layers=n_dsa, index_head_dim=cfg.index_head_dim,
                           state_dtype=kda_state_dtype, index_dtype="float8_e4m3fn" if fp8_keys else "bfloat16",
                           index_scale_dtype="float32" if fp8_keys else None, index_residuals=residuals)

    pools = pools_at(tp)
    pool_bytes = pools_total_bytes(pools)
    weight_gpu = w.bytes_per_rank
    # decode step, per GPU
    B, L = max_batch, context
    touched = E * (1 - (1 - k / E) ** B) if E else 0
    w_read = (weight_bytes - expert_bytes - cfg.vocab_size * cfg.hidden_size * 2) + touched * per_expert * moe_layers
    kda_state = pools["kda_state"].nbytes // max_batch * B if n_kda else 0  # one rank's heads (pools are per rank)
    lat = cfg.mla_cache_width * 2
    attn_tokens = min(L, cfg.index_topk) if n_dsa else L
    key_bytes = cfg.index_head_dim + 4 if fp8_keys else cfg.index_head_dim * 2     # per cached token
    rerank = min(L, cfg.index_topk + DSA_RERANK_EXTRA) * (cfg.index_head_dim * 3 // 2 + 4) if residuals else 0
    kv_read = B * ((n_global - n_dsa) * L * lat + n_dsa * (attn_tokens * lat + L * key_bytes + rerank))
    bytes_gpu = (w_read + kv_read) / tp + 2 * kda_state
    H = cfg.num_attention_heads
    attn_flops = B * n_global * 2 * H * attn_tokens * (cfg.mla_cache_width + cfg.kv_lora_rank)
    attn_flops += B * n_dsa * 2 * cfg.index_num_heads * cfg.index_head_dim * L
    kda_flops = B * n_kda * cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 8
    flops_gpu = (2 * active * B + attn_flops + kda_flops) / tp
    comm = 0.0
    if tp > 1:
        link = target.interconnect_bandwidth
        if not link:
            raise ConfigError(f"target '{target.name}' has no interconnect bandwidth; tp > 1 needs one")
        comm = 2 * cfg.num_hidden_layers * 2 * (tp - 1) * -(-B // tp) * cfg.hidden_size * 2 / link
    compute_s, memory_s = flops_gpu / target.peak(dtype, measured=True), bytes_gpu / target.bandwidth(measured=True)
    step = max(compute_s, memory_s) + comm
    mem = int(target.measured.get("memory_bytes", target.memory_bytes))
    # the fewest GPUs whose share of the weights (replicated tensors whole) and own caches fit: one answer whatever
    # `tp` was asked; then the fewest of at least that many that the compiler's layout splits the model over
    min_gpus = next((n for n in range(1, 4097) if w.rank_bytes(n) + pools_total_bytes(pools_at(n)) <= mem), None)
    min_tp = None if min_gpus is None else next((n for n in range(min_gpus, 4097) if splits(cfg, n)), None)
    return Estimate(cfg.name, target.name, tp, w.params, int(active), weight_gpu, pool_bytes,
                    {k_: p.to_json() for k_, p in pools.items()}, mem, weight_gpu + pool_bytes <= mem, min_gpus, min_tp,
                    B, L, bytes_gpu, flops_gpu, comm, step, "compute" if compute_s > memory_s else "memory",
                    B / step)


def splits(cfg: K3Config, ranks: int, eps: tuple[int, ...] | None = None) -> bool:
    """Whether `k3c compile --tp ranks` splits `cfg` with one of the expert-parallel degrees `eps` (`check_layout`);
    default: its experts partitioned (--ep ranks) or split over their width (--ep 1), which give a rank the same
    bytes. `estimate` splits with --ep ranks: `splits(cfg, ranks, (ranks,))`."""
    for ep in eps or (ranks, 1):
        try:
            check_layout(cfg, ranks, ep)
            return True
        except ConfigError:
            pass
    return False


__all__ = ["Estimate", "MXFP4_BITS", "Weights", "estimate", "splits", "weights"]
