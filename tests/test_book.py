"""The built book, as a reader's browser shows it: headless Chromium renders the pages."""

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

HTML = Path(__file__).resolve().parents[1] / "_build" / "html"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=15000"]


def chromium(*args) -> str:
    exe = shutil.which("chromium")
    assert exe, "Chromium is not installed: run `make browser` (Debian's chromium package)"
    with tempfile.TemporaryDirectory() as profile:
        r = subprocess.run([exe, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                           timeout=180)
    assert r.returncode == 0, r.stderr[-500:]
    return r.stdout


@pytest.fixture(scope="module")
def built():
    assert (HTML / "notebooks" / "01_model.html").is_file(), f"no built book in {HTML}: run `make book`"
    return HTML


@pytest.fixture(scope="module")
def attention_dom(built):
    return chromium("--dump-dom", (built / "notebooks" / "06_attention.html").as_uri())


def test_index_redirects_to_the_intro(built):
    dom = chromium("--dump-dom", (built / "index.html").as_uri())
    assert "The capital of France is" in dom and "TinyLlama-1.1B" in dom


def test_chapter_renders_title_table_and_figure(attention_dom):
    dom = attention_dom
    assert "<title>6. Attention" in dom
    assert "Values:" in dom and "which model runs" in dom  # the one-line banner
    assert "layers.0.attn.scores" in dom and "[1, 32, 6, 6]" in dom  # TinyLlama's shape table
    assert '<img alt="_images/' in dom or 'src="../_images/' in dom  # a figure from the trace
    # no error output (the library's source on the page may name LlmTraceError)
    assert "Traceback (most recent call last)" not in dom and "output stderr" not in dom


def test_the_map_renders_with_the_stage_lit(built):
    """Each stage chapter shows the map of the machine, drawn from TinyLlama's trace, as a vector
    image (SVG) with its own stage lit: here RoPE's two records, with TinyLlama's shapes on the
    edges."""
    import re

    dom = chromium("--dump-dom", (built / "notebooks" / "05_rope.html").as_uri())
    images = re.findall(r'<img[^>]* src="\.\./(_images/[0-9a-f]+\.svg)"', dom)
    maps = [t for t in ((built / i).read_text() for i in images) if "attn.rope_q" in t]
    assert len(maps) == 1, f"no map among the page's SVG images: {images}"
    svg = maps[0]
    assert "[1, 6, 32, 64]" in svg and "22 blocks" in svg
    assert svg.count('fill="#ffd54f"') >= 3  # rope_q, rope_k, and the blocks in the whole pass


def test_formulas_are_typeset_offline(built):
    dom = chromium("--dump-dom", (built / "notebooks" / "04_rmsnorm.html").as_uri())
    assert "_static/mathjax/tex-chtml.js" in dom  # the local copy, not a CDN
    assert "<mjx-container" in dom  # MathJax ran and typeset the formula
    assert "\\frac{x}" not in dom.split("<mjx-container", 1)[1]  # no raw TeX left in the page


def test_screenshot_artifact(built):
    shot = built.parent / "screenshot-attention.png"
    chromium(f"--screenshot={shot}", "--window-size=1280,2400", (built / "notebooks" / "06_attention.html").as_uri())
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
