"""On a CUDA GPU: k3.1-pro-tiny compiled f32 for `--target h200 --backend tvm` (every kernel group TVM's CUDA C,
GEMMs torch) runs through `k3c.load(..., "cuda")` and matches `models/k3.py` eager fp32 on the same GPU: a 64-token
prefill then 16 decode steps (CUDA graphs), batch 2, max relative error <= 1e-4 on every step's logits. Then
`k3c finalize` keeps the cubin NVRTC compiled at load, and a second load compiles nothing.

The artifact is built where apache-tvm is installed (the compiler); a GPU machine without it (the device tool)
runs the test on one built beforehand: `python tests/runtime/test_tvm_cuda.py DIR` writes DIR/ckpt and DIR/art,
and `K3C_TVM_CUDA_ARTIFACT=DIR` points the test at them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PRESET, PROMPT, STEPS, BATCH = "k3.1-pro-tiny", 64, 16, 2


def build(root: Path) -> tuple[Path, Path]:
    """Write a random f32 k3.1-pro-tiny checkpoint (MXFP4 experts) to root/ckpt and its TVM CUDA artifact to
    root/art; returns both directories."""
    from k3c.compile import CompileOptions, compile_model
    from models.config import K3Config
    from models.k3 import save_random_checkpoint

    save_random_checkpoint(K3Config.from_pretrained(PRESET), root / "ckpt", seed=2, dtype=torch.float32,
                           expert_format="mxfp4")
    opts = CompileOptions(str(root / "ckpt"), root / "art", target="h200", backend="tvm", max_batch=BATCH,
                          max_seq=PROMPT + STEPS + 1, max_prefill=PROMPT, dtype="f32")
    compile_model(opts)
    return root / "ckpt", root / "art"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    given = os.environ.get("K3C_TVM_CUDA_ARTIFACT")
    root = tmp_path_factory.mktemp("tvm-cuda")
    if given:
        shutil.copytree(Path(given) / "art", root / "art")
        return Path(given) / "ckpt", root / "art"
    if importlib.util.find_spec("tvm") is None:
        pytest.skip("building the artifact needs apache-tvm; or set K3C_TVM_CUDA_ARTIFACT (module docstring)")
    return build(root)


def _errors(session, model) -> list[float]:
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, PROMPT),
                           generator=torch.Generator().manual_seed(0)).cuda()
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    with torch.no_grad():
        want, cache = model(tokens)
        errs = [rel(session.prefill(tokens), want[:, -1:])]
        for _ in range(STEPS):
            nxt = want[:, -1:].argmax(-1)
            want, cache = model(nxt, cache)
            errs.append(rel(session.decode(nxt), want))
    return errs


def test_tvm_cuda_artifact_matches_eager(built):
    import k3c
    from k3c.runtime.launchers.tvm_cuda import TvmCudaLauncher
    from models.k3 import load_checkpoint

    ckpt, art = built
    model = load_checkpoint(ckpt, torch.float32, "cuda").eval()
    session = k3c.load(art, "cuda")
    launcher = session.launchers["tvm"]
    assert isinstance(launcher, TvmCudaLauncher) and len(launcher.compiled) == 1  # compiled at this load
    errs = _errors(session, model)
    print(f"max relative error per step: {max(errs):.2e}")
    assert max(errs) <= 1e-4, errs

    from k3c.runtime.artifact import read_artifact
    from k3c.runtime.finalize import finalize

    summary = finalize(art, "cuda")
    assert set(launcher.compiled) <= set(read_artifact(art).files), summary
    again = k3c.load(art, "cuda")
    assert again.launchers["tvm"].compiled == {}  # the cubin came from the artifact
    assert max(_errors(again, model)) <= 1e-4


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    print(*build(out))
