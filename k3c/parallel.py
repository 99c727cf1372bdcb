"""The tensor- and expert-parallel layout: which weight and cache is split how, decided once for the compiler
(`shard_tp`, `shard_experts`) and the planner (`k3c plan`, `k3c.retarget`) alike.

Layout over a group of `tp` ranks (Megatron-LM, Shoeybi et al. 2019, §3; DESIGN.md "Passes the model needs": shard_tp):
- column-parallel (rows of the [out, in] weight split, rank r keeps block r): the q/k/v/g projections, the KDA
  gate and beta projections (f_b, b, g_b), the KDA short convolutions, A_log and dt_bias (one slice per head), the
  MLA query up-projection (q_b_proj, or q_proj without a query LoRA) and kv_b_proj with its absorbed halves W_UK /
  W_UV (heads), the dense and shared-expert gate/up projections, and lm_head (a vocabulary slice: the logits are
  all-gathered);
- row-parallel (columns split): o_proj, the dense and shared-expert down projections; their partial sums are
  all-reduced (then split around AttnRes by `split_allreduce`);
- vocabulary-parallel embedding: rank r keeps rows [r·V/tp, (r+1)·V/tp) plus one zero row; a per-rank i64 map
  sends a token to its local row or to the zero row, and the partial embeddings are all-reduced;
- routed experts: `ep == tp` partitions them (rank r keeps experts [r·E/tp, (r+1)·E/tp), a per-rank map renumbers
  the router's choice to a local id or −1 = not here); `ep == 1` splits every expert's intermediate width like a
  dense MLP (w1/w3 column-, w2 row-parallel). MXFP4 experts (`<w>.weight_packed` [E, R, C/2], `<w>.weight_scale`
  [E, R, C/32], `k3c.passes.pack_experts`) split the same way along the same dims, so a width split of w2 cuts
  whole 32-value groups only when tp divides I/32. Both give partial sums over the group, reduced like row-parallel;
- replicated: norms, the query/KV low-rank down projections (q_a_proj, kv_a_proj_with_mqa: per token, shared by all
  heads), the KDA f_a / g_a projections, the router, the LatentMoE down/up projections, AttnRes weights, and the
  whole DSA indexer (its top-k ranks keys by a score summed over every index head: splitting the heads would need an
  all-reduce of [B, T, L] scores per layer, far more than the indexer's own weights).
- caches: KDA state and conv state are per head, so split with the heads; the MLA latent KV and the DSA index keys
  are per token and shared by every head, so every rank keeps the whole cache (sharding them over tokens would need
  a cross-rank softmax merge per attention call).

Every split must be exact: `check_layout` raises ConfigError naming the config field that `tp` does not divide.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3c.errors import ConfigError

COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight", "f_b_proj.weight", "b_proj.weight",
          "g_b_proj.weight", "q_b_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
          "self_attn.A_log", "self_attn.dt_bias", "kv_b_proj.weight", "kv_b_proj.w_uk", "kv_b_proj.w_uv",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "shared_experts.gate_proj.weight",
          "shared_experts.up_proj.weight", "lm_head.weight")
ROW = ("o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight")
EMBEDDING = "model.embed_tokens.weight"
EXPERTS = (".experts.w1", ".experts.w3", ".experts.w2")
#: MXFP4 routed experts: the packed values and scales of expert weight `<w>` (k3c.passes.pack_experts.packed_keys)
MXFP4_PARTS = (".weight_packed", ".weight_scale")
#: values per MXFP4 scale (k3c.ir.formats.MXFP4_GROUP; the planner does not import the IR)
MXFP4_GROUP = 32
#: cache input suffix -> the dim split with the heads (the others are replicated)
CACHE_SPLIT = {".kda_state": 1, ".conv_state": 1}


@dataclass(frozen=True)
class Split:
    """How one tensor is laid out over the group: `kind` is "column" | "row" | "vocab" | "experts" | "replicated";
    `dim` the split dimension (None when replicated)."""

    kind: str
    dim: int | None = None

    @property
    def sharded(self) -> bool:
        return self.dim is not None


REPLICATED = Split("replicated")


def _is_indexer(key: str) -> bool:
    return ".indexer." in key


def param_split(key: str, ep: int = 1) -> Split:
    """The split of parameter `key` (a checkpoint key or a derived one such as `<kv_b_proj>.w_uk`); `ep` chooses
    between partitioned experts (ep > 1) and experts split over their intermediate width (ep == 1)."""
    if key == EMBEDDING:
        return Split("vocab", 0)
    for part in MXFP4_PARTS:
        key = key.removesuffix(part)
    if any(key.endswith(s) for s in EXPERTS):
        if ep > 1:
            return Split("experts", 0)
        return Split("column", 1) if not key.endswith(".w2") else Split("row", 2)
    if _is_indexer(key):
        return REPLICATED
    if key.endswith(ROW):
        return Split("row", 1)
    if key.endswith(COLUMN):
        return Split("column", 0)
    return REPLICATED


def cache_split(name: str) -> Split:
    """The split of cache input `name` (`layers.{i}.kda_state` ...): per-head caches split, per-token ones kept."""
    for suffix, d in CACHE_SPLIT.items():
        if name.endswith(suffix):
            return Split("column", d)
    return REPLICATED


def check_layout(cfg, tp: int, ep: int = 1, experts_dtype: str = "bf16") -> None:
    """Raise ConfigError unless `tp` ranks (and `ep` expert groups) split `cfg` exactly.

    `ep` must be 1 (experts split over their width) or `tp` (experts partitioned over the same ranks). Every count
    a split divides is checked, naming its config field: attention heads, KDA heads, vocabulary, dense and
    expert intermediate widths (in MXFP4 experts, `experts_dtype` "mxfp4", the count of 32-value scale groups of
    the intermediate width), routed experts.
    """
    for flag, v in (("--tp", tp), ("--ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{flag} {v}: expected an integer >= 1")
    if ep not in (1, tp):
        raise ConfigError(f"--ep {ep}: expected 1 (experts split over their width) or --tp ({tp}, experts "
                          f"partitioned over the ranks)")
    if tp == 1:
        return
    counts = [("num_attention_heads", cfg.num_attention_heads), ("vocab_size", cfg.vocab_size),
              ("intermediate_size", cfg.intermediate_size)]
    if cfg.kda_num_heads:
        counts.append(("linear_attn_config.num_heads", cfg.kda_num_heads))
    if cfg.num_experts:
        if ep > 1:
            counts.append(("num_experts", cfg.num_experts))
        elif experts_dtype == "mxfp4":
            counts.append((f"moe_intermediate_size / {MXFP4_GROUP} (MXFP4 scale groups; or use --ep {tp})",
                           cfg.moe_intermediate_size // MXFP4_GROUP))
        else:
            counts.append(("moe_intermediate_size", cfg.moe_intermediate_size))
        shared = cfg.num_shared_experts * cfg.moe_intermediate_size
        if shared:
            counts.append(("num_shared_experts * moe_intermediate_size", shared))
    for field, n in counts:
        if n % tp:
            raise ConfigError(f"--tp {tp} does not divide {field} = {n} of {cfg.name}")


def communication(graph, bindings: dict[str, int], tp: int) -> dict:
    """Bytes one rank sends per call of `graph` (a graph after the parallel phase over `tp` ranks) at `bindings`,
    on a ring (`k3c.ir.ops.collective.wire_bytes`): by collective op, the total, what plain all-reduces in place of
    the reduce-scatter / all-gather pairs would send (each reduce-scatter over tokens stands for one all-reduce of
    its input), and the AttnRes state bytes (the sealed blocks and the inter-block result that `attn_res_inter`
    reads and writes) each rank does not hold because of token sharding: full − shard, where a shard has
    ceil(B·T / tp) rows (so nothing at B·T = 1: the padded shard is as large as the whole)."""
    from k3c.ir.ops.collective import SIMULATE, wire_bytes
    from k3c.ir.types import evaluate, itemsize, numel

    by_op: dict[str, int] = {}
    plain = state = 0
    for n in graph.nodes:
        if n.op in SIMULATE:
            b = evaluate(wire_bytes(n.op, n.attrs, n.inputs[0].type, n.outputs[0].type), bindings)
            by_op[n.op] = by_op.get(n.op, 0) + b
            if n.op == "reduce_scatter_tokens":
                plain += evaluate(wire_bytes("all_reduce", n.attrs, n.inputs[0].type, n.inputs[0].type), bindings)
            elif n.op not in ("all_gather_tokens", "shard_tokens"):
                plain += b
        elif n.op == "attn_res_inter" and n.inputs[1].type.shape[0] == 1:  # blocks are token shards [1, n, D]
            rows = evaluate(n.inputs[1].type.shape[1], bindings)
            full = evaluate(bindings["B"] * bindings["T"], {})
            shard = sum(evaluate(numel(v.type), bindings) * itemsize(v.type.dtype)
                        for v in set(n.inputs[1:]) | set(n.outputs))
            state += shard * (full - rows) // rows
    total = sum(by_op.values())
    return {"bytes_by_op": dict(sorted(by_op.items())), "bytes": total, "plain_allreduce_bytes": plain,
            "saving_bytes": plain - total, "attn_res_state_bytes_not_duplicated": state}
