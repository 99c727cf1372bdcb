"""The k3c runtime: load an artifact, allocate one arena and the persistent cache pools, run prefill / decode.

    session = k3c.load("build/k3-tiny.k3c", device="cpu")    # on CPU the Triton kernels run under TRITON_INTERPRET
    logits = session.prefill(tokens)                          # int64 [B,T] -> [B,1,vocab] (the last position)
    logits = session.prefill(tokens, logits="all")            # [B,T,vocab] (compiled with all_logits / --all-logits)
    logits = session.decode(next_tokens)                      # [B,1] -> [B,1,vocab]
    new = session.generate(tokens, steps)                     # greedy: [B,T] -> int64 [B,steps], no host sync
    session.reset()                                           # forget the sequences (caches zeroed)

Execution follows `schedule.json`: each launch goes to the launcher of its backend (`k3c.runtime.launchers`): a
generated Triton kernel (imported from the artifact's `kernels/`), a TVM kernel of the artifact's shared library,
a library call (torch/cuBLAS) or a view. Intermediates live at the offsets of `plan.json` in one arena
(the plan is made at the compile bounds, so every smaller call fits); caches live in pools sized at the bounds
(KDA states updated in place, KV and index keys appended in place). A prompt longer than `max_prefill` is
prefilled in chunks. Decode reads the context length of each sequence from device memory (`lengths`, i32, kept
in step with `length`; `k3c.runtime.graphs`), so on CUDA the decode steps after the first at a batch size replay
one CUDA graph of the whole step (`cuda_graphs=False` launches every kernel from Python). This module never imports the
compiler: only torch, safetensors and the artifact files.
Bounds, dtypes and shapes come from the hashed plan.json / schedule.json and are checked before anything is
allocated (`k3c.runtime.checks`): weights against the schedule, weights + arena + pools against free memory.
Errors: ArtifactError (bad or inconsistent artifact, naming the file and key), RuntimeInputError (the artifact
does not fit the device's free memory, tokens out of vocabulary, batch or context beyond the bounds, a batch size
that changes between calls).

A multi-rank artifact (`manifest.json` tp = N > 1) runs as N processes, one per rank, in a torch.distributed
process group of world size N (started by `torchrun`, or by `k3c run`, which spawns them; `k3c.runtime.distributed`
joins the group): each process loads `weights/rank{r}.safetensors` for its own rank r and runs the shared schedule;
the collectives go through `k3c.runtime.launchers.collective`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from k3c.errors import ArtifactError, RuntimeInputError
from k3c.runtime.artifact import read_artifact
from k3c.runtime import distributed, layouts
from k3c.runtime.checks import WEIGHTS, check_memory, check_weights, derive
from k3c.runtime.frame import Frame
from k3c.runtime.graphs import DecodeGraph, device_lengths_supported
from k3c.runtime.launchers import make_launchers


def load(path: str | os.PathLike, device: str | torch.device = "cpu", *, cuda_graphs: bool = True,
         finalize: bool = False) -> "Session":
    """Load and verify the artifact at `path` (directory or .k3c file) onto `device`.

    cuda_graphs: on a CUDA device, replay decode steps as whole-step CUDA graphs (`k3c.runtime.graphs`).
    finalize: on a CUDA device, if the artifact ships no compiled kernels for this Triton and GPU, compile them now
    on a warm-up workload and add them to the artifact directory (`k3c.runtime.finalize`; the next load compiles
    nothing). Without it such an artifact JIT-compiles each kernel at its first launch."""
    session = Session(path, device, cuda_graphs=cuda_graphs)
    if finalize and session.device.type == "cuda":
        from k3c.runtime.finalize import finalize_session

        session.finalized = finalize_session(session)
    return session


def _tokens_error(tokens) -> str:
    """The message for `tokens` that are not an int64 / int32 tensor [B, T] with data: what was expected and what
    came."""
    got = (f"a {tokens.dtype} tensor of shape {list(tokens.shape)} on {tokens.device}"
           if isinstance(tokens, torch.Tensor) else f"a {type(tokens).__name__}")
    return f"tokens must be an int64 or int32 tensor of shape [B, T] (on the CPU or the session's device); got {got}"


class Session:
    """A loaded artifact with its arena, pools and weights on one device; see the module docstring."""

    def __init__(self, path, device, *, cuda_graphs: bool = True):
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):
            raise RuntimeInputError(f"device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'") from None
        if self.device.type not in ("cpu", "cuda"):
            raise RuntimeInputError(f"device {device!r}: the k3c runtime runs on 'cpu' or 'cuda'")
        if self.device == torch.device("cuda") and "LOCAL_RANK" in os.environ:  # one GPU per torchrun process
            self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeInputError(f"device {device!r}: this torch build or machine has no CUDA GPU")
        t0 = time.perf_counter()
        # every file against its hash but the weights (checked below, while they are copied; each rank checks its
        # own), manifest.json against the hashed build.json
        art = read_artifact(path, defer=("weights/",))
        t1 = time.perf_counter()
        self.path, self.manifest, self.artifact_files = Path(path), art.manifest, art.files
        if not art.has_weights:
            raise ArtifactError(f"{path}: a plan-only artifact has no weights and cannot run (compile without --plan-only)")
        facts = derive(art)  # bounds, vocabulary, weight / pool types: from the hashed plan.json and schedule.json
        self.max_batch, self.max_seq, self.max_prefill, self.vocab = (facts.max_batch, facts.max_seq,
                                                                      facts.max_prefill, facts.vocab)
        self.schedule = art.schedule
        low = sorted(facts.triton_dtypes & {"bf16", "f16"})
        if self.device.type == "cpu" and low:
            # Triton's interpreter multiplies bf16 tiles wrongly in tl.dot (triton 3.9: errors of 1e10 on a 16x16
            # product), so a CPU run of a bf16 Triton artifact would give wrong logits without any error
            raise RuntimeInputError(f"{path}: a {low[0]} artifact with Triton kernels cannot run on CPU (Triton's "
                                    f"interpreter computes {low[0]} tl.dot wrongly); compile it for a CPU target "
                                    f"(--target cpu-x86-64) or with --dtype f32, or run it on cuda")
        check_memory(facts, self.device)
        plan = art.plan
        self.offsets = {e: {k: v["offset"] for k, v in plan["arena"][e]["buffers"].items()} for e in plan["arena"]}
        self.tp = int(art.manifest.get("tp", 1))
        self.rank = 0 if self.tp == 1 else distributed.join(self.tp, self.device, path)
        wfile = WEIGHTS if self.tp == 1 else f"weights/rank{self.rank}.safetensors"
        if wfile not in art.files:
            raise ArtifactError(f"{path}: rank {self.rank} of {self.tp} has no weight file {wfile}")
        weights = art.load_tensors(wfile)  # memory-mapped; names, dtypes and shapes checked before any copy
        check_weights(weights, facts, f"{path}/{wfile}")
        relay = layouts.declared(self.schedule, weights, f"{path}/{wfile}")     # checked before the copy
        self.arena = torch.empty(max(facts.arena_bytes, 1), dtype=torch.uint8, device=self.device)
        self._workdir = Path(tempfile.mkdtemp(prefix="k3c-kernels-"))
        weakref.finalize(self, shutil.rmtree, self._workdir, True)
        # three things side by side: the weight copy and the file's sha256 on worker threads (torch's copies and
        # hashlib release the GIL), the kernel code loaded here (modules imported, compiled kernels installed);
        # the copy is the long one, so the kernels cost no wall time
        with ThreadPoolExecutor(2) as pool:
            hashed = pool.submit(art.check, wfile)
            copied = pool.submit(lambda: {k: v.to(self.device) for k, v in weights.items()})
            t2 = time.perf_counter()
            self.launchers = make_launchers(art, self.device, self.schedule, self._workdir)
            t3 = time.perf_counter()
            self.weights = copied.result()
            hashed.result()  # a corrupted file raises ArtifactError here, before anything runs
        layouts.apply(self.weights, relay)
        #: weights re-laid on the device for the kernels that read them so (name -> layout; k3c.runtime.layouts)
        self.weight_layouts = relay
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        #: where the load went, seconds: files read and hash-checked; weights copied, hash-checked and re-laid
        #: (`layouts`; with the arena allocation), the wall time of the load's second part; kernel code loaded,
        #: overlapped with it
        self.load_seconds = {"verify": t1 - t0, "weights": time.perf_counter() - t1, "kernels": t3 - t2}
        self.pools = {n: torch.zeros(shp, dtype=dt, device=self.device) for n, (dt, shp) in facts.pools.items()}
        # the context of each sequence in device memory, read by decode's context-dependent launches; None where
        # one of them needs it on the host (TVM kernels): then decode takes the host length, without CUDA graphs
        self.lengths = (torch.zeros(self.max_batch, dtype=torch.int32, device=self.device)
                        if device_lengths_supported(self.schedule["decode"]) else None)
        self.batch: int | None = None
        self.length = 0
        self.last_timing: dict = {}
        self.finalized: dict | None = None  # what `load(..., finalize=True)` added (k3c.runtime.finalize)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and self.lengths is not None
        self._graphs: dict[int, DecodeGraph] = {}  # by batch size
        self._greedy: dict[int, DecodeGraph] = {}  # by batch size: decode + argmax into the next input (`generate`)
        #: i64 arange(n) on the device by n, for the append positions of frames with device lengths (`Frame`)
        self.aranges: dict[int, torch.Tensor] = {}

    # ---- public -------------------------------------------------------------------------------------------------
    @property
    def world(self) -> tuple[int, int]:
        """(rank, tp): this process's rank and the artifact's tensor-parallel degree."""
        return self.rank, self.tp

    @property
    def length(self) -> int:
        """The context length of the sequences (tokens appended so far). Setting it (e.g. a benchmark at a fixed
        context; the cache contents are kept) sets the device lengths too."""
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        self._length = value
        if self.lengths is not None:
            self.lengths.fill_(value)

    def reset(self) -> None:
        """Zero every cache pool and forget the batch."""
        for p in self.pools.values():
            p.zero_()
        self.batch, self.length = None, 0

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, logits: str = "last") -> torch.Tensor:
        """Append prompt tokens int64 [B,T] (T >= 1) to the sequences; returns the logits in the artifact's dtype:
        [B,1,vocab] of the last position (`logits="last"`: the lm_head runs on that row only) or [B,T,vocab] of
        every position (`logits="all"`: needs an artifact compiled with `all_logits`, the `prefill_all` entry).
        Raises RuntimeInputError (bad tokens, or "all" from an artifact without `prefill_all`)."""
        if logits not in ("last", "all"):
            raise RuntimeInputError(f"logits={logits!r}: expected 'last' or 'all'")
        if logits == "all" and "prefill_all" not in self.schedule:
            raise RuntimeInputError("logits='all': this artifact has no prefill_all entry (compile it with "
                                    "--all-logits)")
        tokens = self._check(tokens)
        chunks = tokens.split(self.max_prefill, dim=1)
        entry = "prefill" if logits == "last" else "prefill_all"
        if logits == "last":  # only the last chunk's logits are returned: the others skip the copy
            for c in chunks[:-1]:
                self._run(entry if c.shape[1] > 1 else "decode", c, keep=False)
            chunks = chunks[-1:]
        return torch.cat([self._run(entry if c.shape[1] > 1 else "decode", c) for c in chunks], 1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step: int64 [B,1] -> logits [B,1,vocab] in the artifact's dtype."""
        tokens = self._check(tokens)
        if tokens.shape[1] != 1:
            raise RuntimeInputError(f"decode takes tokens of shape [B,1], got {list(tokens.shape)}; use prefill")
        return self._run("decode", tokens)

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """Greedy generation: append prompt tokens int64 [B,T] (`prefill`, or one `decode` step when T = 1), then
        `steps` − 1 decode steps, each fed the previous step's most likely token. Returns the `steps` generated
        tokens, int64 [B, steps] on the session's device. On CUDA with whole-step graphs the decode steps replay one
        graph per batch size that also takes the argmax into its own token input (`DecodeGraph(greedy=True)`), so the
        host never waits for a step and the steps run back to back on the GPU; elsewhere each step is a `decode`
        call. Raises RuntimeInputError (as `prefill` / `decode`; steps < 1; the context plus the steps − 1 tokens
        fed back beyond max_seq)."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise RuntimeInputError(f"steps={steps!r}: expected an integer >= 1")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise RuntimeInputError(_tokens_error(tokens))
        if self.length + tokens.shape[1] + steps - 1 > self.max_seq:
            raise RuntimeInputError(f"context {self.length} + {tokens.shape[1]} prompt tokens + {steps - 1} fed back "
                                    f"exceeds the compiled max_seq {self.max_seq}")
        t0 = time.perf_counter()
        logits = self.prefill(tokens) if tokens.shape[1] > 1 else self.decode(tokens)
        B = logits.shape[0]
        out = torch.empty((B, steps), dtype=torch.int64, device=self.device)
        nxt = logits[:, -1:].argmax(-1)
        out[:, :1] = nxt
        for i in range(1, steps):
            graph = self._greedy.get(B) if self.cuda_graphs else None
            if graph is None and self.cuda_graphs and B in self._graphs:  # kernels set up by the decode graph's step
                graph = self._greedy[B] = DecodeGraph(self, B, greedy=True)
            if graph is None:  # no graphs (CPU, TVM kernels, cuda_graphs=False) or the first step at this batch
                nxt = self.decode(nxt)[:, -1:].argmax(-1)
            else:
                graph.replay(nxt)
                nxt = graph.tokens
                self._length += 1  # the graph moved the device lengths on
            out[:, i:i + 1] = nxt
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.last_timing = {"entry": "generate", "tokens": steps, "seconds": time.perf_counter() - t0,
                            "cuda_graphs": steps > 1 and self.cuda_graphs and B in self._greedy}
        return out

    # ---- execution ----------------------------------------------------------------------------------------------
    def _check(self, tokens) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32) \
                or tokens.device.type == "meta":
            raise RuntimeInputError(_tokens_error(tokens))
        B, T = tokens.shape
        if T < 1 or B < 1:
            raise RuntimeInputError(f"tokens of shape {list(tokens.shape)}: need at least one sequence and one token")
        host = tokens if tokens.device.type == "cpu" else tokens.cpu()  # one copy from the GPU, no reduce kernels
        lo, hi = int(host.min()), int(host.max())
        if lo < 0 or hi >= self.vocab:
            raise RuntimeInputError(f"token id {hi if hi >= self.vocab else lo} is outside the vocabulary [0, {self.vocab})")
        if B > self.max_batch:
            raise RuntimeInputError(f"batch {B} exceeds the compiled max_batch {self.max_batch}")
        if self.batch is not None and B != self.batch:
            raise RuntimeInputError(f"batch {B} differs from the session's batch {self.batch}; call reset() first")
        if self.length + T > self.max_seq:
            raise RuntimeInputError(f"context {self.length} + {T} tokens exceeds the compiled max_seq {self.max_seq}")
        return tokens.to(self.device, torch.int64)

    def _run(self, entry: str, tokens: torch.Tensor, keep: bool = True) -> torch.Tensor | None:
        """Run `entry` on `tokens` at the session's length; returns a copy of the logits (None unless `keep`)."""
        t0 = time.perf_counter()
        B, T = tokens.shape
        lengths = self.lengths[:B] if entry == "decode" and self.lengths is not None else None
        graph = self._graphs.get(B) if lengths is not None else None
        if graph is not None:
            out = graph.replay(tokens)
        else:
            frame = Frame(self, entry, B, T, self._length if lengths is None else self.max_seq - T, lengths)
            frame.env["tokens"] = tokens
            for ln in self.schedule[entry]["launches"]:
                frame.launch(ln)
            out = frame.env[self.schedule[entry]["outputs"]["logits"]]
            if lengths is not None:
                lengths.add_(T)
                if self.cuda_graphs:  # after one eager step (Triton JIT, cuBLAS set up): capture; runs nothing
                    self._graphs[B] = DecodeGraph(self, B)
        logits = out.clone() if keep else None
        self.batch = B
        if lengths is None:
            self.length += T
        else:  # the device lengths moved on already
            self._length += T
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.last_timing = {"entry": entry, "tokens": T, "seconds": time.perf_counter() - t0,
                            "cuda_graphs": graph is not None}
        return logits
