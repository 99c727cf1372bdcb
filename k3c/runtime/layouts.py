"""Load-time weight layouts: weights a backend's kernels read in an order of their own.

The artifact stores every weight as the checkpoint has it (MXFP4 experts are the checkpoint's bytes, which
`k3c check` and the reference interpreter read). A backend whose kernels stream a weight faster in another order
names a layout for it per launch, in `schedule.json` (`"weight_layouts": {value name: layout}`, the backend's
`weight_layouts`), and the runtime re-lays each such weight once, on its device, right after the copy (`apply`):
same shape and dtype, another order, no second copy.

Layouts (`LAYOUTS`):
- `mxfp4_tiles` (`mx_tile_words`): packed MXFP4 words u8 [E, R, K/2] in tiles of MX_TILE_ROWS weight rows by
  MX_TILE_K values (128 bytes of each row, 4 KB a tile), stored one after another along K, then row block by row
  block. The decode kernels' TMA box of one K tile ([32 rows, 32 words]) is then one contiguous 4 KB run of DRAM
  instead of 32 runs of 128 bytes a row apart (BENCHMARKS.md "MXFP4 round, run N": address order is worth up to
  8 points of the H200's read rate under the decoding). Word wk of global row r (e·R + r) of K/8 words a row
  lies at word ((r // 32)·(K/256) + wk // 32)·1024 + (r mod 32)·32 + wk mod 32 (`mx_word_offset`,
  k3c.codegen.triton.moe_mxfp4).

The runtime checks the layouts against the memory-mapped weights before it copies them (`declared`) and re-lays
them after (`apply`). This module belongs to the runtime: torch only, no compiler import (the compiler imports it
for the layout's constants, and checks its finished schedule with `declared`). Errors: ArtifactError naming the
artifact, the weight and the launch, for a malformed `weight_layouts`, a layout this runtime does not know, two
layouts asked of one weight, a weight one launch reads re-laid and another in the checkpoint's order, or a weight
whose shape the layout cannot take. The format version of artifacts that name layouts is 3
(k3c.runtime.artifact.FORMAT_VERSION): a runtime that would ignore them refuses such an artifact.
"""

from __future__ import annotations

import torch

from k3c.errors import ArtifactError

MX_TILE_ROWS, MX_TILE_K = 32, 256
#: bytes re-laid at a time (a temporary of this size, not of the whole weight)
CHUNK_BYTES = 1 << 26


def mx_tiles_ok(R: int, K: int) -> bool:
    """Whether an MXFP4 matrix of R weight rows by K values (packed [.., R, K/2]) can take the `mxfp4_tiles`
    layout: R a multiple of MX_TILE_ROWS and K of MX_TILE_K."""
    return R % MX_TILE_ROWS == 0 and K % MX_TILE_K == 0


def mx_tile_words(w: torch.Tensor) -> torch.Tensor:
    """Packed MXFP4 bytes w u8 [E, R, K/2] in the checkpoint's row-major order -> the same bytes in the
    `mxfp4_tiles` layout, a new contiguous u8 [E, R, K/2] on w's device. Raises ValueError naming
    the shape where `mx_tiles_ok` does not hold."""
    E, R, half = w.shape
    if not mx_tiles_ok(R, 2 * half):
        raise ValueError(f"MXFP4 words {list(w.shape)}: the tiled layout needs rows a multiple of {MX_TILE_ROWS} "
                         f"and K a multiple of {MX_TILE_K}")
    blocks = w.reshape(E, R // MX_TILE_ROWS, MX_TILE_ROWS, half // 128, 128)     # [E, row block, row, tile, byte]
    return blocks.transpose(2, 3).contiguous().view(E, R, half)


#: layout name -> (check(tensor) -> what is wrong or None, relaid(tensor) -> a new tensor in the layout). A layout
#: treats the slices of a weight's first dimension (the experts) independently, so `apply` re-lays a GPU weight in
#: place a chunk of them at a time.
LAYOUTS = {
    "mxfp4_tiles": (lambda w: None if w.dtype == torch.uint8 and w.dim() == 3 and
                    mx_tiles_ok(w.shape[1], 2 * w.shape[2]) else
                    f"{w.dtype} {list(w.shape)}: expected u8 [E, R, K/2] with R a multiple of {MX_TILE_ROWS} and K "
                    f"of {MX_TILE_K}", mx_tile_words),
}


def declared(schedule: dict, weights, where: str) -> dict[str, str]:
    """Weight name -> layout, from the launches of `schedule` (entry -> {"launches": [...]}) that read a weight
    of `weights` (name -> tensor, before or after the copy), each weight checked against its layout. `where`
    names the artifact in errors. Raises ArtifactError (module docstring) for a malformed `weight_layouts`, an
    unknown layout, a name that is not a weight, two layouts of one weight, a weight re-laid for one launch and
    read in the checkpoint's order by another, or a weight whose dtype or shape its layout cannot take."""
    out: dict[str, str] = {}
    for entry in schedule.values():
        for ln in entry["launches"]:
            asked = ln.get("weight_layouts", {})
            if not isinstance(asked, dict) or not all(isinstance(v, str) for v in asked.values()):
                raise ArtifactError(f"{where}: schedule.json launch {ln.get('name')}: weight_layouts must map weight "
                                    f"names to layout names, got {asked!r:.80}")
            for name, layout in asked.items():
                if layout not in LAYOUTS:
                    raise ArtifactError(f"{where}: schedule.json launch {ln['name']} reads weight {name} in layout "
                                        f"{layout!r}, which this runtime does not know ({', '.join(LAYOUTS)})")
                if name not in weights:
                    raise ArtifactError(f"{where}: schedule.json launch {ln['name']} gives a layout to {name}, "
                                        "which is not a weight")
                if out.setdefault(name, layout) != layout:
                    raise ArtifactError(f"{where}: schedule.json asks weight {name} in layouts {out[name]!r} and "
                                        f"{layout!r} (launch {ln['name']})")
    for entry in schedule.values():
        for ln in entry["launches"]:
            for name in ln["inputs"]:
                if name in out and name not in ln.get("weight_layouts", {}):
                    raise ArtifactError(f"{where}: schedule.json launch {ln['name']} reads weight {name} in the "
                                        f"checkpoint's order, another launch in layout {out[name]!r}")
    for name, layout in sorted(out.items()):
        bad = LAYOUTS[layout][0](weights[name])
        if bad:
            raise ArtifactError(f"{where}: weight {name} cannot take layout {layout!r}: {bad}")
    return out


def apply(weights: dict[str, torch.Tensor], layouts: dict[str, str]) -> None:
    """Re-lay the weights of `weights` (name -> tensor on its device; the dict is updated) named in `layouts`
    (name -> layout: `declared`'s answer, checked). On a GPU in place (the runtime's own copy), CHUNK_BYTES of the
    first dimension at a time, so the temporary is at most that; on the CPU, where the tensor may map the
    artifact's file, into a new tensor."""
    for name, layout in sorted(layouts.items()):
        relaid, w = LAYOUTS[layout][1], weights[name]
        if not w.is_cuda:
            weights[name] = relaid(w)
            continue
        step = max(1, CHUNK_BYTES // max(1, w[0].numel() * w.element_size()))
        for e in range(0, w.shape[0], step):
            w[e:e + step] = relaid(w[e:e + step])
