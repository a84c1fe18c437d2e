"""Where `python -m llmtrace_book.export` reads and writes: `--out` and the cache. Every path it
cannot use is refused in one line (exit status 2), and the cache, which holds the export, is
never touched by `--out`; a placement that fails half-way leaves nothing behind.

The export itself is not needed: a stand-in of a few bytes, under the key the command looks for,
holds the files `verify` and `place` read. Read-only directories are tested in a child process
without capabilities (`setpriv`): the tests run as root, and root writes anywhere."""

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import process_env
from llmtrace_book import export
from llmtrace_book.disk_cache import atomic_path, usable, write_manifest

KEY = "smollm2-135m-stand-in"
FILES = ["model.onnx", "model.onnx.data.000", "model.onnx.data.001", "tokenizer.json",
         "tokenizer_config.json"]


def stand_in(d: Path) -> Path:
    """A cached export of a few bytes in `d`: the files, web.json, and the cache's manifest."""
    d.mkdir(parents=True)
    entries = {}
    for name in FILES:
        (d / name).write_bytes(name.encode() * 10)
        entries[name] = export._entry(d / name)
    web = {"model": "stand-in", "weights": "fp32", "records": [], "graph": entries[FILES[0]],
           "chunks": [entries[FILES[1]], entries[FILES[2]]], "tokenizer": entries[FILES[3]],
           "tokenizer_config": entries[FILES[4]]}
    (d / "web.json").write_text(json.dumps(web))
    write_manifest(d)
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """$LLMTRACE_CACHE in tmp_path, holding the stand-in export under the key the command
    looks for. -> the export's directory."""
    monkeypatch.setenv("LLMTRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(export.cache, "cache_key", lambda: KEY)  # the name web_dir reads
    return stand_in(tmp_path / "cache" / "web" / KEY)


def command(capsys, *argv) -> tuple[int, str]:
    """The command run in this process: (exit status, stderr)."""
    status = export.main(list(argv))
    return status, capsys.readouterr().err


def refused(status: int, err: str, *words: str) -> None:
    assert status == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err


def intact(d: Path) -> None:
    """The cached export as it was made: every file, and the cache's manifest agrees."""
    assert usable(d) is None
    export.verify(d)
    assert sorted(f.name for f in d.iterdir()) == sorted(FILES + ["manifest.json", "web.json"])


def placed(out: Path) -> None:
    export.verify(out)
    assert sorted(f.name for f in out.iterdir()) == sorted(FILES + ["web.json"])


# --- --out and the cache ------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["the export", "the export, relative", "a link to the export",
                                   "inside the export", "the web directory", "the cache",
                                   "an older export", "above the cache"])
def test_out_never_touches_the_cache(cache, tmp_path, monkeypatch, capsys, where):
    """`--out` naming the cache's own export deleted it (the earlier export is replaced), then
    failed: any --out in the cache, or holding it, is refused before the export is looked up."""
    older = stand_in(cache.parent / "smollm2-135m-older")
    if where == "the export, relative":
        monkeypatch.chdir(cache.parent)
    if where == "a link to the export":
        (tmp_path / "link").symlink_to(cache)
    out = {"the export": cache, "the export, relative": Path(KEY),
           "a link to the export": tmp_path / "link", "inside the export": cache / "site",
           "the web directory": cache.parent, "the cache": cache.parents[1],
           "an older export": older, "above the cache": tmp_path}[where]
    refused(*command(capsys, "--out", str(out)), f"the cache {cache.parents[1]}, which keeps "
            "the export: choose a --out outside it")
    intact(cache)
    intact(older)
    assert not (cache / "site").exists()


# --- --out that cannot be made ------------------------------------------------------------------
@pytest.mark.parametrize("under", ["afile/web", "afile/site/web"])
def test_out_under_a_file_is_one_line(cache, tmp_path, capsys, under):
    (tmp_path / "afile").write_text("keep me")
    refused(*command(capsys, "--out", str(tmp_path / under)),
            f"{tmp_path / 'afile'} is a file, not a directory", "choose another --out")
    assert (tmp_path / "afile").read_text() == "keep me"
    intact(cache)


@pytest.mark.parametrize("what", ["a file", "a directory of other files"])
def test_out_that_holds_something_else_is_one_line(cache, tmp_path, capsys, what):
    mine = tmp_path / "mine"
    if what == "a file":
        mine.write_text("keep me")
    else:
        mine.mkdir()
        (mine / "notes.txt").write_text("keep me")
    refused(*command(capsys, "--out", str(mine)), "holds no export", "choose another --out")
    assert (mine if what == "a file" else mine / "notes.txt").read_text() == "keep me"


