"""Artifact I/O: write an artifact directory atomically and deterministically, read and verify it, pack it.

Layout (DESIGN.md "Artifact"): `manifest.json` (format_version, k3c_version, config, target, tp, bounds,
entry_points, extra, files: {relpath: sha256 hex}), `build.json` (every manifest field but `files`, hashed like
any other file), `graph/`, `kernels/`, `plan.json`, `schedule.json`, `report.json` and optional `weights/`
(safetensors; absent for a plan-only build).
Integrity: every file is checked against its sha256 in `files`, and every other manifest field against the hashed
`build.json` (`read_artifact`), so no byte the runtime reads escapes the check; the runtime itself derives bounds,
dtypes and shapes from the hashed `plan.json` / `schedule.json` (`k3c.runtime.checks`).
A `.k3c` file is the same tree as one uncompressed tar (manifest first, then the files in sorted order,
mtimes/uids zeroed), readable in place.

Runtime code: imports only the standard library, torch, safetensors and k3c.errors, never the compiler.
Determinism: identical inputs give byte-identical files: JSON with sorted keys, fixed separators, a trailing
newline; safetensors written here with sorted header keys and fixed metadata; no timestamps anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tarfile
import weakref
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Mapping

import safetensors
import safetensors.torch
import torch

from k3c import __version__, termination
from k3c.atomic import name_too_long, replacing, temporary_sibling
from k3c.errors import ArtifactError, shown
from k3c.runtime.encoding import canonical_json, safetensors_chunks

#: the artifact format this runtime writes and reads; bump on any incompatible change (3: schedule.json's
#: `weight_layouts`, weights the runtime must re-lay before the kernels read them: k3c.runtime.layouts)
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
BUILD = "build.json"  # the manifest's fields other than `files`, hashed (format version 2)
REQUIRED_FILES = (BUILD, "plan.json", "schedule.json", "report.json")
_CHUNK = 1 << 22


def _check_relpath(relpath: str) -> str:
    parts = PurePosixPath(relpath).parts if isinstance(relpath, str) else ()
    if (not parts or relpath.startswith("/") or "\\" in relpath or any(p in ("", ".", "..") for p in parts)
            or "/".join(parts) != relpath or relpath == MANIFEST):
        raise ArtifactError(f"artifact file name {relpath!r} must be a plain relative path (not {MANIFEST})")
    return relpath


class ArtifactWriter:
    """Collects an artifact's files in a staging directory next to `out_dir`, then `commit()` renames it in.

    Files are streamed to disk as they are added (weights need not fit in memory) and hashed on the way.
    `out_dir` must not exist, unless `force`: then an existing artifact directory (one with a manifest.json,
    or an empty directory) is replaced: renamed away, the new one renamed in, the old one deleted. Use as a
    context manager: an exception inside the block, a failed commit, or leaving the block without committing
    removes the staging directory and leaves `out_dir` as it was. Raises ArtifactError.
    """

    def __init__(self, out_dir: str | os.PathLike, force: bool = False):
        self.out_dir = Path(out_dir).absolute()
        self.force = force
        self._hashes: dict[str, str] = {}
        self._staging: Path | None = None
        self._cleanup = None
        self._done = False
        self._check_target()

    def _check_target(self) -> None:
        out = self.out_dir
        why = name_too_long(out)
        if why:
            raise ArtifactError(f"cannot create the artifact {out}: {why}")
        if out.is_symlink():   # replacing a link would put a directory where the link was, not where it points
            raise ArtifactError(f"refusing to write the artifact {out}: it is a symbolic link; give the directory's "
                                "own path")
        if not out.exists():
            return
        if not self.force:
            raise ArtifactError(f"{out} already exists; pass --force (force=True) to replace it")
        if not out.is_dir() or not ((out / MANIFEST).is_file() or not any(out.iterdir())):
            raise ArtifactError(f"refusing to replace {out}: it is not a k3c artifact directory")

    def _ensure_staging(self) -> Path:
        if self._staging is None:
            staging = temporary_sibling(self.out_dir, "tmp", keep_suffix=False)
            try:
                self.out_dir.parent.mkdir(parents=True, exist_ok=True)
                staging.mkdir()
            except OSError as err:  # named: a parent that cannot be made; never the staging directory
                where = err.filename if err.filename not in (None, str(staging), staging) else None
                raise ArtifactError(f"cannot create the artifact {self.out_dir}: {err.strerror or err}"
                                    + (f" ({where})" if where else "")) from None
            self._staging = staging
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._staging, True)
        return self._staging

    def open(self) -> "ArtifactWriter":
        """Create the staging directory now (it is otherwise made by the first file added), so that an output
        location that cannot be written fails before any work is done. Returns self. Raises ArtifactError."""
        self._ensure_staging()
        return self

    def _stage(self, relpath: str) -> Path:
        if self._done:
            raise ArtifactError(f"artifact {self.out_dir} is already committed or aborted")
        if _check_relpath(relpath) in self._hashes:
            raise ArtifactError(f"artifact file {relpath} added twice")
        path = self._ensure_staging() / relpath
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ArtifactError(f"cannot add artifact file {relpath} of {self.out_dir}: "
                                f"{err.strerror or err}") from None
        return path

    def _write(self, relpath: str, chunks: Iterable[bytes | memoryview]) -> None:
        path = self._stage(relpath)
        digest = hashlib.sha256()
        try:
            with open(path, "xb") as f:
                for chunk in chunks:
                    digest.update(chunk)
                    f.write(chunk)
        except BaseException as err:
            path.unlink(missing_ok=True)  # a half-written file must not stay in the staging directory
            if isinstance(err, OSError):
                raise ArtifactError(f"cannot write artifact file {relpath} of {self.out_dir}: "
                                    f"{err.strerror or err}") from None
            raise
        self._hashes[relpath] = digest.hexdigest()

    def add_bytes(self, relpath: str, data: bytes) -> None:
        """Add a file with these exact bytes (e.g. a compiled kernel)."""
        self._write(relpath, [bytes(data)])

    def add_text(self, relpath: str, text: str) -> None:
        """Add a UTF-8 text file (e.g. generated kernel source, the IR's text form)."""
        self._write(relpath, [text.encode("utf-8")])

    def add_json(self, relpath: str, obj: Any) -> None:
        """Add a JSON file in canonical form (see canonical_json)."""
        self._write(relpath, [canonical_json(obj, relpath)])

    def add_existing(self, relpath: str, src: str | os.PathLike, sha256: str) -> None:
        """Add file `src` of a verified artifact as `relpath` with its known `sha256`: hard-linked (copied across
        file systems), not rehashed. Used to amend an artifact (`k3c.runtime.finalize`) without copying weights."""
        path = self._stage(relpath)
        try:
            try:
                os.link(src, path)
            except OSError:
                shutil.copyfile(src, path)
        except OSError as err:
            raise ArtifactError(f"cannot add artifact file {relpath} of {self.out_dir} from {src}: "
                                f"{err.strerror or err}") from None
        self._hashes[relpath] = sha256

    def add_tensors(self, relpath: str, tensors: Mapping[str, torch.Tensor],
                    metadata: Mapping[str, str] | None = None) -> None:
        """Add a deterministic safetensors file (see safetensors_chunks), e.g. `weights/rank0.safetensors`."""
        self._write(relpath, safetensors_chunks(tensors, metadata))

    def commit(self, *, config: dict, target: dict, tp: int, bounds: dict, entry_points: dict,
               extra: dict | None = None) -> Path:
        """Write manifest.json and move the artifact into `out_dir` atomically; returns `out_dir`.

        config: the model config dict; target: Target.to_dict(); tp: tensor-parallel degree (>= 1); bounds:
        compile bounds (max_batch, max_seq, ...); entry_points: name -> description (prefill, decode);
        extra: optional JSON data stored as manifest["extra"]. The same fields also go to the hashed `build.json`.
        Raises ArtifactError: a required file (plan.json, schedule.json, report.json) is missing, build.json was
        added by the caller, a bad field, out_dir appeared meanwhile, or an OSError writing the manifest or renaming
        (named by out_dir, never by the staging directory; out_dir is then as it was).
        """
        if self._done:
            raise ArtifactError(f"artifact {self.out_dir} is already committed or aborted")
        try:
            for name, value, kind in (("config", config, dict), ("target", target, dict), ("bounds", bounds, dict),
                                      ("entry_points", entry_points, dict), ("extra", extra or {}, dict)):
                if not isinstance(value, kind):
                    raise ArtifactError(f"manifest field {name} must be a {kind.__name__}, got {type(value).__name__}")
            if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
                raise ArtifactError(f"manifest field tp must be an int >= 1, got {tp!r}")
            fields = {"format_version": FORMAT_VERSION, "k3c_version": __version__, "config": config,
                      "target": target, "tp": tp, "bounds": bounds, "entry_points": entry_points}
            if extra:
                fields["extra"] = extra
            with termination.deferred():  # a SIGTERM stops the commit before it starts, or acts after it
                self._write(BUILD, [canonical_json(fields, BUILD)])
                missing = [f for f in REQUIRED_FILES if f not in self._hashes]
                if missing:
                    raise ArtifactError(f"artifact {self.out_dir} lacks required file(s): {', '.join(missing)}")
                manifest = {**fields, "files": dict(sorted(self._hashes.items()))}
                data = canonical_json(manifest, MANIFEST)
                staging = self._ensure_staging()
                (staging / MANIFEST).write_bytes(data)
                self._check_target()
                self._swap_in(staging)
                self._done = True
                self._cleanup.detach()
        except OSError as err:
            self.abort()
            raise ArtifactError(f"cannot write the artifact {self.out_dir}: {err.strerror or err}") from None
        except BaseException:
            self.abort()
            raise
        return self.out_dir

    def _swap_in(self, staging: Path) -> None:
        out = self.out_dir
        if not (out.exists() or out.is_symlink()):
            os.rename(staging, out)
            return
        os.chmod(staging, stat.S_IMODE(os.stat(out).st_mode))   # the replaced artifact's permissions stay
        old = temporary_sibling(out, "old", keep_suffix=False)
        os.rename(out, old)
        try:
            os.rename(staging, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Drop everything added so far; `out_dir` is left as it was. Safe to call twice."""
        self._done = True
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            if self._cleanup is not None:
                self._cleanup.detach()

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, *exc) -> None:
        if not self._done:
            self.abort()


class _Source:
    """Read access to an artifact's files, by relative path: size, open (positioned at the data), chunks."""

    def chunks(self, rel: str):
        left = self.size(rel)
        with self.open(rel) as f:
            while left:
                chunk = f.read(min(left, _CHUNK))
                if not chunk:
                    raise ArtifactError(f"{self.path}: {rel} is truncated")
                left -= len(chunk)
                yield chunk


class _DirSource(_Source):
    def __init__(self, root: Path):
        self.root = self.path = root

    def names(self) -> set[str]:
        out = set()
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                path = Path(dirpath, name)
                rel = path.relative_to(self.root).as_posix()
                if path.is_symlink() or not path.is_file():
                    raise ArtifactError(f"{self.root}: {rel} is not a regular file")
                out.add(rel)
        return out

    def size(self, rel: str) -> int:
        return (self.root / rel).stat().st_size

    def open(self, rel: str):
        return open(self.root / rel, "rb")


class _TarSource(_Source):
    def __init__(self, path: Path):
        self.path, self.index = path, {}
        try:
            with tarfile.open(path, "r:") as tar:
                for m in tar:
                    if not m.isfile() or m.name in self.index or (m.name != MANIFEST and not _check_relpath(m.name)):
                        raise ArtifactError(f"{path}: archive entry {m.name!r} is not a unique plain file")
                    self.index[m.name] = (m.offset_data, m.size)
        except (tarfile.TarError, OSError) as err:
            raise ArtifactError(f"{path}: not an artifact directory or .k3c archive ({err})") from None

    def names(self) -> set[str]:
        return set(self.index)

    def size(self, rel: str) -> int:
        return self.index[rel][1]

    def open(self, rel: str):
        """A file object positioned at the entry's data (read at most size(rel) bytes from it)."""
        f = open(self.path, "rb")
        f.seek(self.index[rel][0])
        return f


class Artifact:
    """A loaded artifact: `manifest` (dict) read eagerly, files read on demand and checked against their hash.

    path: the directory or .k3c file; files: relpath -> sha256 from the manifest (manifest.json excluded).
    """

    def __init__(self, path: Path, manifest: dict, source: _DirSource | _TarSource, verified: set[str],
                 deferred: set[str] = frozenset()):
        self.path, self.manifest, self._source, self._verified = path, manifest, source, verified
        self._deferred = set(deferred)  # not hashed by read_artifact: the caller checks them (`check`)
        self.files: dict[str, str] = manifest["files"]

    @property
    def format_version(self) -> int:
        return self.manifest["format_version"]

    @property
    def has_weights(self) -> bool:
        """True unless this is a plan-only build (no files under weights/)."""
        return any(f.startswith("weights/") for f in self.files)

    def _known(self, rel: str) -> None:
        if rel not in self.files:
            raise ArtifactError(f"{self.path}: artifact has no file {rel}")

    def read_bytes(self, rel: str) -> bytes:
        """The bytes of file `rel`. Raises ArtifactError if unknown or its sha256 differs from the manifest."""
        self._known(rel)
        data = b"".join(self._source.chunks(rel))
        if hashlib.sha256(data).hexdigest() != self.files[rel]:
            raise ArtifactError(f"{self.path}: {rel} is corrupted (sha256 differs from the manifest)")
        return data

    def check(self, rel: str) -> None:
        """Hash file `rel` against the manifest (a file `read_artifact` deferred; a no-op for one already
        checked). hashlib releases the GIL, so this runs beside a copy in another thread. Raises ArtifactError."""
        self._known(rel)
        if rel in self._verified:
            return
        digest = hashlib.sha256()
        for chunk in self._source.chunks(rel):
            digest.update(chunk)
        if digest.hexdigest() != self.files[rel]:
            raise ArtifactError(f"{self.path}: {rel} is corrupted (sha256 differs from the manifest)")
        self._verified.add(rel)
        self._deferred.discard(rel)

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode("utf-8")

    def read_json(self, rel: str) -> Any:
        try:
            return json.loads(self.read_bytes(rel))
        except ValueError as err:
            raise ArtifactError(f"{self.path}: {rel} is not valid JSON: {err}") from None

    def load_tensors(self, rel: str, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Tensors of a safetensors file. Verified or deferred directory files are memory-mapped (a deferred one
        is the caller's to `check` before its tensors are used); else read and checked."""
        self._known(rel)
        try:
            if isinstance(self._source, _DirSource) and (rel in self._verified or rel in self._deferred):
                return safetensors.torch.load_file(str(self.path / rel), device=device)
            return {k: v.to(device) for k, v in safetensors.torch.load(self.read_bytes(rel)).items()}
        except (OSError, ValueError, RuntimeError, safetensors.SafetensorError) as err:
            raise ArtifactError(f"{self.path}: {rel} is not a valid safetensors file: {err}") from None

    @cached_property
    def plan(self) -> dict:
        return self.read_json("plan.json")

    @cached_property
    def schedule(self) -> dict:
        return self.read_json("schedule.json")

    @cached_property
    def report(self) -> dict:
        return self.read_json("report.json")


def read_artifact(path: str | os.PathLike, verify: bool = True, defer: tuple[str, ...] = ()) -> Artifact:
    """Open an artifact directory or `.k3c` archive.

    Checks: manifest.json parses; format_version is an int this runtime reads (FORMAT_VERSION); every file the
    manifest lists is present and no other file is; the required files are listed; with `verify`, every file's
    sha256 but those under the path prefixes `defer`, which the caller checks with `Artifact.check` (the session
    hashes its weight file while copying it to the device); without `verify`, each file is checked when read.
    Raises ArtifactError naming the artifact and the file.
    """
    p = Path(path)
    if p.is_dir():
        source: _DirSource | _TarSource = _DirSource(p)
    elif p.is_file():
        source = _TarSource(p)
    else:
        raise ArtifactError(f"{p}: no such artifact (expected a directory or a .k3c file)")
    names = source.names()
    if MANIFEST not in names:
        raise ArtifactError(f"{p}: missing {MANIFEST}")
    try:
        manifest = json.loads(b"".join(source.chunks(MANIFEST)))
    except ValueError as err:
        raise ArtifactError(f"{p}: {MANIFEST} is not valid JSON: {err}") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArtifactError(f"{p}: {MANIFEST} has no valid format_version (found {version!r})")
    if version > FORMAT_VERSION:
        raise ArtifactError(f"{p}: artifact format version {version} (written by k3c "
                            f"{manifest.get('k3c_version', '?')}) is newer than this runtime reads (format "
                            f"version {FORMAT_VERSION}, k3c {__version__}); upgrade k3c or recompile")
    if version < FORMAT_VERSION:
        raise ArtifactError(f"{p}: artifact format version {version} predates this runtime's (format version "
                            f"{FORMAT_VERSION}: {MANIFEST} checked against the hashed {BUILD}); recompile it")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ArtifactError(f"{p}: {MANIFEST} has no valid 'files' map")
    missing = sorted(set(files) - names)
    if missing:
        raise ArtifactError(f"{p}: missing file(s) listed in the manifest: {', '.join(missing)}")
    unlisted = sorted(names - set(files) - {MANIFEST})
    if unlisted:
        raise ArtifactError(f"{p}: file(s) not listed in the manifest: {', '.join(unlisted)}")
    absent = [f for f in REQUIRED_FILES if f not in files]
    if absent:
        raise ArtifactError(f"{p}: manifest lacks required file(s): {', '.join(absent)}")
    verified = set()
    deferred = {rel for rel in files if rel.startswith(defer)} if verify and defer else set()
    if verify:
        for rel in sorted(set(files) - deferred):
            digest = hashlib.sha256()
            for chunk in source.chunks(rel):
                digest.update(chunk)
            if digest.hexdigest() != files[rel]:
                raise ArtifactError(f"{p}: {rel} is corrupted (sha256 differs from the manifest)")
            verified.add(rel)
    art = Artifact(p, manifest, source, verified, deferred)
    _check_manifest_fields(p, manifest, art.read_json(BUILD))
    return art


def _first_difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first (dotted path, a's value, b's value) where JSON values `a` and `b` differ, keys in sorted order."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}.{key}", a.get(key, "<absent>"), b.get(key, "<absent>")
            diff = _first_difference(a[key], b[key], f"{path}.{key}")
            if diff:
                return diff
        return None
    if type(a) is not type(b) or a != b:  # 1 vs 1.0 vs True differ too
        return path, a, b
    return None


def _check_manifest_fields(p: Path, manifest: dict, hashed: Any) -> None:
    """Every manifest field but `files` must equal the hashed build.json's. Raises ArtifactError naming the first
    field that differs (e.g. `bounds.max_seq`), both values, and the fix."""
    if not isinstance(hashed, dict):
        raise ArtifactError(f"{p}: {BUILD} is not a JSON object")
    fields = {k: v for k, v in manifest.items() if k != "files"}
    diff = _first_difference(fields, hashed, "")
    if diff:
        field, found, want = diff
        raise ArtifactError(f"{p}: {MANIFEST} field {field[1:]} is {shown(found)} but the hashed {BUILD} records "
                            f"{shown(want)} (the manifest was edited); restore it or recompile")


def pack(src: str | os.PathLike, out: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Pack a verified artifact (directory or .k3c) into one deterministic tar `out` (default `<src>.k3c`).

    Entries: manifest.json, then files in sorted order; mode 0644, uid/gid 0, no user names, mtime 0; PAX
    format. Written to a temporary file and renamed in. Raises ArtifactError: src fails verification, or `out`
    exists and not `force`."""
    art = read_artifact(src)
    src_path = Path(src).resolve()      # "." or "art/..": the directory's own name
    dest = Path(out) if out is not None else src_path.with_name(src_path.name + ".k3c")
    if dest.exists() and not force:
        raise ArtifactError(f"{dest} already exists; pass force=True to replace it")
    with replacing(dest) as tmp, open(tmp, "wb") as f, \
            tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in [MANIFEST] + sorted(art.files):
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = art._source.size(rel), 0o644, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with art._source.open(rel) as data:
                tar.addfile(info, data)
    return dest

