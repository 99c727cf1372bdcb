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

This module belongs to the runtime: torch only, no compiler import (the compiler imports it for the layout's
constants and for its tests). Errors: ArtifactError naming the weight and launch for a layout this runtime does
not know, two layouts asked of one weight, a weight one launch reads re-laid and another in the checkpoint's
order, or a weight whose shape the layout cannot take.
"""

from __future__ import annotations

import torch

from k3c.errors import ArtifactError

MX_TILE_ROWS, MX_TILE_K = 32, 256
#: bytes re-laid at a time (a temporary of this size, not of the whole weight)
CHUNK_BYTES = 1 << 28


def mx_tiles_ok(R: int, K: int) -> bool:
    """Whether an MXFP4 matrix of R weight rows by K values (packed [.., R, K/2]) can take the `mxfp4_tiles`
    layout: R a multiple of MX_TILE_ROWS and K of MX_TILE_K."""
    return R % MX_TILE_ROWS == 0 and K % MX_TILE_K == 0


def mx_tile_words(w: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Packed MXFP4 bytes w u8 [E, R, K/2] in the checkpoint's row-major order -> the same bytes in the
    `mxfp4_tiles` layout (inverse: back), a new contiguous u8 [E, R, K/2] on w's device. Raises ValueError naming
    the shape where `mx_tiles_ok` does not hold."""
    E, R, half = w.shape
    if not mx_tiles_ok(R, 2 * half):
        raise ValueError(f"MXFP4 words {list(w.shape)}: the tiled layout needs rows a multiple of {MX_TILE_ROWS} "
                         f"and K a multiple of {MX_TILE_K}")
    row_major = (E, R // MX_TILE_ROWS, MX_TILE_ROWS, half // 128, 128)
    tiled = (E, R // MX_TILE_ROWS, half // 128, MX_TILE_ROWS, 128)
    return w.reshape(tiled if inverse else row_major).transpose(2, 3).contiguous().view(E, R, half)


def _mxfp4_tiles_in_place(w: torch.Tensor) -> None:
    """`mx_tile_words` of u8 [E, R, K/2] in place, CHUNK_BYTES of experts at a time."""
    step = max(1, CHUNK_BYTES // max(1, w[0].numel()))
    for e in range(0, w.shape[0], step):
        w[e:e + step] = mx_tile_words(w[e:e + step])


#: layout name -> (check(tensor) -> error text or None, in-place transform)
LAYOUTS = {
    "mxfp4_tiles": (lambda w: None if w.dtype == torch.uint8 and w.dim() == 3 and
                    mx_tiles_ok(w.shape[1], 2 * w.shape[2]) else
                    f"{w.dtype} {list(w.shape)}: expected u8 [E, R, K/2] with R a multiple of {MX_TILE_ROWS} and K "
                    f"of {MX_TILE_K}", _mxfp4_tiles_in_place),
}


def declared(schedule: dict, weights) -> dict[str, str]:
    """Weight name -> layout, from the launches of `schedule` (entry -> {"launches": [...]}) that read a weight
    of `weights` (names). Raises ArtifactError (module docstring) for an unknown layout, two layouts of one weight,
    or a weight re-laid for one launch and read in the checkpoint's order by another."""
    out: dict[str, str] = {}
    for entry in schedule.values():
        for ln in entry["launches"]:
            for name, layout in ln.get("weight_layouts", {}).items():
                if layout not in LAYOUTS:
                    raise ArtifactError(f"schedule.json: launch {ln['name']} reads weight {name} in layout "
                                        f"{layout!r}, which this runtime does not know ({', '.join(LAYOUTS)})")
                if name not in weights:
                    raise ArtifactError(f"schedule.json: launch {ln['name']} gives a layout to {name}, which is "
                                        "not a weight")
                if out.setdefault(name, layout) != layout:
                    raise ArtifactError(f"schedule.json: weight {name} is asked in layouts {out[name]!r} and "
                                        f"{layout!r} (launch {ln['name']})")
    for entry in schedule.values():
        for ln in entry["launches"]:
            for name in ln["inputs"]:
                if name in out and name not in ln.get("weight_layouts", {}):
                    raise ArtifactError(f"schedule.json: launch {ln['name']} reads weight {name} in the "
                                        f"checkpoint's order, another launch in layout {out[name]!r}")
    return out


def apply(weights: dict[str, torch.Tensor], schedule: dict, where: str) -> dict[str, str]:
    """Re-lay every weight of `weights` (name -> tensor on its device; the dict is updated) that `schedule`'s
    launches read in a layout of their own (`declared`): in place on a GPU (the runtime's own copy), into a copy
    on the CPU (where the tensor may map the artifact's file). Returns what was done (name -> layout). `where`
    names the artifact in errors. Raises ArtifactError as `declared` does, or for a weight whose dtype or shape its
    layout cannot take."""
    todo = declared(schedule, weights)
    for name, layout in sorted(todo.items()):
        check, transform = LAYOUTS[layout]
        bad = check(weights[name])
        if bad:
            raise ArtifactError(f"{where}: weight {name} cannot take layout {layout!r}: {bad}")
        w = weights[name] if weights[name].is_cuda else weights[name].clone()
        transform(w)
        weights[name] = w
    return todo
