"""Load-time checks (k3c/runtime/checks.py): weights against the schedule, memory against the free bytes."""

from __future__ import annotations

import pytest
import torch

from k3c.errors import ArtifactError, RuntimeInputError
from k3c.runtime.checks import Facts, check_memory, check_weights, format_bytes

FACTS = Facts(max_batch=2, max_seq=8, max_prefill=4, vocab=16,
              weights={"w": (torch.float32, (4, 16)), "norm": (torch.float32, (16,))},
              pools={"layers.0.kv": (torch.bfloat16, (2, 8, 40)), "layers.1.kv": (torch.bfloat16, (2, 8, 40)),
                     "layers.2.kda_state": (torch.float32, (2, 4, 16, 16))},
              arena_bytes=1000, triton_dtypes=frozenset({"f32"}))


def test_items_sum_what_the_session_allocates():
    assert FACTS.items() == {"weights": (64 + 16) * 4, "arena": 1000, "pools.kv": 2 * 2 * 8 * 40 * 2,
                             "pools.kda_state": 2 * 4 * 16 * 16 * 4}


def test_memory_beyond_the_free_bytes_names_the_biggest_items():
    need = 320 + 1000 + 2560 + 8192
    check_memory(FACTS, torch.device("cpu"), free=need)
    with pytest.raises(RuntimeInputError, match=r"needs 11.8 KiB on cpu but 11.8 KiB is free \(pools.kda_state 8.0 "
                                                r"KiB, pools.kv 2.5 KiB, arena 1000 B; compiled for max_batch 2, "
                                                r"max_seq 8\)"):
        check_memory(FACTS, torch.device("cpu"), free=need - 1)
    assert format_bytes(3 * 2**50) == "3.0 PiB"


def test_weights_are_checked_by_name_dtype_and_shape():
    good = {"w": torch.zeros(4, 16), "norm": torch.zeros(16)}
    check_weights(good, FACTS, "a/weights/params.safetensors")
    cases = [({"w": good["w"]}, "lacks tensor 'norm' that schedule.json reads"),
             ({**good, "extra": torch.zeros(1)}, "tensor 'extra' is not read by schedule.json"),
             ({**good, "w": torch.zeros(4, 16, dtype=torch.bfloat16)},
              r"tensor 'w' is bfloat16 \[4, 16\], schedule.json expects float32 \[4, 16\]"),
             ({**good, "norm": torch.zeros(17)}, r"tensor 'norm' is float32 \[17\], schedule.json expects float32 \[16\]")]
    for tensors, msg in cases:
        with pytest.raises(ArtifactError, match="a/weights/params.safetensors: " + msg):
            check_weights(tensors, FACTS, "a/weights/params.safetensors")
