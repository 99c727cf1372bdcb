"""`k3c report ART -o report.html`: one self-contained HTML page (no network, no script) about a compiled artifact.

Reads the artifact's manifest.json, plan.json, schedule.json, report.json, graph/*.txt and the `report/` files of
`k3c compile --report` (`k3c.report.collect`), and renders `templates/report.html.j2` (Jinja2) with:
compile options; the pass list with node counts and node counts per op per pass; per pass the IR after it and the
unified diff to the previous step (each capped at `MAX_LINES` lines on the page; the artifact has them whole);
the kernel list (kind, backend, layer, IR nodes, FLOPs, bytes, roofline time on the target); a roofline plot; the
memory timeline of each entry's arena with its pools; per-layer and per-entry totals. Plots: `k3c.report.plots`.
Raises `ArtifactError` when ART is not an artifact or was compiled without `--report`.
"""

from __future__ import annotations

import difflib
import json
from collections import defaultdict
from pathlib import Path

import jinja2

from k3c.atomic import replacing
from k3c.errors import ArtifactError
from k3c.report.plots import memory_svg, roofline_svg
from k3c.targets import target_from_dict

MAX_LINES = 400  # per IR text or diff shown on the page

_NEEDED = ("manifest.json", "plan.json", "schedule.json", "report.json", "report/passes.json", "report/kernels.json",
           "report/options.json")


def _read(art: Path):
    """(the artifact, opened by `read_artifact`: every file read below is checked against the manifest's sha256,
    so a corrupted one is an ArtifactError naming it; {name: parsed JSON} of the `_NEEDED` files)."""
    if not (art / "manifest.json").is_file():
        raise ArtifactError(f"{art}: not a k3c artifact (no manifest.json)")
    from k3c.runtime.artifact import read_artifact   # torch: after the cheap check

    artifact = read_artifact(art, verify=False)
    missing = [f for f in _NEEDED[1:] if f not in artifact.files]
    if missing:
        raise ArtifactError(f"{art}: no {missing[0]}; compile with `k3c compile --report` to keep the report data")
    return artifact, {f.rsplit("/", 1)[-1].removesuffix(".json"): artifact.manifest if f == "manifest.json" else
                      artifact.read_json(f) for f in _NEEDED}


def _capped(lines: list[str]) -> tuple[list[str], int]:
    return lines[:MAX_LINES], max(0, len(lines) - MAX_LINES)


def _steps(artifact, steps: list[dict]) -> list[dict]:
    """Per step: the capped IR text, the capped diff to the previous step, and +/- line counts."""
    out, prev = [], None
    for s in steps:
        text = artifact.read_text(s["ir"]).splitlines()
        diff = [] if prev is None else list(difflib.unified_diff(prev, text, "before", "after", lineterm="", n=1))[2:]
        ir, ir_more = _capped(text)
        shown, diff_more = _capped(diff)
        out.append({**s, "ir_lines": ir, "ir_more": ir_more, "diff": shown, "diff_more": diff_more,
                    "added": sum(1 for ln in diff if ln.startswith("+")),
                    "removed": sum(1 for ln in diff if ln.startswith("-"))})
        prev = text
    return out


def _totals(kernels: list[dict]) -> tuple[list[dict], dict]:
    """Per-layer rows (layer None: outside the layers) and the entry's total: launches, flops, bytes, seconds."""
    by: dict = defaultdict(lambda: {"launches": 0, "generated": 0, "flops": 0, "bytes": 0, "roofline_s": 0.0})
    for k in kernels:
        r = by[k["layer"]]
        r["launches"] += 1
        r["generated"] += k["generated"]
        for f in ("flops", "bytes", "roofline_s"):
            r[f] += k[f]
    rows = [{"layer": layer, **by[layer]} for layer in sorted(by, key=lambda x: (x is None, x or 0))]
    total = {f: sum(r[f] for r in rows) for f in ("launches", "generated", "flops", "bytes", "roofline_s")}
    return rows, total


def build(art: str | Path) -> str:
    """The report page of artifact directory `art` as HTML text (deterministic for a given artifact)."""
    art = Path(art)
    artifact, d = _read(art)
    target = target_from_dict(d["manifest"]["target"], source=f"{art}/manifest.json: target")
    opts = d["options"]
    peak = target.peak(opts["dtype"], True)
    bw = target.bandwidth(True)
    entries = []
    for entry, steps in sorted(d["passes"].items(), key=lambda kv: (kv[0] != "prefill", kv[0])):
        kernels = d["kernels"][entry]
        plan, bounds = d["plan"]["arena"][entry], d["plan"]["bounds"][entry]
        mem, peak_bytes = memory_svg(plan["buffers"], plan["alignment"], len(d["schedule"][entry]["launches"]),
                                     f"{opts['model']} {entry}: arena at the compile bounds {bounds}")
        layers, total = _totals(kernels)
        ops = sorted({op for s in steps for op in s["ops"]})
        entries.append({
            "name": entry, "steps": _steps(artifact, steps), "ops": ops, "kernels": kernels, "layers": layers,
            "total": total, "plan": plan, "bounds": bounds, "memory_svg": mem, "peak_bytes": peak_bytes,
            "roofline_svg": roofline_svg(kernels, peak, bw, f"{opts['model']} {entry} on {target.name}"),
            "cost": d["report"]["entries"][entry]["total"]})
    env = jinja2.Environment(loader=jinja2.PackageLoader("k3c.report", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(si=_si, secs=_secs, nbytes=_bytes)
    return env.get_template("report.html.j2").render(
        opts=opts, manifest=d["manifest"], target=target, peak=peak, bandwidth=bw, entries=entries,
        pools=d["plan"]["pools"], pool_totals=d["plan"]["pool_totals"], max_lines=MAX_LINES)


def write(art: str | Path, out: str | Path) -> Path:
    """Write the report page of `art` to `out`, replacing a file there whole or not at all (`replacing`); returns
    the path."""
    out = Path(out)
    page = build(art)
    with replacing(out) as tmp:
        tmp.write_text(page)
    return out


def _si(x: float) -> str:
    for div, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f} {p}"
    return f"{x:g}"


def _secs(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.2f} µs"


def _bytes(b: float) -> str:
    for div, u in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if b >= div:
            return f"{b / div:,.2f} {u}"
    return f"{int(b)} B"
