"""`k3c run`, `k3c finalize` and `k3c pack`, the commands of the machine that runs an artifact: prefill a prompt and
decode greedily (a multi-rank artifact as one process per rank), compile an artifact's kernels into it once, and
pack it into one file."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import typer

from k3c.cli.app import app, check_artifact_exists, check_writable, err, out, progress_bars
from k3c.errors import K3CError, shown

DEFAULT_PROMPT = "1,2,3,4,5,6,7,8"


@app.command()
def run(artifact: Path = typer.Argument(..., help="artifact directory or .k3c file"),
        tokens: str = typer.Option(DEFAULT_PROMPT, help="prompt token ids, comma-separated"),
        decode_steps: int = typer.Option(8, help="greedy tokens to generate"),
        device: str = typer.Option("cpu", help="cpu (Triton kernels interpreted) or cuda"),
        cuda_graphs: bool = typer.Option(True, help="on cuda, replay each decode step as one CUDA graph")):
    """Run an artifact: prefill the prompt, then greedy decode; prints the tokens and timing. A multi-rank
    artifact (--tp N) runs as N processes: started here (gloo on cpu, NCCL on cuda), or by `torchrun`."""
    ids = _token_ids(tokens)
    if decode_steps < 1:
        raise K3CError(f"--decode-steps {decode_steps}: generate at least one token")
    check_artifact_exists(artifact)
    tp, vocab = _artifact_facts(artifact)
    _check_token_ids(ids, vocab)
    if tp > 1 and "WORLD_SIZE" not in os.environ:  # not under torchrun: start the ranks here
        import torch.multiprocessing as mp

        from k3c.runtime.distributed import spawn

        with tempfile.TemporaryDirectory(prefix="k3c-run-") as tmp:
            try:
                spawn(_rank_main, tp, (artifact, ids, decode_steps, device, cuda_graphs, tmp))
            except mp.ProcessExitedException:  # a rank refused its input: rank 0 printed the one-line error
                raise typer.Exit(2) from None
            new, line = json.loads(Path(tmp, "rank0.json").read_text())
    else:
        with progress_bars() as progress:
            new, line = _generate(artifact, ids, decode_steps, device, cuda_graphs, progress)
    out.print(f"next tokens: {new}")
    err.print(line + (f"; {tp} ranks" if tp > 1 else ""))


def _artifact_facts(artifact: Path) -> tuple[int, int | None]:
    """(tensor-parallel degree, vocabulary size) of the verified artifact's manifest (`extra.vocab_size`, checked
    against the hashed build.json); vocabulary None when the manifest does not record one. Raises ArtifactError."""
    from k3c.runtime.artifact import read_artifact

    manifest = read_artifact(artifact).manifest
    extra = manifest.get("extra")
    vocab = extra.get("vocab_size") if isinstance(extra, dict) else None
    known = isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0
    return int(manifest.get("tp", 1)), vocab if known else None


#: a token id as `--tokens` takes it: ASCII digits, an optional minus (no '+', '_', other scripts' digits)
_TOKEN_ID = re.compile(r"\s*-?[0-9]+\s*", re.ASCII)
#: digits kept of an id that long: it is out of every vocabulary, and Python refuses ints of over 4300 digits
_ID_DIGITS = 100


def _token_ids(text: str) -> list[int]:
    """The ids of `--tokens` text ("1,2,3"; spaces around an id allowed). An id of more than 100 digits is kept
    as its first 100 (out of range either way: `_check_token_ids` names it). Raises K3CError (one line, the text
    cut to 60 characters) for anything but comma-separated decimal integers."""
    parts = text.split(",")
    if not all(_TOKEN_ID.fullmatch(p) for p in parts):
        raise K3CError(f"--tokens {shown(text)}: expected comma-separated integers")
    return [int(p.strip()[:_ID_DIGITS + p.strip().startswith("-")]) for p in parts]


def _check_token_ids(ids: list[int], vocab: int | None) -> None:
    """Raise K3CError naming the first of `ids` outside the vocabulary [0, vocab) (negative, or vocab or more: a
    2^63 that no int64 holds included), as one line. Vocabulary None (not in the manifest): ids must fit in int64,
    and the session checks them against the vocabulary it derives."""
    bound = vocab if vocab is not None else 2**63
    bad = next((x for x in ids if not 0 <= x < bound), None)
    if bad is None:
        return
    if vocab is None:
        raise K3CError(f"--tokens: token id {shown(bad)} is out of range (ids are 0 .. 2^63 - 1)")
    raise K3CError(f"--tokens: token id {shown(bad)} is out of range for the model's vocabulary [0, {vocab})")


def _rank_main(rank, artifact, ids, decode_steps, device, cuda_graphs, tmp) -> None:
    """One rank spawned by `k3c run` (`k3c.runtime.distributed.spawn`: torchrun's environment, its share of the
    cores), then the generation of a single-process run."""
    try:
        result = _generate(artifact, ids, decode_steps, device, cuda_graphs, lambda *a: None)
    except K3CError as e:  # one line from rank 0, as a single-process run prints it
        if rank == 0:
            err.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    if rank == 0:
        Path(tmp, "rank0.json").write_text(json.dumps(result))


def _generate(artifact, ids, decode_steps, device, cuda_graphs, progress) -> tuple[list[int], str]:
    """Load, prefill `ids` chunk by chunk (showing progress on long prompts), greedy-decode; returns (the new
    tokens, a timing line)."""
    import torch

    from k3c.runtime.session import load

    progress("loading", 0, None)
    t0 = time.perf_counter()
    session = load(artifact, device, cuda_graphs=cuda_graphs)
    t_load = time.perf_counter() - t0
    if len(ids) + decode_steps - 1 > session.max_seq:
        raise K3CError(f"{len(ids)} prompt tokens + {decode_steps} generated exceed the compiled max_seq "
                       f"{session.max_seq} (the last generated token is not fed back)")
    prompt, t_prefill = torch.tensor([ids]), 0.0
    chunks = prompt.split(session.max_prefill, dim=1)
    for i, chunk in enumerate(chunks):
        progress("prefill chunks", i, len(chunks))
        logits = session.prefill(chunk)
        t_prefill += session.last_timing["seconds"]
    new, steps = [int(logits[0, -1].argmax())], []
    for i in range(decode_steps - 1):
        progress("decode", i, decode_steps - 1)
        logits = session.decode(torch.tensor([[new[-1]]]))
        steps.append(session.last_timing["seconds"])
        new.append(int(logits[0, -1].argmax()))
    per = f"{sum(steps) / len(steps) * 1e3:.1f} ms/step" if steps else "-"
    return new, f"load {t_load:.2f} s; prefill {len(ids)} tokens {t_prefill * 1e3:.1f} ms; decode {per} ({device})"


@app.command()
def finalize(artifact: Path = typer.Argument(..., help="artifact directory"),
             device: str = typer.Option("cuda", help="the CUDA device to compile for")):
    """Compile the artifact's Triton kernels for this GPU and Triton once and add them to it (loads then compile
    nothing; run on the machine that runs the artifact)."""
    check_artifact_exists(artifact)
    from k3c.runtime.finalize import finalize as _finalize

    r = _finalize(artifact, device)
    if r["skipped"]:
        out.print(f"{artifact}: already holds the kernels for {r['tag']}")
    else:
        out.print(f"{artifact}: added {r['files']} files ({r['bytes'] / 2**20:.1f} MiB) of compiled kernels for "
                  f"{r['tag']} in {r['seconds']:.1f} s")


@app.command()
def pack(artifact: Path = typer.Argument(..., help="artifact directory (or .k3c file) to pack"),
         output: Path = typer.Option(None, "-o", "--output", help="the .k3c file to write [default: ARTIFACT.k3c]"),
         force: bool = typer.Option(False, "--force", help="replace an existing -o file")):
    """Pack a verified artifact into one deterministic .k3c file (a tar: manifest first, files sorted, no
    timestamps or owners), which `k3c run` and `k3c.load` read like the directory."""
    check_artifact_exists(artifact)
    whole = artifact.resolve()                                  # "." inside the artifact: its own name
    dest = output if output is not None else whole.with_name(whole.name + ".k3c")
    flag = "-o" if output is not None else "the default output (pass -o)"
    check_writable(dest, flag, file=True)
    if dest.exists() and not force:
        raise K3CError(f"{flag} {dest}: already exists (pass --force to overwrite it)")
    from k3c.runtime.artifact import pack as _pack

    path = _pack(artifact, dest, force=force)
    out.print(f"wrote {path} ({path.stat().st_size / 2**20:,.1f} MiB)", soft_wrap=True)
