"""The compile-time memory budget: does an artifact fit the target it is compiled for?

Per rank, an artifact needs its weights, one arena (the largest entry's plan: one call runs at a time) and every
cache pool at the bounds; `k3c.runtime.checks.check_memory` sums the same items at load. The capacity is the
target's memory (the measured figure where the target has one, as `k3c.retarget` uses).

The rule (`Budget.check`):
- a runnable artifact (with weights, one rank) must fit one device: weights + arena + pools <= capacity;
- a plan-only artifact is a plan for however many GPUs hold it: the sharded weights split over n GPUs, the
  replicated ones (`k3c.parallel.param_split`), arena and pools whole on each (the caches are per sequence;
  `k3c plan` estimates the finer split), so it fits some n iff replicated + arena + pools < capacity, and the
  fewest is n = ceil(sharded / (capacity - replicated - arena - pools)); one that fits no GPU count is refused;
- `--allow-oversize` writes the artifact anyway (for planning); the overflow is still recorded in plan.json.
Errors: ConfigError naming the target, the need, the capacity and the biggest items.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3c.errors import ConfigError
from k3c.runtime.checks import format_bytes


@dataclass(frozen=True)
class Budget:
    """Bytes per rank by item ("weights", "arena", "pools.kv", ...) against `capacity` bytes of `target`, whose
    devices the messages call `unit`s ("GPU"; "device" for a CPU target); `replicated`: the bytes of "weights"
    that every rank holds whole when the weights are split."""

    target: str
    capacity: int
    items: dict[str, int]
    unit: str = "GPU"
    replicated: int = 0

    @property
    def need(self) -> int:
        """Bytes one rank needs: the sum of the items."""
        return sum(self.items.values())

    @property
    def fits(self) -> bool:
        return self.need <= self.capacity

    @property
    def min_gpus(self) -> int | None:
        """The fewest devices that hold it with the sharded weights split over them (the module's rule); None if
        no count does."""
        weights = self.items.get("weights", 0)
        whole = self.need - weights + self.replicated
        if whole >= self.capacity:
            return None
        return max(1, math.ceil((weights - self.replicated) / (self.capacity - whole)))

    def to_json(self) -> dict:
        """plan.json's `budget`: capacity, need, fits, min_gpus and the items, in bytes."""
        return {"target": self.target, "capacity": self.capacity, "need": self.need, "fits": self.fits,
                "min_gpus": self.min_gpus, "items": dict(sorted(self.items.items()))}

    def describe(self) -> str:
        """'needs 2.0 TiB per rank on h200 (140.4 GiB): pools.kv 1.9 TiB, weights ..., arena ...' (top 3 items)."""
        top = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(self.items.items(), key=lambda kv: -kv[1])[:3])
        return f"needs {format_bytes(self.need)} per rank on {self.target} ({format_bytes(self.capacity)}): {top}"

    def check(self, plan_only: bool, allow_oversize: bool) -> str | None:
        """Apply the module's rule. Returns a warning line for a plan-only artifact that needs several GPUs (or
        one written with allow_oversize), None when it fits; raises ConfigError when it may not be written."""
        if self.fits:
            return None
        n = self.min_gpus
        if plan_only and n is not None:
            return (f"{self.describe()}: a plan for at least {n} {self.unit}s (weights split, replicated ones, "
                    "caches and arena whole)")
        if allow_oversize:
            return f"{self.describe()}: written anyway (--allow-oversize)"
        fix = "lower --max-batch / --max-seq / --max-prefill, or pass --allow-oversize to write the plan anyway"
        if plan_only:
            raise ConfigError(f"--plan-only: {self.describe()}; caches and arena alone exceed one device, so no "
                              f"{self.unit} count holds it: {fix}")
        raise ConfigError(f"{self.describe()}; the artifact runs on one device: {fix}")


def budget(target, weights: int, arena: int, pools: dict[str, dict], replicated: int = 0) -> Budget:
    """The Budget of an artifact for `target` (a `k3c.targets.Target`): `weights` and `arena` in bytes, `pools`
    as plan.json records them (name -> {"bytes", ...}), summed per kind (pools.kv, pools.kda_state, ...);
    `replicated`: the bytes of `weights` every rank holds whole (`Budget.min_gpus`)."""
    items = {"weights": int(weights), "arena": int(arena)}
    for name, p in pools.items():
        key = "pools." + name.rsplit(".", 1)[-1]
        items[key] = items.get(key, 0) + int(p["bytes"])
    capacity = int(target.measured.get("memory_bytes", target.memory_bytes))
    return Budget(target.name, capacity, items, "device" if target.kind == "cpu" else "GPU", int(replicated))