def test_an_empty_out_is_one_line(cache, tmp_path, monkeypatch, capsys):
    """`--out ""` is not the current directory (which Path("") would be)."""
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    refused(*command(capsys, "--out", ""), "--out is empty: name a directory")
    assert list((tmp_path / "empty").iterdir()) == []


def test_a_failure_half_way_leaves_nothing(cache, tmp_path, monkeypatch, capsys):
    """The disk fills at the third file: no half-written --out, no temporary, none of the
    directories the placement made."""
    done, copy = [], shutil.copyfile

    def full(src, dst, *args, **kwargs):
        if len(done) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        done.append(dst)
        copy(src, dst)
    monkeypatch.setattr(export.cache.os, "link", full)
    monkeypatch.setattr(export.cache.shutil, "copyfile", full)
    refused(*command(capsys, "--out", str(tmp_path / "site" / "_static" / "web")),
            "is full: free some space")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    intact(cache)


def test_relative_out_and_an_earlier_export_replaced(cache, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    status, _ = command(capsys, "--out", "site/web")
    assert status == 0
    placed(tmp_path / "site" / "web")
    (tmp_path / "site" / "web" / "model.onnx.data.009").write_text("from an earlier export")
    assert export.main(["--out", "site/web"]) == 0
    assert capsys.readouterr().out.endswith("; placed in site/web\n")
    placed(tmp_path / "site" / "web")  # the earlier export's extra chunk is gone
    assert [p.name for p in (tmp_path / "site").iterdir()] == ["web"]  # no temporary left
    assert (tmp_path / "site" / "web").stat().st_mode & 0o777 == 0o755  # a static host reads it
    intact(cache)


# --- the cache ----------------------------------------------------------------------------------
def test_a_web_directory_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLMTRACE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "web").write_text("")
    refused(*command(capsys), f"{tmp_path / 'cache' / 'web'} is a file, not a directory",
            "move it away")


def test_a_read_only_cache_that_holds_the_export_serves_it(cache, tmp_path, monkeypatch,
                                                           capsys):
    """Read-only is refused only where something must be made: the export found is used."""
    def no_write(d, need_bytes=0):
        raise AssertionError(f"{d} was to be written")
    monkeypatch.setattr("llmtrace_book.disk_cache.check_writable", no_write)
    assert export.main(["--out", str(tmp_path / "site")]) == 0
    placed(tmp_path / "site")


def test_a_file_where_a_directory_goes_is_replaced(tmp_path):
    """atomic_path(directory=True) over a file (a cache entry damaged so) puts the directory in
    its place, as it does over a directory."""
    final = tmp_path / "entry"
    final.write_text("")
    with atomic_path(final, directory=True) as tmp:
        (tmp / "a").write_text("a")
    assert (final / "a").read_text() == "a"


# --- read-only directories: a child process without capabilities ------------------------------
SETPRIV = shutil.which("setpriv")


def without_capabilities(*argv: str, **env) -> subprocess.CompletedProcess:
    """`python -m llmtrace_book.export` in a process that has no capability: as root it still owns
    root's files, but permission bits bind it (no CAP_DAC_OVERRIDE)."""
    if SETPRIV is None:
        pytest.skip("setpriv (util-linux) is not installed: a read-only directory cannot be "
                    "tested as root without it")
    return subprocess.run([SETPRIV, "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all",
                           "--", sys.executable, "-m", "llmtrace_book.export", *argv],
                          capture_output=True, text=True, env=process_env(**env), timeout=120)


def read_only(d: Path) -> Path:
    """An empty directory nothing can be written in (once capabilities are dropped)."""
    d.mkdir(mode=0o555)
    return d


def test_a_read_only_cache_is_one_line(tmp_path):
    """The README: a cache that is read-only is refused before anything is parsed, in one
    line; an OSError's traceback was printed."""
    cache = read_only(tmp_path / "cache")
    run = without_capabilities(LLMTRACE_CACHE=str(cache))
    refused(run.returncode, run.stderr, f"cannot write in the cache {cache}",
            "Permission denied", "set LLMTRACE_CACHE to a writable directory")
    assert list(cache.iterdir()) == []


def test_out_in_a_read_only_directory_is_one_line(tmp_path):
    """Refused before the export is looked up (the cache here is empty and read-only too: the
    --out line comes first)."""
    cache, site = read_only(tmp_path / "cache"), read_only(tmp_path / "site")
    run = without_capabilities("--out", str(site / "_static" / "web"), LLMTRACE_CACHE=str(cache))
    refused(run.returncode, run.stderr, f"cannot write in {site}",
            "choose a --out in a directory you can write")
    assert list(site.iterdir()) == []
