"""`k3c.atomic.replacing`: an output file is replaced whole or not at all."""

import pytest

from k3c import termination
from k3c.atomic import replacing


def test_the_file_is_replaced_only_when_the_writer_finished(tmp_path):
    out = tmp_path / "report.html"
    out.write_text("old page")
    with pytest.raises(OSError, match="disk full"):
        with replacing(out) as tmp:
            tmp.write_text("half a pa")
            raise OSError("disk full")
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
