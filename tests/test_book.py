"""The built book, as a reader's browser shows it: headless Chromium (Debian's) loads every page
once at a 1280x800 window, driven over the DevTools protocol, and the tests check what it saw:
nothing loaded from the network, no code block or output that scrolls sideways, an interactive
figure that answers the mouse, formulas typeset, the map and the TinyLlama card in place."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from browser import HEIGHT, WIDTH, Browser, network

HTML = Path(__file__).resolve().parents[1] / "_build" / "html"

# <pre> blocks on the page that scroll sideways: what their first line says, and by how much
OVERFLOW_JS = """Array.from(document.querySelectorAll('pre'))
  .filter(p => p.offsetParent !== null && p.scrollWidth > p.clientWidth + 1)
  .map(p => (p.scrollWidth - p.clientWidth) + ' px: ' + p.textContent.trim().split('\\n')[0])"""


@pytest.fixture(scope="module")
def built():
    assert (HTML / "notebooks" / "01_model.html").is_file(), \
        f"no built book in {HTML}: run `make book`"
    return HTML


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


KEEP_DOM = {"index.html", "notebooks/04_rmsnorm.html", "notebooks/06_rope.html",
            "notebooks/05_attention.html"}  # the pages whose content the tests below read


def figure_pages(built: Path) -> list[str]:
    """The chapters that carry an interactive figure (book.show_figure), those whose figures have
    a control (a slider or a dropdown) first."""
    pages = {p.relative_to(built).as_posix(): p.read_text(errors="replace")
             for p in sorted(built.glob("notebooks/*.html"))}
    with_figure = [name for name, text in pages.items() if "llmtrace-plot" in text]
    return sorted(with_figure, key=lambda name: not re.search(r'"(sliders|updatemenus)":',
                                                                pages[name]))


@pytest.fixture(scope="module")
def pages(built, browser):
    """Every page of the book, loaded once: the requests it made, its <pre> blocks that scroll
    sideways, and for a few its DOM. The first page with an interactive figure comes last, so
    that the figure's test drives it where it stands."""
    names = [p.relative_to(built).as_posix() for d in ("", "book/", "notebooks/")
             for p in sorted(built.glob(d + "*.html"))]
    first_figure = (figure_pages(built) or [None])[0]
    names = [n for n in names if n != first_figure] + [first_figure] * bool(first_figure)
    seen = {}
    for name in names:
        urls = browser.goto((built / name).as_uri())
        if name == "index.html":  # it sends the reader on to the intro: wait for that page
            browser.wait_until("location.href.endsWith('book/intro.html') && "
                               "document.readyState === 'complete'")
            urls = browser.requests()
        seen[name] = {"requests": urls, "overflow": browser.js(OVERFLOW_JS)}
        if name in KEEP_DOM:
            seen[name]["dom"] = browser.js("document.documentElement.outerHTML")
    return seen


def test_the_network_check_sees_a_request(browser):
    """The check below can fail: a page that asks a remote host for an image is caught."""
    page = "data:text/html,<img src='http://192.0.2.1/x.png'><p>x</p>"
    assert network(browser.goto(page)) == ["http://192.0.2.1/x.png"]


def test_no_page_loads_anything_from_the_network(pages):
    remote = {name: network(p["requests"]) for name, p in pages.items()}
    assert not any(remote.values()), {k: v for k, v in remote.items() if v}
    assert len(pages) >= 18  # the chapters, the reference pages, the index


def test_no_code_or_output_scrolls_sideways_at_1280px(pages):
    wide = {name: p["overflow"] for name, p in pages.items() if p["overflow"]}
    assert not wide, wide


def test_an_interactive_figure_answers_hover_and_its_control(built, pages, browser):
    """A chapter page with an interactive figure (book.show_figure), one with a control if any:
    plotly.js, the book's own copy, draws it; the mouse over the plot shows a hover label with a
    value; the figure's slider, dropdown or buttons change what the plot shows."""
    with_figure = figure_pages(built)
    assert with_figure, "no page carries an interactive figure (book.show_figure)"
    url = (built / with_figure[0]).as_uri()
    if browser.js("location.href") != url:  # `pages` left it there, unless run on its own
        browser.goto(url)
    live = browser.js("""new Promise(done => { let n = 0; const t = setInterval(() => {
        const f = document.querySelector('.llmtrace-figure.llmtrace-live');
        if (f || ++n > 100) { clearInterval(t); done(!!f); } }, 100); })""")
    assert live, f"{with_figure[0]}: plotly.js did not draw the figure"
    # the figure with a control if there is one, else the first; scrolled into the window
    box = browser.js("""(() => {
        const figs = Array.from(document.querySelectorAll('.llmtrace-plot'));
        const el = figs.find(f => f.querySelector('.slider-container, .updatemenu-container'))
                   || figs[0];
        window.under_test = el;
        // a tall figure may not fit the window: bring what the mouse will touch into it
        window.centre = (node, dx) => {
            // instant: the theme scrolls smoothly, and the mouse must find it in place
            node.scrollIntoView({block: 'center', behavior: 'instant'});
            const r = node.getBoundingClientRect();
            return [dx === undefined ? r.x + r.width / 2 : r.x + r.width + dx, r.y + r.height / 2];
        };
        return window.centre(el.querySelector('.nsewdrag'));
    })()""")
    browser.mouse("mouseMoved", *box)
    hover = browser.js("""new Promise(done => setTimeout(() => done(
        (window.under_test.querySelector('.hoverlayer') || {}).textContent || ''), 500))""")
    assert re.search(r"\d", hover), f"no hover label with a value: {hover!r}"
    browser.mouse("mouseMoved", 2, 2)

    shown = "window.under_test.querySelector('.cartesianlayer').innerHTML"
    before = browser.js(shown)
    control = browser.js("""(() => {
        const el = window.under_test;
        const rail = el.querySelector('.slider-rail-rect');
        if (rail) return ['slider', ...window.centre(rail, -3)];  // its last step
        const head = el.querySelector('.updatemenu-header');  // a dropdown
        const buttons = el.querySelectorAll('.updatemenu-button');  // a row of buttons
        const pick = head || buttons[buttons.length - 1];
        if (!pick) return null;
        return [head ? 'dropdown' : 'button', ...window.centre(pick)];
    })()""")
    if control is None:  # no figure of the book has a control: the hover has answered
        return
    kind, x, y = control
    browser.mouse("mousePressed", x, y)
    browser.mouse("mouseReleased", x, y)
    if kind == "dropdown":  # it opens: pick its last entry
        pick = browser.js("""new Promise(done => setTimeout(() => {
            const b = window.under_test.querySelectorAll('.updatemenu-dropdown-button');
            done(window.centre(b[b.length - 1]));
        }, 300))""")
        browser.mouse("mousePressed", *pick)
        browser.mouse("mouseReleased", *pick)
    after = browser.js(f"new Promise(done => setTimeout(() => done({shown}), 800))")
    assert after != before, f"the figure's {kind} did not change what the plot shows"


