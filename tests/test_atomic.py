"""`k3c.atomic.replacing`: an output file is replaced whole or not at all, under a short temporary name, keeping
the replaced file's permission bits and symbolic link; its errors name the file asked for, never the temporary."""

import os
import stat

import pytest

from k3c import termination
from k3c.atomic import name_max, replacing, temporary_sibling
from k3c.errors import K3CError


def test_the_file_is_replaced_only_when_the_writer_finished(tmp_path):
    out = tmp_path / "report.html"
    out.write_text("old page")
    with pytest.raises(K3CError, match="cannot write .*report.html: disk full"):
        with replacing(out) as tmp:
            tmp.write_text("half a pa")
            raise OSError("disk full")   # a write's ENOSPC names no file
    assert out.read_text() == "old page" and sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]
    with replacing(out) as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".html" and tmp.name.startswith(".report.tmp-")
        tmp.write_text("new page")
    assert out.read_text() == "new page" and sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


def test_a_swallowed_termination_keeps_the_old_file(tmp_path, monkeypatch):
    out = tmp_path / "graph.txt"
    out.write_text("old")
    monkeypatch.setattr(termination, "_requested", None)
    with pytest.raises(SystemExit) as exc:
        with replacing(out) as tmp:
            tmp.write_text("new")
            try:
                termination.request(15)
            except SystemExit:       # a library that catches everything
                pass
    assert exc.value.code == 143
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["graph.txt"]


def _names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_a_long_target_name_gets_a_short_temporary_name(tmp_path):
    """A name that fits the file system is written, however close to its limit: the temporary name keeps 32 bytes
    of it (whole characters), the suffix, and is at most 66 bytes. One that does not fit fails before the block
    runs, naming the target."""
    limit = name_max(tmp_path)
    for name in ["r" * (limit - 5) + ".html", "é" * ((limit - 4) // 2) + ".txt", "x" * limit]:
        out = tmp_path / name
        out.write_text("old")
        with replacing(out) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".") and tmp.name.endswith(out.suffix)
            assert len(os.fsencode(tmp.name)) <= 66 and tmp.name.startswith("." + out.stem[:16])
            tmp.write_text("new")
        assert out.read_text() == "new"
        out.unlink()
    assert _names(tmp_path) == []
    too_long = tmp_path / ("y" * (limit + 1))
    with pytest.raises(K3CError, match=f"cannot write {too_long}: its file name is {limit + 1} bytes long"):
        with replacing(too_long):
            raise AssertionError("the block must not run")
    odd = temporary_sibling(tmp_path / ("z" * 40 + "." + "s" * 40), "old", keep_suffix=True)
    assert odd.name.startswith("." + "z" * 32 + ".old-") and len(odd.name) == 1 + 32 + 5 + 12  # long suffix dropped


def test_errors_name_the_target_not_the_temporary(tmp_path):
    # no directory to write in: refused before the block, naming the target
    missing = tmp_path / "no-dir" / "out.txt"
    with pytest.raises(K3CError) as exc:
        with replacing(missing) as tmp:
            tmp.write_text("x")
    assert str(exc.value) == f"cannot write {missing}: {tmp_path / 'no-dir'} does not exist"
    # the final rename fails (a directory is in the way): the directory stays, no temporary file is left
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep").write_text("kept")
    with pytest.raises(K3CError) as exc:
        with replacing(tmp_path / "d") as tmp:
            tmp.write_text("x")
    assert str(exc.value).startswith(f"cannot write {tmp_path / 'd'}: ") and ".tmp-" not in str(exc.value)
    assert _names(tmp_path) == ["d"] and (tmp_path / "d" / "keep").read_text() == "kept"
    # an error about another file (a source the block reads) is the block's own: unchanged
    with pytest.raises(FileNotFoundError) as exc:
        with replacing(tmp_path / "out.txt") as tmp:
            tmp.write_text((tmp_path / "source.txt").read_text())
    assert exc.value.filename == str(tmp_path / "source.txt") and _names(tmp_path) == ["d"]


def test_the_replaced_file_keeps_its_mode(tmp_path):
    out = tmp_path / "tool.sh"
    out.write_text("old")
    os.chmod(out, 0o751)
    with replacing(out) as tmp:
        tmp.write_text("new")
    assert stat.S_IMODE(out.stat().st_mode) == 0o751 and out.read_text() == "new"
    umask = os.umask(0o022)
    os.umask(umask)
    with replacing(tmp_path / "new.txt") as tmp:   # a new file: the mode the writer created it with
        tmp.write_text("new")
    assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o666 & ~umask


def test_a_symlink_is_written_through(tmp_path):
    """The file the link resolves to is replaced (keeping its mode; the temporary beside it), the link stays."""
    (tmp_path / "data").mkdir()
    real = tmp_path / "data" / "real.txt"
    real.write_text("old")
    os.chmod(real, 0o600)
    link = tmp_path / "link.txt"
    link.symlink_to(os.path.join("data", "real.txt"))
    with replacing(link) as tmp:
        assert tmp.parent == real.parent
        tmp.write_text("new")
    assert link.is_symlink() and os.readlink(link) == os.path.join("data", "real.txt")
    assert real.read_text() == "new" and stat.S_IMODE(real.stat().st_mode) == 0o600
    assert _names(tmp_path) == ["data", "link.txt"] and _names(tmp_path / "data") == ["real.txt"]
    dangling = tmp_path / "later.txt"           # a link to a file not yet there creates it, as open() would
    dangling.symlink_to("data/made.txt")
    with replacing(dangling) as tmp:
        tmp.write_text("made")
    assert dangling.is_symlink() and (tmp_path / "data" / "made.txt").read_text() == "made"
    # a link whose target lies under a file, or in no directory: refused up front, naming the link, before any
    # work (it was a NotADirectoryError naming the temporary, after the whole report was built)
    for name, where, why in (("under.txt", "link.txt/x.txt", "is not a directory"),
                             ("nowhere.txt", "gone/x.txt", "does not exist")):
        (tmp_path / name).symlink_to(where)
        with pytest.raises(K3CError, match=f"^cannot write {tmp_path / name}: .* {why}$"):
            with replacing(tmp_path / name):
                raise AssertionError("the block must not run")
    assert _names(tmp_path) == ["data", "later.txt", "link.txt", "nowhere.txt", "under.txt"]


def test_a_termination_in_a_finalizer_is_kept_off_the_terminal(capsys, monkeypatch):
    """A request raised inside a finalizer (where Python prints "Exception ignored in" and drops it) is recorded,
    so the command still stops; the command line's hook prints nothing for it, and everything else as Python does."""
    import sys

    class Raises:
        def __init__(self, exc):
            self.exc = exc

        def __del__(self):
            raise self.exc

    monkeypatch.setattr(termination, "_requested", None)
    monkeypatch.setattr(sys, "unraisablehook", termination.quiet_unraisable)
    Raises(KeyboardInterrupt())                 # no request recorded: printed as Python prints it
    assert "KeyboardInterrupt" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        termination.interrupt(2)
    assert termination.requested() == 2
    Raises(KeyboardInterrupt())
    Raises(SystemExit(130))
    assert capsys.readouterr().err == ""
    Raises(ValueError("other"))
    assert "ValueError: other" in capsys.readouterr().err
