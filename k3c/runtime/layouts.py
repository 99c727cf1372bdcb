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

- `mxfp4_tiles_bits` (`mx_tile_bits`): `mxfp4_tiles` with each 32-bit word's bits placed for the decoding
  (`MX_BIT_PLACE`): code c's bit b (bit 4c + b of the checkpoint's word, b = 3 its sign) moves to where one
  shift or rotate and one mask put it in bf16 position, so a word decodes to its four bf16 pairs (codes c and
  c + 4) in 9 integer instructions instead of 11 (k3c.codegen.triton.moe_mxfp4, `mxfp4_word_bf16`).
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
    the dtype and shape otherwise (another dtype or rank, or where `mx_tiles_ok` does not hold)."""
    if w.dtype != torch.uint8 or w.dim() != 3:
        raise ValueError(f"MXFP4 words {w.dtype}{list(w.shape)}: expected u8 [E, R, K/2]")
    E, R, half = w.shape
    if not mx_tiles_ok(R, 2 * half):
        raise ValueError(f"MXFP4 words {list(w.shape)}: the tiled layout needs rows a multiple of {MX_TILE_ROWS} "
                         f"and K a multiple of {MX_TILE_K}")
    blocks = w.reshape(E, R // MX_TILE_ROWS, MX_TILE_ROWS, half // 128, 128)     # [E, row block, row, tile, byte]
    return blocks.transpose(2, 3).contiguous().view(E, R, half)


def _bit_place() -> tuple[int, ...]:
    """`MX_BIT_PLACE`: the placed bit of each bit 4c + b of a word. Pair j = c mod 4 holds codes j (bf16 bits 6, 7,
    8 = em, 15 = sign) and j + 4 (16 bits up), at p of P = {6, 7, 8, 15, 22, 23, 24, 31}; the decoding extracts
    pair 0 as w & P, pair 1 as rotr(w, 4) & P, pair 2 as (w << 6) & P and pair 3 as ((w << 2) & (P less bits 8,
    24)) | ((w >> 6) & bits 8, 24), so bit p of pair j comes from w's bit p, p + 4 mod 32, p − 6, and p − 2
    (p + 6 for the top exponent bit b = 2) of pair 3. These cover the 32 bits once: four whole translates of P
    cannot (no translates of P tile 32 bits), so one pair takes two."""
    place = []
    for c in range(8):
        for b in range(4):
            p = (6, 7, 8, 15)[b] + 16 * (c // 4)
            j = c % 4
            place.append(p if j == 0 else (p + 4) % 32 if j == 1 else p - 6 if j == 2 else p + 6 if b == 2 else p - 2)
    assert sorted(place) == list(range(32))
    return tuple(place)


#: MX_BIT_PLACE[4c + b]: where the `mxfp4_tiles_bits` layout puts bit b of code c of a 32-bit word (`_bit_place`)
MX_BIT_PLACE = _bit_place()


def _i32(x: int) -> int:
    """The int32 of the 32-bit pattern x (0 .. 2^32 − 1)."""
    return x - (1 << 32) if x >= 1 << 31 else x


def mx_place_bits(w: torch.Tensor) -> torch.Tensor:
    """Packed MXFP4 bytes u8 [..., 4n] (n ≥ 0) -> a new contiguous tensor of the same shape with each little-endian
    32-bit word's bits placed as `MX_BIT_PLACE` says, on w's device (a word's bytes stay its own 4 bytes; one
    temporary of w's size besides the result: a masked move per distinct distance a bit moves). Raises ValueError
    naming the dtype and shape for anything but u8 with a last dimension a multiple of 4."""
    if w.dtype != torch.uint8 or w.dim() == 0 or w.shape[-1] % 4:
        raise ValueError(f"MXFP4 words {w.dtype}{list(w.shape)}: expected u8 [..., 4n] (32-bit words)")
    if not w.is_contiguous() or w.data_ptr() % 4:       # a copy whose words are aligned 32-bit words
        w = w.clone(memory_format=torch.contiguous_format)
    words = w.view(torch.int32)
    out, part = torch.zeros_like(words), torch.empty_like(words)
    moves: dict[int, int] = {}
    for src, dst in enumerate(MX_BIT_PLACE):
        moves[dst - src] = moves.get(dst - src, 0) | 1 << src
    for delta, mask in sorted(moves.items()):
        torch.bitwise_and(words, _i32(mask), out=part)
        # int32 shifts: left ones drop what passes bit 31; right ones are arithmetic, so mask what they smear
        if delta >= 0:
            part.bitwise_left_shift_(delta)
        else:
            part.bitwise_right_shift_(-delta).bitwise_and_(_i32(mask >> -delta))
        out.bitwise_or_(part)
    return out.view(torch.uint8).view(w.shape)


def mx_tile_bits(w: torch.Tensor) -> torch.Tensor:
    """Packed MXFP4 bytes w u8 [E, R, K/2] row-major -> the `mxfp4_tiles_bits` layout: `mx_tile_words`, each
    word's bits placed by `mx_place_bits`. Raises ValueError as `mx_tile_words` does."""
    return mx_place_bits(mx_tile_words(w))


def _tiles_shape(w: torch.Tensor) -> str | None:
    """What keeps `w` from a tiled MXFP4 layout, or None."""
    return None if w.dtype == torch.uint8 and w.dim() == 3 and mx_tiles_ok(w.shape[1], 2 * w.shape[2]) else \
        f"{w.dtype} {list(w.shape)}: expected u8 [E, R, K/2] with R a multiple of {MX_TILE_ROWS} and K of {MX_TILE_K}"


#: layout name -> (check(tensor) -> what is wrong or None, relaid(tensor) -> a new tensor in the layout). A layout
#: treats the slices of a weight's first dimension (the experts) independently, so `apply` re-lays a GPU weight in
#: place a chunk of them at a time.
LAYOUTS = {
    "mxfp4_tiles": (_tiles_shape, mx_tile_words),
    "mxfp4_tiles_bits": (_tiles_shape, mx_tile_bits),
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
