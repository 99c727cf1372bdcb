"""Load-time checks: what the runtime needs from an artifact, derived from its hashed files and checked before
anything is allocated.

`derive(art)` reads the bounds from `plan.json` (the symbol values {B, T, L} each entry was planned at), the
vocabulary, every weight's dtype and shape, the cache pools and the arena offsets from `schedule.json` and
`plan.json`, and checks that the two files agree with each other. Nothing here comes from `manifest.json` (which
`read_artifact` checks against the hashed `build.json` anyway). `check_weights` compares the loaded weights
with the schedule; `check_memory` compares what the session will allocate with the device's free memory.
Errors: ArtifactError naming the file and the key (the artifact is inconsistent); RuntimeInputError when the
artifact is sound but does not fit the device. Runtime code: never imports the compiler.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from k3c.errors import ArtifactError, RuntimeInputError
from k3c.runtime.dims import shape
from k3c.runtime.library import DTYPES

WEIGHTS = "weights/params.safetensors"


@dataclass(frozen=True)
class Facts:
    """What a session allocates and checks, derived from `plan.json` and `schedule.json`.

    max_batch / max_seq / max_prefill: bounds in sequences and tokens. vocab: logits width. weights: name ->
    (torch dtype, shape) of every value the launches read that no launch or input provides. pools: name ->
    (torch dtype, shape at the bounds). arena_bytes: the largest entry's arena. triton_dtypes: dtype names of
    the values Triton launches touch (the CPU bf16 guard), but the KDA states (`--kda-state bf16`: the kernels
    widen the state to fp32 on load and round it on store; no bf16 tl.dot)."""

    max_batch: int
    max_seq: int
    max_prefill: int
    vocab: int
    weights: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    pools: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    arena_bytes: int
    triton_dtypes: frozenset[str]

    def items(self) -> dict[str, int]:
        """Bytes the session allocates by item: weights, arena, and the pools summed per kind (pools.kv, ...)."""
        out = {"weights": sum(_nbytes(*w) for w in self.weights.values()), "arena": self.arena_bytes}
        for name, p in self.pools.items():
            key = "pools." + name.rsplit(".", 1)[-1]
            out[key] = out.get(key, 0) + _nbytes(*p)
        return out


def _nbytes(dtype: torch.dtype, shp: tuple[int, ...]) -> int:
    return math.prod(shp) * dtype.itemsize


def _dtype(name, where: str) -> torch.dtype:
    if name not in DTYPES:
        raise ArtifactError(f"{where}: dtype {name!r} is not one this runtime knows ({', '.join(DTYPES)})")
    return DTYPES[name]


def _bounds(plan: dict) -> tuple[int, int, int]:
    """(max_batch, max_seq, max_prefill) from plan.json's `bounds`; both entries must agree (decode: T = 1)."""
    try:
        pre, dec = plan["bounds"]["prefill"], plan["bounds"]["decode"]
        B, T, L = (int(pre[k]) for k in "BTL")
        ok = (dec["B"], dec["T"], dec["L"] + dec["T"]) == (B, 1, L + T)
    except (KeyError, TypeError, ValueError):
        raise ArtifactError("plan.json: bounds must hold {B, T, L} ints for prefill and decode") from None
    if not ok or min(B, T) < 1 or L < 0:
        raise ArtifactError(f"plan.json: bounds {plan['bounds']} are inconsistent (decode must have the prefill's "
                            f"B, T = 1 and the same L + T)")
    return B, L + T, T


