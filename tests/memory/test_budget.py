"""The compile-time memory budget (k3c/memory/budget.py): the rule for runnable and plan-only artifacts."""

from __future__ import annotations

import pytest

from k3c.errors import ConfigError
from k3c.memory.budget import Budget, budget
from k3c.targets import load_target

GiB = 2**30


def test_items_are_grouped_per_pool_kind_against_the_measured_capacity():
    pools = {"layers.3.kv": {"bytes": 5}, "layers.7.kv": {"bytes": 7}, "layers.0.kda_state": {"bytes": 11}}
    b = budget(load_target("h200"), weights=100, arena=3, pools=pools)
    assert b.items == {"weights": 100, "arena": 3, "pools.kv": 12, "pools.kda_state": 11}
    assert b.need == 126 and b.capacity == 143771 * 2**20  # nvidia-smi total of the H200 (targets.py)
    assert b.fits and b.check(plan_only=False, allow_oversize=False) is None


def test_runnable_artifact_must_fit_one_device():
    b = Budget("h200", 100 * GiB, {"weights": 60 * GiB, "arena": 1 * GiB, "pools.kv": 50 * GiB})
    with pytest.raises(ConfigError, match=r"needs 111.0 GiB per rank on h200 \(100.0 GiB\): weights 60.0 GiB, "
                                          r"pools.kv 50.0 GiB, arena 1.0 GiB; .*--allow-oversize"):
        b.check(plan_only=False, allow_oversize=False)
    assert "written anyway" in b.check(plan_only=False, allow_oversize=True)


def test_plan_only_artifact_is_a_plan_for_the_fewest_gpus_that_hold_it():
    b = Budget("h200", 300, {"weights": 1000, "arena": 10, "pools.kv": 90})
    # weights split over n GPUs, arena + pools whole: 1000/5 + 100 = 300 fits, 1000/4 + 100 = 350 does not
    assert not b.fits and b.min_gpus == 5
    assert "a plan for at least 5 GPUs" in b.check(plan_only=True, allow_oversize=False)
    # a CPU target's budget counts devices (`budget` sets the unit from the target's kind)
    cpu = budget(load_target("cpu-x86-64"), 1000, 10, {})
    assert cpu.unit == "device" and budget(load_target("h200"), 1000, 10, {}).unit == "GPU"
    assert "at least 5 devices" in Budget("cpu", 300, b.items, "device").check(plan_only=True, allow_oversize=False)
    assert b.to_json() == {"target": "h200", "capacity": 300, "need": 1100, "fits": False, "min_gpus": 5,
                           "items": {"arena": 10, "pools.kv": 90, "weights": 1000}}
    # 40 bytes of the weights replicated (norms, router ...): each GPU holds them whole, so 960/5 + 40 + 100 = 332
    # no longer fits; 960/6 + 140 = 300 does. Replicated weights that fill a GPU with the caches: no count holds it
    assert Budget("h200", 300, b.items, replicated=40).min_gpus == 6
    assert Budget("h200", 300, b.items, replicated=200).min_gpus is None


def test_plan_only_artifact_that_no_gpu_count_holds_is_refused_unless_allowed():
    b = Budget("h200", 300, {"weights": 1000, "arena": 10, "pools.kv": 290})
    assert b.min_gpus is None
    with pytest.raises(ConfigError, match="no GPU count holds it.*--allow-oversize"):
        b.check(plan_only=True, allow_oversize=False)
    assert "written anyway" in b.check(plan_only=True, allow_oversize=True)
