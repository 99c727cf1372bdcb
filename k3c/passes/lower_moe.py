"""Pass `lower_moe` (model phase): each MoE block is checked against the Stable LatentMoE / plain MoE structure
(K3-SPEC.md "MLP and Stable LatentMoE") and its nodes are labelled with their role, so the kernel former groups a
block by label instead of re-discovering it by patterns.

What one MoE block must look like after `canonicalize` (models/layers.py `MoE.forward`; `cast?` optional):

    logits      = linear(cast?(xf, f32), cast?(gate.weight, f32))          router GEMM, fp32      role "router"
    (p, ids)    = moe_route(logits, e_score_correction_bias) {top_k, ...}  sigmoid, top-k, norm   role "route"
    z           = linear(xf, routed_expert_down_proj)                     latent down (K3)       role "down"
    y           = moe_experts(z, p, ids, w1, w3, w2)                      grouped expert GEMMs   role "experts"
    y           = rms_norm(y, routed_expert_norm)                         latent RMSNorm (K3)    role "norm"
    y           = linear(y, routed_expert_up_proj)                        latent up (K3)         role "up"
    s           = linear(act(linear(xf, gate_proj), linear(xf, up_proj)), down_proj)   shared experts, roles
                  "shared_gate", "shared_up", "shared_act" (the elementwise SiTU-GLU / SwiGLU), "shared_down"
    out         = add(y, s)                                               role "combine"

Kimi Linear has no latent (z = xf: no down / norm / up). `xf` ([N, D] tokens) must feed the router, the latent
down-projection (or the experts) and both shared GEMMs.

Decisions. The router GEMM stays a `linear` in fp32 feeding `moe_route` (not folded into moe_route with an attr):
it is a plain GEMM the library path runs well, `moe_route` stays the small sigmoid / top-k / renormalise kernel,
and the registry is unchanged. The latent chain down -> moe_experts -> rms_norm -> up is left as four nodes (the
GEMMs are library kernels, the norm fuses into the up-projection's prologue at kernel forming). Every node of a
block gets `meta["moe_role"]` (one of the roles above) and `meta["moe_block"]` (the block's `moe_experts` output
name); `moe_blocks(graph)` returns the blocks as role -> nodes. The computation is not changed (numerically the
identity). A block that differs raises `IRError` naming its `moe_experts` node and the piece.
"""

from __future__ import annotations

from k3c.context import CompileContext
from k3c.errors import IRError
from k3c.ir.graph import Graph, Node, Value, describe
from k3c.ir.rewrite import shape_error
from k3c.ir.types import dims_equal
from k3c.passes.pipeline import register_pass

ROLES = ("router", "route", "down", "experts", "norm", "up", "shared_gate", "shared_up", "shared_act",
         "shared_down", "combine")
_ACT_OPS = {"mul", "div", "add", "sub", "neg", "tanh", "sigmoid", "silu", "cast"}


