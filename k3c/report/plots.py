"""The report's plots, drawn with matplotlib (Agg backend) as SVG text to embed in the HTML page.

- `roofline_svg`: left, kernels on the roofline of the target (Williams, Waterman & Patterson 2009): x =
  arithmetic intensity (FLOP per byte), y = the FLOP/s the kernel attains at its roofline time (flops /
  max(flops / peak, bytes / bandwidth)), which puts every kernel on the roof min(peak, intensity x bandwidth):
  the plot shows which side of the ridge each kind sits on (kernels with no FLOPs, intensity 0, are left out of
  this panel). Right, where the time goes: roofline seconds summed per kernel kind, split into memory- and
  compute-bound launches.
- `memory_svg`: the arena plan as a timeline: one rectangle per buffer spanning launches first..last (x) and
  bytes offset..offset + aligned size (y). Returns the peak (the highest rectangle top) with the SVG, so the page
  can show and the tests check that it equals the plan's arena size.
The SVGs are deterministic: fixed hash salt for element ids, no date metadata, text as text (fonts from the page).
"""

from __future__ import annotations

import io
from collections import Counter, defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

_RC = {"svg.hashsalt": "k3c", "svg.fonttype": "none", "font.size": 9, "axes.grid": True, "grid.alpha": 0.3,
       "axes.unicode_minus": False}


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": "k3c report (matplotlib)"},
                bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and DOCTYPE: the SVG is inlined in HTML


def roofline_svg(kernels: list[dict], peak_flops: float, bandwidth: float, title: str) -> str:
    """SVG of `kernels` (rows of report/kernels.json: flops, bytes, roofline_s, bound, kind) against the roofs of a
    target with `peak_flops` (FLOP/s) and `bandwidth` (B/s), and their roofline time per kind."""
    pts = [k for k in kernels if k["flops"] > 0 and k["bytes"] > 0 and k["roofline_s"] > 0]
    kinds = sorted({k["kind"] for k in kernels})
    with plt.rc_context(_RC):
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
        ridge = peak_flops / bandwidth
        lo = min([k["flops"] / k["bytes"] for k in pts] + [ridge / 100]) / 2
        hi = max([k["flops"] / k["bytes"] for k in pts] + [ridge * 100]) * 2
        ax.plot([lo, ridge, hi], [lo * bandwidth, peak_flops, peak_flops], color="black", lw=1.5, label="roof")
        for kind in kinds:
            # the layers repeat the same kernels: one marker per distinct point, its area growing with the count
            at: Counter = Counter((k["flops"] / k["bytes"], k["flops"] / k["roofline_s"]) for k in pts
                                  if k["kind"] == kind)
            if at:
                xy = sorted(at)
                ax.scatter([x for x, _ in xy], [y for _, y in xy], s=[12 + 4 * at[p] ** 0.5 for p in xy], alpha=0.7,
                           label=f"{kind} ({sum(at.values())})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # plain "1e+03" labels: matplotlib's default 10^k goes through mathtext
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0e}"))
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("arithmetic intensity (FLOP / byte)")
        ax.set_ylabel("FLOP/s at the roofline time")
        ax.set_title(title)
        ax.legend(fontsize=7, loc="lower right", ncol=2)
        per: dict[tuple[str, str], float] = defaultdict(float)
        for k in kernels:
            per[k["kind"], k["bound"]] += k["roofline_s"]
        mem, comp = [per[kind, "memory"] for kind in kinds], [per[kind, "compute"] for kind in kinds]
        bx.barh(kinds, [m * 1e3 for m in mem], color="#4c9be8", label="memory-bound")
        bx.barh(kinds, [c * 1e3 for c in comp], left=[m * 1e3 for m in mem], color="#e8834c", label="compute-bound")
        bx.set_xlim(0, max([(m + c) * 1e3 for m, c in zip(mem, comp)] + [1e-9]) * 1.05)
        bx.invert_yaxis()
        bx.set_xlabel("roofline time, sum over launches (ms)")
        bx.set_title("time per kernel kind")
        bx.legend(fontsize=7, loc="lower right")
        fig.subplots_adjust(wspace=0.4)
        return _svg(fig)


def memory_svg(buffers: dict[str, dict], alignment: int, n_launches: int, title: str) -> tuple[str, int]:
    """(SVG, peak bytes) of the arena timeline; `buffers`: plan.json's name -> {offset, bytes, first, last}.
    Each rectangle's height is the buffer's size rounded up to `alignment`, as the planner places it."""
    polys, peak = [], 0
    for b in buffers.values():
        top = b["offset"] + -(-b["bytes"] // alignment) * alignment
        x0, x1 = b["first"], b["last"] + 1
        polys.append([(x0, b["offset"]), (x1, b["offset"]), (x1, top), (x0, top)])
        peak = max(peak, top)
    scale, unit = (2**20, "MiB") if peak >= 2**20 else (2**10, "KiB")
    with plt.rc_context(_RC):
        fig, ax = plt.subplots(figsize=(10, 4.5))
        ax.add_collection(PolyCollection([[(x, y / scale) for x, y in p] for p in polys], facecolors="#4c9be8",
                                         edgecolors="#1f4e79", linewidths=0.2, alpha=0.8))
        ax.axhline(peak / scale, color="#c0392b", lw=1, ls="--", label=f"peak {peak / scale:,.2f} {unit}")
        ax.set_xlim(0, max(n_launches, 1))
        ax.set_ylim(0, max(peak, 1) / scale * 1.05)
        ax.set_xlabel("launch (schedule order)")
        ax.set_ylabel(f"arena offset ({unit})")
        ax.set_title(title)
        ax.legend(fontsize=8, loc="upper right")
        return _svg(fig), peak