def derive(art) -> Facts:
    """The Facts of `art` (a `k3c.runtime.artifact.Artifact`), from its hashed plan.json and schedule.json.

    Raises ArtifactError naming the file and key: malformed bounds, a pool whose shape or dtype in plan.json
    differs from the schedule's at the bounds, an arena buffer beyond its arena, a weight with a symbolic shape."""
    plan, sched = art.plan, art.schedule
    max_batch, max_seq, max_prefill = _bounds(plan)
    try:
        dec = sched["decode"]
        vocab = int(dec["values"][dec["outputs"]["logits"]]["shape"][-1])
        weights, triton = {}, set()
        for entry, e in sched.items():
            types = e["values"]
            made = set(e["inputs"]) | {o for ln in e["launches"] for o in ln["outputs"]}
            states = {n for n in e["inputs"] if n.endswith(".kda_state")} | \
                {v for k, v in e["outputs"].items() if k.endswith(".kda_state")}
            for ln in e["launches"]:
                for name in ln["inputs"]:
                    if name not in made and name not in weights:
                        t = types[name]
                        if not all(isinstance(d, int) for d in t["shape"]):
                            raise ArtifactError(f"schedule.json: weight {name!r} has a symbolic shape {t['shape']}")
                        weights[name] = (_dtype(t["dtype"], f"schedule.json: {entry} value {name!r}"), tuple(t["shape"]))
                if ln["backend"] == "triton":
                    triton.update(types[n]["dtype"] for n in ln["inputs"] + ln["outputs"] if n not in states)
        full = {"B": max_batch, "L": max_seq, "T": 1}
        pools = {}
        for name in dec["inputs"]:
            if name == "tokens":
                continue
            t = dec["values"][name]
            pools[name] = (_dtype(t["dtype"], f"schedule.json: pool {name!r}"), shape(t["shape"], full))
            rec = plan["pools"].get(name)
            if rec is None or tuple(rec["shape"]) != pools[name][1] or rec["dtype"] != t["dtype"]:
                found = f"{rec['dtype']} {rec['shape']}" if rec else "absent"
                raise ArtifactError(f"plan.json: pools.{name} is {found}, but schedule.json gives {t['dtype']} "
                                    f"{list(pools[name][1])} at the bounds")
        arena = 0
        for entry, a in plan["arena"].items():
            sizes = dict(plan["bounds"][entry])
            types = sched[entry]["values"]
            for name, buf in a["buffers"].items():
                end = buf["offset"] + _nbytes(_dtype(types[name]["dtype"], f"schedule.json: {name!r}"),
                                              shape(types[name]["shape"], sizes))
                if end > a["arena_bytes"]:
                    raise ArtifactError(f"plan.json: arena.{entry}.buffers.{name} ends at byte {end}, beyond the "
                                        f"{entry} arena of {a['arena_bytes']} bytes")
            arena = max(arena, int(a["arena_bytes"]))
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as err:
        raise ArtifactError(f"{art.path}: schedule.json / plan.json are malformed ({type(err).__name__}: {err})") \
            from None
    return Facts(max_batch, max_seq, max_prefill, vocab, dict(sorted(weights.items())), pools, arena,
                 frozenset(triton))


def check_weights(tensors: dict[str, torch.Tensor], facts: Facts, where: str = WEIGHTS) -> None:
    """Every weight the schedule reads is in `tensors` with its dtype and shape, and no other tensor is.
    Raises ArtifactError naming `where`, the tensor, expected and found."""
    missing = sorted(set(facts.weights) - set(tensors))
    if missing:
        raise ArtifactError(f"{where}: lacks tensor '{missing[0]}' that schedule.json reads"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(tensors) - set(facts.weights))
    if extra:
        raise ArtifactError(f"{where}: tensor '{extra[0]}' is not read by schedule.json (weights of another build?)")
    for name, (dtype, shp) in facts.weights.items():
        t = tensors[name]
        if t.dtype != dtype or tuple(t.shape) != shp:
            raise ArtifactError(f"{where}: tensor '{name}' is {str(t.dtype).removeprefix('torch.')} "
                                f"{list(t.shape)}, schedule.json expects {str(dtype).removeprefix('torch.')} "
                                f"{list(shp)} (weights of another build?)")


def free_bytes(device: torch.device) -> int:
    """Bytes the device can still allocate: CUDA's free memory, or the host's MemAvailable (Linux /proc/meminfo;
    elsewhere the free physical pages)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def format_bytes(n: float) -> str:
    """'1.5 GiB', '512 B': binary units up to PiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def check_memory(facts: Facts, device: torch.device, free: int | None = None) -> None:
    """Weights + arena + pools must fit in the device's free memory (`free`, default `free_bytes(device)`).
    Raises RuntimeInputError naming the total, the free bytes and the three biggest items."""
    items = facts.items()
    need = sum(items.values())
    free = free_bytes(device) if free is None else free
    if need > free:
        top = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(items.items(), key=lambda kv: -kv[1])[:3])
        raise RuntimeInputError(f"the artifact needs {format_bytes(need)} on {device} but {format_bytes(free)} is free ({top}; "
                                f"compiled for max_batch {facts.max_batch}, max_seq {facts.max_seq}): recompile "
                                f"with smaller --max-batch / --max-seq")
