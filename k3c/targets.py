"""Targets: the hardware a plan is made for, as data (DESIGN.md "Targets").

A `Target` gives memory capacity (bytes), memory bandwidth (B/s), dense peak FLOP/s per dtype, interconnect
bandwidth (B/s per GPU, one direction + the other summed as vendors quote it) and compute units. Preset figures
are vendors' datasheet numbers ("spec": dense, i.e. without 2:4 sparsity, at boost clock) with the datasheet named
in `sources`; figures measured on real machines are kept apart in `measured` (same keys: "memory_bytes",
"hbm_bandwidth", "interconnect_bandwidth", "peak_flops.<dtype>") and are used by the roofline only on request.
A JSON file with the fields of `Target.to_dict()` defines a new target (`load_target("my_chip.json")`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from k3c.errors import ConfigError, UnsupportedError, shown

KINDS = ("cuda", "rocm", "cpu")
DTYPES = ("float64", "float32", "tfloat32", "bfloat16", "float16", "float8", "float4", "int8")
_ALIASES = {"fp64": "float64", "fp32": "float32", "f32": "float32", "tf32": "tfloat32", "bf16": "bfloat16",
            "fp16": "float16", "half": "float16", "fp8": "float8", "float8_e4m3fn": "float8", "float8_e5m2": "float8",
            "fp4": "float4", "mxfp4": "float4", "nvfp4": "float4", "float4_e2m1fn_x2": "float4"}
_FIELDS = {"name": str, "kind": str, "arch": str, "memory_bytes": (int, float), "hbm_bandwidth": (int, float),
           "peak_flops": dict, "interconnect_bandwidth": (int, float, type(None)), "compute_units": int,
           "sources": dict, "measured": dict, "notes": str, "backends": list}
_REQUIRED = ("name", "kind", "arch", "memory_bytes", "hbm_bandwidth", "peak_flops")
#: what a field's type error says was expected (the others: a number)
_EXPECTED = {"name": "a string", "kind": "a string", "arch": "a string", "notes": "a string", "peak_flops": "an object",
             "sources": "an object", "measured": "an object", "backends": "a list", "compute_units": "an integer",
             "interconnect_bandwidth": "a number or null"}


def flops_dtype(dtype: Any) -> str:
    """Canonical compute dtype name ('bf16', 'torch.bfloat16' -> 'bfloat16'; 'float8_e4m3fn' -> 'float8').
    Raises UnsupportedError for a dtype outside DTYPES."""
    name = str(dtype).removeprefix("torch.").lower()
    name = _ALIASES.get(name, name)
    if name not in DTYPES:
        raise UnsupportedError(f"unknown compute dtype '{dtype}'; known: {list(DTYPES)}")
    return name


@dataclass(frozen=True)
class Target:
    """One device (a GPU, or a CPU socket). Units: bytes, B/s, FLOP/s; interconnect None where there is none.

    compute_units: SMs (cuda), CUs (rocm) or cores (cpu). sources: field -> where its number comes from, with
    "*" for every field not named and "measured" for the `measured` figures.
    measured: field -> a value measured on real hardware (see the module docstring for the keys).
    backends: names of the backends that may implement kernel groups, in claim order (`k3c.codegen.backend`);
    empty: the default order for the kind (GPUs: triton; CPUs: tvm; then library and view).
    """

    name: str
    kind: str
    arch: str
    memory_bytes: int
    hbm_bandwidth: float
    peak_flops: dict[str, float]
    interconnect_bandwidth: float | None = None
    compute_units: int = 0
    sources: dict[str, str] = field(default_factory=dict)
    measured: dict[str, float] = field(default_factory=dict)
    notes: str = ""
    backends: tuple[str, ...] = ()

    def bandwidth(self, measured: bool = False) -> float:
        """Memory bandwidth in B/s: the measured one when asked and known, else the spec."""
        return self.measured.get("hbm_bandwidth", self.hbm_bandwidth) if measured else self.hbm_bandwidth

    def peak(self, dtype: Any, measured: bool = False) -> float:
        """Dense peak FLOP/s for `dtype`. Raises UnsupportedError if the target has no figure for it."""
        name = flops_dtype(dtype)
        if name not in self.peak_flops:
            raise UnsupportedError(f"target '{self.name}' has no peak FLOP/s for {name}; "
                                   f"it has {sorted(self.peak_flops)}")
        return self.measured.get(f"peak_flops.{name}", self.peak_flops[name]) if measured else self.peak_flops[name]

    def to_dict(self) -> dict:
        """Plain JSON data (the manifest's `target`, or a target file)."""
        return {"name": self.name, "kind": self.kind, "arch": self.arch, "memory_bytes": self.memory_bytes,
                "hbm_bandwidth": self.hbm_bandwidth, "peak_flops": dict(self.peak_flops),
                "interconnect_bandwidth": self.interconnect_bandwidth, "compute_units": self.compute_units,
                "sources": dict(self.sources), "measured": dict(self.measured), "notes": self.notes,
                "backends": list(self.backends)}


def _figure(value) -> bool:
    """A target figure: a number (not a bool) that is finite and > 0 as a float (10**400 is not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return 0 < float(value) < math.inf
    except OverflowError:
        return False


def target_from_dict(data: Any, source: str = "target") -> Target:
    """Build a Target from JSON data, checking every field. Raises ConfigError naming `source` and the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object, found {type(data).__name__}")
    for key in data:
        if key not in _FIELDS:
            raise ConfigError(f"{source}: unknown field '{key}' (known: {sorted(_FIELDS)})")
    for key in _REQUIRED:
        if key not in data:
            raise ConfigError(f"{source}: missing field '{key}'")
    for key, kind in _FIELDS.items():
        if key in data and (not isinstance(data[key], kind) or isinstance(data[key], bool)):
            raise ConfigError(f"{source}: field '{key}' has type {type(data[key]).__name__}, expected "
                              f"{_EXPECTED.get(key, 'a number')}")
    if data["kind"] not in KINDS:
        raise ConfigError(f"{source}: field 'kind' is '{data['kind']}', expected one of {list(KINDS)}")
    for key in ("memory_bytes", "hbm_bandwidth", "interconnect_bandwidth"):
        if data.get(key) is not None and not _figure(data[key]):
            raise ConfigError(f"{source}: field '{key}' must be a finite number > 0, got {shown(data[key])}")
    peaks = {}
    for dtype, value in data["peak_flops"].items():
        try:
            name = flops_dtype(dtype)
        except UnsupportedError as err:
            raise ConfigError(f"{source}: field 'peak_flops.{dtype}': {err}") from None
        if not _figure(value):
            raise ConfigError(f"{source}: field 'peak_flops.{dtype}' must be a finite number > 0, "
                              f"got {shown(value)}")
        peaks[name] = float(value)
    if not peaks:
        raise ConfigError(f"{source}: field 'peak_flops' is empty")
    measured = {}
    for key, value in data.get("measured", {}).items():
        base, _, dtype = key.partition(".")
        ok = (base in ("memory_bytes", "hbm_bandwidth", "interconnect_bandwidth") and not dtype) or (
            base == "peak_flops" and dtype in DTYPES)
        if not ok or not _figure(value):
            raise ConfigError(f"{source}: field 'measured.{key}' is not a known figure with a finite value > 0")
        measured[key] = value
    if not all(isinstance(v, str) for v in data.get("sources", {}).values()):
        raise ConfigError(f"{source}: field 'sources' must map names to strings")
    return Target(name=data["name"], kind=data["kind"], arch=data["arch"], memory_bytes=int(data["memory_bytes"]),
                  hbm_bandwidth=float(data["hbm_bandwidth"]), peak_flops=peaks,
                  interconnect_bandwidth=None if data.get("interconnect_bandwidth") is None
                  else float(data["interconnect_bandwidth"]),
                  compute_units=data.get("compute_units", 0), sources=dict(data.get("sources", {})),
                  measured=measured, notes=data.get("notes", ""), backends=_backends(data, source))


def _backends(data: dict, source: str) -> tuple[str, ...]:
    names = data.get("backends", [])
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ConfigError(f"{source}: field 'backends' must be a list of distinct backend names")
    return tuple(names)


def load_target(name_or_path: str | Path | Target) -> Target:
    """A preset by name (see PRESETS), or a target JSON file (a path, or a name ending in .json).

    Raises ConfigError: unknown preset name, unreadable file, invalid JSON, or a bad field (named with the file).
    """
    if isinstance(name_or_path, Target):
        return name_or_path
    key = str(name_or_path)
    if key in PRESETS:
        return target_from_dict(PRESETS[key].to_dict(), source=f"preset {key}")
    path = Path(key)
    if not key.endswith(".json") and not path.exists():
        raise ConfigError(f"unknown target '{key}': not a preset ({', '.join(sorted(PRESETS))}) nor a JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"{path}: cannot read target file: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: invalid JSON at line {err.lineno} column {err.colno}: {err.msg}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # not UTF-8; a 4300-digit number; deep nesting
        raise ConfigError(f"{path}: not a target JSON file ({shown(err)})") from None
    return target_from_dict(data, source=str(path))


class Roofline(NamedTuple):
    """Roofline estimate in seconds: time = max(compute, memory); bound = 'compute' or 'memory'."""

    time_s: float
    compute_s: float
    memory_s: float
    bound: str


def roofline(flops: float, nbytes: float, target: Target, dtype: Any, measured: bool = False) -> Roofline:
    """Roofline model (Williams, Waterman & Patterson 2009): compute_s = flops / peak(dtype) (FLOP / FLOP/s),
    memory_s = nbytes / bandwidth (B / B/s); ties count as memory-bound. `measured`: use measured figures where
    the target has them. Raises UnsupportedError if the target has no peak for `dtype`; ValueError if negative."""
    if flops < 0 or nbytes < 0:
        raise ValueError(f"roofline: flops ({flops}) and bytes ({nbytes}) must be >= 0")
    compute_s = flops / target.peak(dtype, measured)
    memory_s = nbytes / target.bandwidth(measured)
    return Roofline(max(compute_s, memory_s), compute_s, memory_s, "compute" if compute_s > memory_s else "memory")


def roofline_time(flops: float, nbytes: float, target: Target, dtype: Any, measured: bool = False) -> float:
    """Seconds = max(flops / peak FLOP/s, bytes / bandwidth B/s); see `roofline`."""
    return roofline(flops, nbytes, target, dtype, measured).time_s


def roofline_bound(flops: float, nbytes: float, target: Target, dtype: Any, measured: bool = False) -> str:
    """'compute' or 'memory': which roof limits this work on `target`; see `roofline`."""
    return roofline(flops, nbytes, target, dtype, measured).bound


# ---- presets ---------------------------------------------------------------------------------------------------
# Spec figures are dense (no 2:4 sparsity; NVIDIA and AMD quote sparse figures at twice these), in datasheet units
# (GB = 1e9 B, TB/s = 1e12 B/s). Interconnect is the per-GPU total of both directions as the vendor quotes it.
T, G = 1e12, 1e9
_NV_H = "NVIDIA H100/H200 Tensor Core GPU datasheets (SXM form factor, 2024)"
_KINDS_MD = ("measured on this project's H200 machines (device tool KINDS.md, 2026-10-28 and 2026-11-04): "
             "torch device-to-device copy, read+write bytes; 8192^3 bf16 matmul on random data, mean of 10")
_BLACKWELL = "NVIDIA DGX/HGX B200 datasheet: totals for 8 GPUs divided by 8 (1,440 GB, 64 TB/s, 36 PF bf16 sparse)"
_GB200 = "NVIDIA GB200 NVL72 datasheet: totals for 72 GPUs divided by 72 (13.4 TB, 576 TB/s, 360 PF bf16 sparse)"
_ZEN4 = ("derived: 96 cores x 2.4 GHz base x FLOP/cycle of Zen 4 (two 256-bit FMA pipes: 16 fp64, 32 fp32, "
         "64 bf16 via AVX512_BF16); AMD EPYC 9654 product page (96 cores, 2.4 GHz, 12 ch DDR5-4800)")
_GRACE = ("NVIDIA Grace CPU Superchip datasheet (2 CPUs: 144 cores, 7.1 TF fp64, up to 960 GB LPDDR5X, "
          "up to 1 TB/s) halved; fp32 = 2x fp64 (SVE2 lanes); bf16 = 2x fp32 is an estimate (BFMMLA)")

PRESETS: dict[str, Target] = {t.name: t for t in [
    Target("h200", "cuda", "sm_90", int(141 * G), 4.8 * T,
           {"float64": 67 * T, "float32": 67 * T, "tfloat32": 494.7 * T, "bfloat16": 989.5 * T,
            "float16": 989.5 * T, "float8": 1979 * T, "int8": 1979 * T}, 900 * G, 132,
           sources={"*": _NV_H + " (H200 SXM: 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s)", "measured": _KINDS_MD},
           measured={"hbm_bandwidth": 4.3 * T, "peak_flops.bfloat16": 788 * T,
                     "memory_bytes": 143771 * 2**20},  # nvidia-smi total, KINDS.md 2026-10-27
           notes="float64 is the FP64 tensor-core rate (vector FP64: 34 TF)"),
    Target("h100-sxm", "cuda", "sm_90", int(80 * G), 3.35 * T,
           {"float64": 67 * T, "float32": 67 * T, "tfloat32": 494.7 * T, "bfloat16": 989.5 * T,
            "float16": 989.5 * T, "float8": 1979 * T, "int8": 1979 * T}, 900 * G, 132,
           sources={"*": _NV_H + " (H100 SXM5: 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s)"},
           notes="float64 is the FP64 tensor-core rate (vector FP64: 34 TF)"),
    Target("b200", "cuda", "sm_100", int(180 * G), 8 * T,
           {"float64": 37 * T, "tfloat32": 1125 * T, "bfloat16": 2250 * T, "float16": 2250 * T,
            "float8": 4500 * T, "float4": 9000 * T, "int8": 4500 * T}, 1800 * G, 148,
           sources={"*": _BLACKWELL + "; NVLink 5: 1.8 TB/s per GPU; 148 SMs"},
           notes="no plain-fp32 figure is published per GPU; air-cooled HGX parts may run at lower clocks"),
    Target("gb200", "cuda", "sm_100", int(186 * G), 8 * T,
           {"float64": 45 * T, "tfloat32": 1250 * T, "bfloat16": 2500 * T, "float16": 2500 * T,
            "float8": 5000 * T, "float4": 10000 * T, "int8": 5000 * T}, 1800 * G, 148,
           sources={"*": _GB200 + "; NVLink 5: 130 TB/s / 72 = 1.8 TB/s per GPU"},
           notes="one Blackwell GPU of a GB200 superchip; the Grace CPU's LPDDR5X is not counted"),
    Target("a100-80g", "cuda", "sm_80", int(80 * G), 2.039 * T,
           {"float64": 19.5 * T, "float32": 19.5 * T, "tfloat32": 156 * T, "bfloat16": 312 * T,
            "float16": 312 * T, "int8": 624 * T}, 600 * G, 108,
           sources={"*": "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80 GB: HBM2e 2,039 GB/s, NVLink 600 GB/s)"},
           notes="no FP8 tensor cores; float64 is the FP64 tensor-core rate"),
    Target("mi300x", "rocm", "gfx942", int(192 * G), 5.3 * T,
           {"float64": 163.4 * T, "float32": 163.4 * T, "tfloat32": 653.7 * T, "bfloat16": 1307.4 * T,
            "float16": 1307.4 * T, "float8": 2614.9 * T, "int8": 2614.9 * T}, 896 * G, 304,
           sources={"*": "AMD Instinct MI300X data sheet (192 GB HBM3, 5.3 TB/s, 304 CUs; Infinity Fabric "
                         "7 links x 128 GB/s = 896 GB/s peer bandwidth)"},
           notes="kind 'rocm': Triton targets it, the CUDA library path does not"),
    Target("cpu-x86-64", "cpu", "x86-64", int(768 * G), 460.8 * G,
           {"float64": 3.69 * T, "float32": 7.37 * T, "bfloat16": 14.7 * T}, None, 96,
           sources={"*": _ZEN4, "hbm_bandwidth": "12 channels x DDR5-4800 x 8 B = 460.8 GB/s",
                    "memory_bytes": "assumed 12 x 64 GB DIMMs; set your own in a JSON target"},
           notes="reference: one AMD EPYC 9654 (Genoa) socket"),
    Target("cpu-aarch64", "cpu", "aarch64", int(480 * G), 500 * G,
           {"float64": 3.55 * T, "float32": 7.1 * T, "bfloat16": 14.2 * T}, None, 72,
           sources={"*": _GRACE},
           notes="reference: one NVIDIA Grace CPU (72 Neoverse V2 cores)"),
]}
