"""Synthetic buffer schedules for testing and benchmarking the planner (no IR needed).

`transformer_schedule` mimics the launches of a K3-style decoder (KDA and global layers 3:1, Block AttnRes with
block states that live until the final readout, a LatentMoE MLP); `random_schedule` draws intervals with mostly
short and some long lifetimes and log-uniform sizes. Both are deterministic for a given seed.

Run `python -m k3c.memory.synthetic` for a table of arena / lower bound and planning time.
"""

from __future__ import annotations

import random
import time

from k3c.memory.planner import Buffer, plan_arena, validate_plan


class _Trace:
    """Records launches; each output's lifetime runs from its producer to its last consumer."""

    def __init__(self) -> None:
        self.step = 0
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.size: dict[str, int] = {}

    def launch(self, inputs: list[str], outputs: dict[str, int]) -> None:
        for name in inputs:
            self.last[name] = self.step
        for name, nbytes in outputs.items():
            self.first[name] = self.last[name] = self.step
            self.size[name] = nbytes
        self.step += 1

    def buffers(self) -> list[Buffer]:
        return [Buffer(n, self.size[n], self.first[n], self.last[n]) for n in self.first]


def transformer_schedule(layers: int = 24, tokens: int = 4096, hidden: int = 7168, heads: int = 96,
                         head_dim: int = 128, latent: int = 3584, experts_per_token: int = 16,
                         block_size: int = 12, expert_launches: int = 0, seed: int = 0) -> list[Buffer]:
    """Buffers of a prefill over `tokens` tokens of a K3-like model (bf16 activations, fp32 gates/stats).

    Per layer (~16 launches): AttnRes inter-block attention and merge, RMSNorm, the mixer (KDA: fused q/k/v
    projection, short conv, gate projections, kda_fused, gated norm, o_proj; global: MLA projections, latent
    cache write, attention, o_proj), AttnRes again, RMSNorm, router, latent down projection, grouped experts,
    norm, up projection, shared expert. `expert_launches` > 0 replaces the grouped expert GEMM by that many
    per-expert launch chains (gather, w1, w3, act, w2 with imbalanced token counts), as an unfused schedule has.
    `seed` jitters token counts per layer a little (padding differences) and the expert loads.
    """
    rng = random.Random(seed)
    tr = _Trace()
    act = 2 * hidden
    tr.launch([], {"embed": tokens * act})
    blocks, partial = [], "embed"
    for layer in range(layers):
        n = tokens + rng.randrange(0, 64)
        p = f"l{layer}."
        srcs = blocks + [partial]
        tr.launch(srcs, {p + "res_stats": n * 8 * (len(srcs) + 1), p + "h_attn": n * act})
        if layer % block_size == 0:
            blocks.append(partial)
            tr.launch([partial], {p + "partial0": n * act})
            partial = p + "partial0"
        tr.launch([p + "h_attn"], {p + "x": n * act})
        if layer % 4 != 3:  # KDA
            tr.launch([p + "x"], {p + "qkv": n * 3 * heads * head_dim * 2})
            tr.launch([p + "qkv"], {p + "qkv_c": n * 3 * heads * head_dim * 2})
            tr.launch([p + "x"], {p + "f": n * heads * head_dim * 4, p + "beta": n * heads * 4})
            tr.launch([p + "x"], {p + "og": n * heads * head_dim * 2})
            tr.launch([p + "qkv_c", p + "f", p + "beta"], {p + "o": n * heads * head_dim * 2})
            tr.launch([p + "o", p + "og"], {p + "y": n * heads * head_dim * 2})
        else:  # global (MLA)
            tr.launch([p + "x"], {p + "q_lat": n * 1536 * 2, p + "kv_lat": n * 576 * 2})
            tr.launch([p + "q_lat"], {p + "q": n * heads * 192 * 2})
            tr.launch([p + "x"], {p + "og": n * heads * 128 * 2})
            tr.launch([p + "q", p + "kv_lat"], {p + "attn": n * heads * 128 * 2, p + "lse": n * heads * 4})
            tr.launch([p + "attn", p + "og"], {p + "y": n * heads * 128 * 2})
        tr.launch([p + "y", partial], {p + "partial": n * act})
        partial = p + "partial"
        tr.launch(blocks + [partial], {p + "h_mlp": n * act})
        tr.launch([p + "h_mlp"], {p + "x2": n * act})
        tr.launch([p + "x2"], {p + "scores": n * 896 * 4, p + "lat": n * latent * 2})
        tr.launch([p + "scores"], {p + "topk_w": n * experts_per_token * 4, p + "topk_i": n * experts_per_token * 4})
        if expert_launches:
            tr.launch([], {p + "exp_out": n * latent * 4})
            for e in range(expert_launches):
                m, q = rng.randint(1, 2 * n * experts_per_token // expert_launches), f"{p}e{e}."
                tr.launch([p + "lat", p + "topk_i"], {q + "xin": m * latent * 2})
                tr.launch([q + "xin"], {q + "h1": m * 512 * 2, q + "h3": m * 512 * 2})
                tr.launch([q + "h1", q + "h3"], {q + "act": m * 512 * 2})
                tr.launch([q + "act", p + "topk_w", p + "exp_out"], {q + "out": m * latent * 2})
                tr.launch([q + "out", p + "exp_out"], {})
        else:
            tr.launch([p + "lat", p + "topk_w", p + "topk_i"], {p + "exp_out": n * latent * 4})
        tr.launch([p + "exp_out"], {p + "up": n * act})
        tr.launch([p + "x2"], {p + "shared": n * act})
        tr.launch([p + "up", p + "shared", partial], {p + "partial_m": n * act})
        partial = p + "partial_m"
    tr.launch(blocks + [partial], {"final": tokens * act})
    tr.launch(["final"], {"logits": tokens * 163840 * 2 // 64})
    return tr.buffers()


def random_schedule(n: int = 2000, steps: int | None = None, seed: int = 0) -> list[Buffer]:
    """`n` buffers over `steps` launches (default n // 2): 90% live 1-8 launches, 10% up to a quarter of the
    schedule; sizes log-uniform in [256 B, 64 MiB]."""
    rng = random.Random(seed)
    steps = steps or max(n // 2, 1)
    out = []
    for i in range(n):
        first = rng.randrange(steps)
        span = rng.randint(0, 7) if rng.random() < 0.9 else rng.randint(0, max(steps // 4, 1))
        size = int(2 ** rng.uniform(8, 26))
        out.append(Buffer(f"b{i}", size, first, min(first + span, steps - 1)))
    return out


def _main() -> None:
    cases = [
        ("transformer 24 layers, 4k tokens", transformer_schedule(24, 4096)),
        ("transformer 93 layers, 8k tokens", transformer_schedule(93, 8192, seed=1)),
        ("transformer 93 layers, per-expert launches", transformer_schedule(93, 4096, expert_launches=48, seed=3)),
        ("transformer 1200 layers (100 AttnRes blocks)", transformer_schedule(1200, 1024, seed=2)),
        ("random 2k buffers", random_schedule(2000, seed=0)),
        ("random 20k buffers", random_schedule(20000, seed=1)),
    ]
    print(f"{'schedule':46} {'buffers':>8} {'arena/LB':>9} {'noreuse/LB':>11} {'strategy':>8} "
          f"{'plan s':>7} {'check s':>7}")
    for name, bufs in cases:
        t0 = time.perf_counter()
        plan = plan_arena(bufs)
        t1 = time.perf_counter()
        validate_plan(plan)
        t2 = time.perf_counter()
        print(f"{name:46} {len(bufs):8} {plan.arena_bytes / plan.lower_bound:9.4f} "
              f"{plan.no_reuse_bytes / plan.lower_bound:11.1f} {plan.strategy:>8} {t1 - t0:7.3f} {t2 - t1:7.3f}")


if __name__ == "__main__":
    _main()