class _MoEMatch:
    def __init__(self, graph: Graph, experts: Node):
        self.g, self.ex = graph, experts
        self.roles: dict[str, list[Node]] = {}

    def fail(self, what: str, found: Value | Node | None = None) -> IRError:
        return shape_error(self.g, "lower_moe", f"the MoE block of {describe(self.ex)}", what, found)

    def put(self, role: str, node: Node) -> Node:
        self.roles.setdefault(role, []).append(node)
        return node

    def take(self, v: Value, op: str, what: str, role: str | None) -> Node:
        p = self.g.producer(v)
        if p is None or p.op != op:
            raise self.fail(f"{what}: expected {op}", v)
        return self.put(role, p) if role else p

    def uncast(self, v: Value, role: str) -> Value:
        p = self.g.producer(v)
        if p is not None and p.op == "cast" and p.attrs["to"] == "f32":
            self.put(role, p)
            return p.inputs[0]
        return v

    def only_user(self, v: Value, what: str) -> Node | None:
        us = self.g.users(v)
        if len(us) > 1:
            raise self.fail(f"{what} is read by {len(us)} nodes", us[1])
        return us[0] if us else None

    def run(self) -> dict[str, list[Node]]:
        g, ex = self.g, self.ex
        self.put("experts", ex)
        z, p, ids = ex.inputs[:3]
        route = self.take(p, "moe_route", "expert weights from moe_route", "route")
        if g.producer(ids) is not route:
            raise self.fail("expert ids and weights must come from one moe_route", ids)
        router = self.take(route.inputs[0], "linear", "router logits = linear(x, gate.weight) in fp32", "router")
        if router.outputs[0].type.dtype != "f32" or len(router.inputs) != 2:
            raise self.fail("the router GEMM must be an fp32 linear without bias", router)
        xf = self.uncast(router.inputs[0], "router")
        gw = self.uncast(router.inputs[1], "router")
        if gw not in set(g.params.values()):
            raise self.fail("the router weight must be a parameter (gate.weight)", gw)
        N, D = xf.type.shape
        zp = g.producer(z)
        latent = z is not xf
        if latent:
            down = self.take(z, "linear", "latent down-projection linear(x, routed_expert_down_proj)", "down")
            if down.inputs[0] is not xf:
                raise self.fail("the latent down-projection must read the router's tokens", zp)
        # routed output chain
        y = ex.outputs[0]
        if latent:
            norm = self.only_user(y, "moe_experts output")
            if norm is None or norm.op != "rms_norm" or len(norm.inputs) != 2:
                raise self.fail("the latent expert sum must go through rms_norm(y, routed_expert_norm)", norm)
            self.put("norm", norm)
            up = self.only_user(norm.outputs[0], "routed RMSNorm output")
            if up is None or up.op != "linear" or up.inputs[0] is not norm.outputs[0]:
                raise self.fail("the routed RMSNorm must feed the up-projection linear", up)
            self.put("up", up)
            y = up.outputs[0]
        if not dims_equal(y.type.shape[0], N) or not dims_equal(y.type.shape[-1], D):
            raise self.fail(f"routed output {y.type} is not [N, D] = [{N},{D}]")
        comb = self.only_user(y, "routed output")
        shared_gemms = [u for u in g.users(xf) if u.op == "linear" and u is not router and u.outputs[0] is not z]
        if comb is not None and comb.op == "add" and len(comb.inputs) == 2:
            s = comb.inputs[1] if comb.inputs[0] is y else comb.inputs[0]
            sp = g.producer(s)
            if sp is not None and sp.op == "linear":
                self.shared(s, xf)
                self.put("combine", comb)
        elif shared_gemms:
            raise self.fail("the shared experts' output must be added to the routed output", comb)
        return self.roles

    def shared(self, s: Value, xf: Value) -> None:
        down = self.take(s, "linear", "shared experts down_proj", "shared_down")
        # walk the elementwise activation back to the two GEMMs reading xf
        gemms: list[Node] = []
        act: list[Node] = []
        stack, seen = [down.inputs[0]], set()
        while stack:
            v = stack.pop()
            n = self.g.producer(v)
            if n is None or id(n) in seen:
                if n is None:
                    raise self.fail("the shared activation reads a graph input", v)
                continue
            seen.add(id(n))
            if n.op == "linear":
                if n.inputs[0] is not xf:
                    raise self.fail("a shared expert GEMM must read the MoE input tokens", n)
                gemms.append(n)
            elif n.op in _ACT_OPS:
                act.append(n)
                stack += [x for x in n.inputs]
            else:
                raise self.fail("the shared activation may only be elementwise (SiTU-GLU / SwiGLU)", n)
            if len(seen) > 64:
                raise self.fail("the shared activation is larger than a gated activation")
        if len(gemms) != 2:
            raise self.fail(f"the shared experts need a gate and an up GEMM, found {len(gemms)}")
        # gate_proj is the GEMM whose output is also read through sigmoid / silu (the gated half)
        gated = [n for n in gemms if any(u.op in ("sigmoid", "silu") for u in self.g.users(n.outputs[0]))]
        if len(gated) != 1:
            raise self.fail("cannot tell the shared gate GEMM from the up GEMM (one must feed sigmoid/silu)")
        gate = gated[0]
        up = gemms[0] if gemms[1] is gate else gemms[1]
        self.put("shared_gate", gate)
        self.put("shared_up", up)
        for n in act:
            self.put("shared_act", n)


def moe_blocks(graph: Graph) -> list[dict[str, list[Node]]]:
    """Every MoE block of `graph` as role -> nodes (roles in `ROLES`; absent roles are left out), in graph order.

    Raises `IRError` for a block that does not have the structure of the module docstring.
    """
    return [_MoEMatch(graph, n).run() for n in graph.nodes if n.op == "moe_experts"]


def lower_moe_in_place(graph: Graph) -> int:
    """Check and label every MoE block of `graph` (see the module docstring); returns the number of blocks."""
    blocks = moe_blocks(graph)
    for blk in blocks:
        name = blk["experts"][0].outputs[0].name
        for role, nodes in blk.items():
            for n in nodes:
                if n.meta.get("moe_block", name) != name:
                    raise IRError(f"lower_moe: {describe(n)} belongs to two MoE blocks "
                                  f"({n.meta['moe_block']} and {name})")
                n.meta["moe_role"] = role
                n.meta["moe_block"] = name
                n.meta["pass"] = "lower_moe"
    return len(blocks)


@register_pass("lower_moe")
def lower_moe(graph: Graph, ctx: CompileContext) -> Graph:
    """Pass `lower_moe`: MoE blocks checked and labelled by role (see the module docstring). In place."""
    lower_moe_in_place(graph)
    return graph
