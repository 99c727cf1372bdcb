"""The launch census (`k3c.runtime.census`) of one decode step of the shared k3.1-pro-tiny Triton artifact, on CPU:
it counts what each schedule launch starts, and the decode step has no glue around the kernels where the kernels
can take the values as they are (router logits and expert inputs read as column views, AttnRes rows fused, append
positions from a cached arange)."""

from __future__ import annotations

import torch

import k3c
from k3c.runtime.census import census, summary
from models.config import K3Config


def test_decode_census(compiled):
    _, art, _ = compiled("k3.1-pro-tiny")
    cfg = K3Config.from_pretrained("k3.1-pro-tiny")
    session = k3c.load(art, "cpu")
    session.prefill(torch.tensor([[3, 1, 4]]))
    session.decode(torch.tensor([[2]]))      # the eager step before a graph capture (makes the cached arange)
    before = session.length
    rows = census(session, torch.tensor([[5]]))
    assert session.length == before + 1 and int(session.lengths[0]) == before + 1
    launches = session.schedule["decode"]["launches"]
    assert [r.name for r in rows[1:-1]] == [ln["name"] for ln in launches]
    by_kind: dict[str, list] = {}
    for r in rows:
        by_kind.setdefault(r.kind, []).append(r)
    # a fused row launch is one kernel and nothing else; so are the norms, pointwise chains, KDA and the router
    for kind in ("attn_res_row", "rowwise", "pointwise", "kda_fused", "moe_route", "attn_res_merge"):
        for r in by_kind.get(kind, []):
            assert not r.aten and sum(r.triton.values()) == 1, (r.name, r.aten, r.triton)
    assert len(by_kind["attn_res_row"]) == 2 * cfg.num_hidden_layers
    assert "attn_res_merge" not in by_kind
    # the experts read z in place (no contiguous copy: `clone`); MXFP4 experts copy it once, into the kernels' K
    # order (`mx_permute`); on CPU the tile schedule is torch's (a GPU runs one moe_schedule_kernel)
    for r in by_kind["moe_experts"]:
        assert "clone" not in r.aten and r.aten["copy_"] == 1 and r.aten["sort"] == 1, r.aten
        assert {k for k in r.triton} >= {"moe_sum_kernel"} and len(r.triton) >= 3
    assert rows[0].aten == {"_to_copy": 1} and rows[-1].aten == {"add_": 1}    # lengths.long(), lengths += 1
    s = summary(rows)
    assert s["launches"] == sum(r.total for r in rows) and s["schedule_launches"] == len(launches)
    assert s["triton"]["moe_route_kernel"] == len(by_kind["moe_route"])