def test_a_printed_page_shows_the_figures_static_image(built, pages, browser):
    """On paper the interactive figure gives way to its static image (book.show_figure)."""
    with_figure = figure_pages(built)
    assert with_figure, "no page carries an interactive figure (book.show_figure)"
    url = (built / with_figure[0]).as_uri()
    if browser.js("location.href") != url:
        browser.goto(url)
    shown = """Array.from(document.querySelectorAll('.llmtrace-figure')).map(f => [
        getComputedStyle(f.querySelector('.llmtrace-plot')).display,
        (f.querySelector('img.llmtrace-static') || {naturalWidth: 0}).naturalWidth > 0 &&
        getComputedStyle(f.querySelector('img.llmtrace-static')).display])"""
    browser.call("Emulation.setEmulatedMedia", session=True, media="print")
    try:
        printed = browser.js(shown)
    finally:
        browser.call("Emulation.setEmulatedMedia", session=True, media="")
    assert printed and all(plot == "none" and img == "block" for plot, img in printed), printed
    on_screen = browser.js(shown)
    assert any(plot != "none" and img == "none" for plot, img in on_screen), on_screen


def test_every_link_between_pages_resolves(built):
    """Every relative link and source of every page (the sidebar, the chapters' links to each
    other, the figures) names a file of the built book: a renamed chapter leaves no dead link."""
    dead = []
    for page in sorted(built.glob("**/*.html")):
        if page.relative_to(built).parts[0] in ("_static", "_sources"):
            continue
        for ref in re.findall(r'(?:href|src)="([^"]+)"', page.read_text(errors="replace")):
            target = ref.split("#")[0].split("?")[0]
            if not target or re.match(r"[a-z]+:|//", target):
                continue  # a fragment of the page itself, or another site
            if not (page.parent / target).exists():
                dead.append(f"{page.relative_to(built)} -> {ref}")
    assert not dead, f"{len(dead)} links name no file, the first: {dead[:5]}"


def test_index_redirects_to_the_intro(pages):
    dom = pages["index.html"]["dom"]  # what the browser shows once index.html has redirected
    assert "The capital of France is" in dom and "TinyLlama-1.1B" in dom


def test_chapter_renders_title_table_and_figure(pages):
    dom = pages["notebooks/05_attention.html"]["dom"]
    assert "<title>5. Attention" in dom
    assert "Values" in dom and "which model runs" in dom  # the one-line banner
    assert "layers.0.attn.scores" in dom and "[1, 32, 6, 6]" in dom  # TinyLlama's shape table
    assert '<img alt="_images/' in dom or 'src="../_images/' in dom  # a figure from the trace
    # no error output (the library's source on the page may name LlmTraceError)
    assert "Traceback (most recent call last)" not in dom and "output stderr" not in dom


def test_the_map_renders_with_the_stage_lit(built, pages):
    """Each stage chapter shows the map of the machine, drawn from a trace, as a vector image
    (SVG) with its own stage lit: here RoPE's records."""
    dom = pages["notebooks/06_rope.html"]["dom"]
    images = re.findall(r'<img[^>]* src="\.\./(_images/[0-9a-f]+\.svg)"', dom)
    maps = [t for t in ((built / i).read_text() for i in images) if "RoPE" in t or "rope_q" in t]
    assert len(maps) == 1, f"no map among the page's SVG images: {images}"
    assert maps[0].count('fill="#ffd54f"') >= 2  # RoPE, and the blocks in the whole pass


def test_formulas_are_typeset_offline(pages):
    dom = pages["notebooks/04_rmsnorm.html"]["dom"]
    assert "_static/mathjax/tex-chtml.js" in dom  # the local copy, not a CDN
    assert "<mjx-container" in dom  # MathJax ran and typeset the formula
    assert "\\frac{x}" not in dom.split("<mjx-container", 1)[1]  # no raw TeX left in the page


def test_screenshot_artifact(built, browser):
    shot = built.parent / "screenshot-attention.png"
    browser.call("Emulation.setDeviceMetricsOverride", session=True, width=WIDTH, height=2400,
                 deviceScaleFactor=1, mobile=False)
    try:
        browser.goto((built / "notebooks" / "05_attention.html").as_uri())
        png = browser.call("Page.captureScreenshot", session=True, format="png")["data"]
    finally:
        browser.call("Emulation.setDeviceMetricsOverride", session=True, width=WIDTH,
                     height=HEIGHT, deviceScaleFactor=1, mobile=False)
    import base64

    shot.write_bytes(base64.b64decode(png))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
