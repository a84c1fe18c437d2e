"""book.show_figure's output: what nbval compares is the one-line summary; the figure's HTML,
once sanitized as nbval does, is a fixed text; nothing in it names a network address; plotly.js
draws it in the book, JupyterLab from its own MIME type, print from the static image."""

import configparser
import re
from pathlib import Path

import pytest

from llmtrace_book import LlmTraceError

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.fixture(scope="module")
def book(monkeypatch_module):
    monkeypatch_module.syspath_prepend(str(NOTEBOOKS))
    import book

    return book


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def shown(book, monkeypatch, fig, summary, static=None):
    import IPython.display

    bundles = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: bundles.append(obj))
    book.show_figure(fig, summary, static)
    assert len(bundles) == 1
    return bundles[0]


def sanitize(text: str) -> str:
    """What nbval does with notebooks/sanitize.cfg."""
    cfg = configparser.ConfigParser()
    cfg.read(NOTEBOOKS / "sanitize.cfg")
    for section in cfg.sections():
        text = re.sub(cfg[section]["regex"], cfg[section]["replace"], text)
    return text


def heatmap(z, title="</script><!-- a title -->"):
    import plotly.graph_objects as go

    fig = go.Figure(go.Heatmap(z=z, x=["a", "b"], y=["c", "d"]))
    return fig.update_layout(title=title, xaxis_title="key", yaxis_title="query")


def test_the_bundle_has_the_summary_the_figure_and_its_json(book, monkeypatch):
    b = shown(book, monkeypatch, heatmap([[0.25, 0.5], [0.75, 1.0]]), "Two by two.")
    assert set(b) == {"text/plain", "text/html", book.PLOTLY_MIME}
    assert b["text/plain"] == "Two by two."
    assert b[book.PLOTLY_MIME]["data"][0]["type"] == "heatmap"
    assert b[book.PLOTLY_MIME]["config"]["responsive"] is True
    html = b["text/html"]
    assert 'class="llmtrace-plot"' in html and "_static/plotly.min.js" in html
    assert re.search(r'<img class="llmtrace-static" alt="Two by two." src="data:image/png;'
                     r'base64,iVBOR', html)
    assert not re.search(r"https?://", html)  # nothing to fetch from a network


def test_other_values_and_ids_sanitize_to_the_same_text(book, monkeypatch):
    """A figure whose numbers differ in their last digits (another CPU) and whose element id
    differs (another run) gives nbval the same HTML to compare; another summary does not."""
    one = shown(book, monkeypatch, heatmap([[0.25, 0.5], [0.75, 1.0]]), "Two by two.")
    two = shown(book, monkeypatch, heatmap([[0.2500001, 0.5], [0.75, 1.0]]), "Two by two.")
    assert one["text/html"] != two["text/html"]
    assert sanitize(one["text/html"]) == sanitize(two["text/html"])
    assert "FIGURE" in sanitize(one["text/html"]) and "0.25" not in sanitize(one["text/html"])
    other = shown(book, monkeypatch, heatmap([[0.25, 0.5], [0.75, 1.0]]), "Another summary.")
    assert sanitize(other["text/html"]) != sanitize(one["text/html"])


def test_the_figure_json_cannot_end_its_script(book, monkeypatch):
    html = shown(book, monkeypatch, heatmap([[1, 2], [3, 4]]), "x")["text/html"]
    script = html.split("<script>", 1)[1].rsplit("</script>", 1)[0]
    assert "</script" not in script and "<!--" not in script
    assert "\\u003c/script>" in script  # the title's "<", escaped inside the JSON


def test_a_matplotlib_figure_is_the_static_image(book, monkeypatch):
    import matplotlib.pyplot as plt

    m, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [1, 0])
    ax.set(xlabel="x", ylabel="y")
    html = shown(book, monkeypatch, heatmap([[1, 2], [3, 4]]), "x", static=m)["text/html"]
    assert "llmtrace-static" in html and not plt.fignum_exists(m.number)  # drawn, then closed


def test_nbval_does_not_compare_the_figure_json():
    import importlib.util

    spec = importlib.util.spec_from_file_location("notebooks_conftest", NOTEBOOKS / "conftest.py")
    notebooks_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(notebooks_conftest)

    class Notebook:
        skip_compare = ("metadata", "traceback")

    class Cell:
        parent = Notebook()

    notebooks_conftest.pytest_collection_modifyitems([Cell(), Cell()])
    assert Notebook.skip_compare == ("metadata", "traceback")  # the class is untouched
    assert Cell.parent.skip_compare == ("metadata", "traceback", "application/vnd.plotly.v1+json")


def test_an_axis_with_ticks_and_no_title_is_refused(book, monkeypatch):
    fig = heatmap([[0.1, 0.9], [0.5, 0.5]]).update_layout(yaxis_title=None)
    with pytest.raises(LlmTraceError, match="its yaxis has tick labels and no title"):
        shown(book, monkeypatch, fig, "two rows")


def test_small_ticks_are_refused(book, monkeypatch):
    fig = heatmap([[0.1, 0.9], [0.5, 0.5]]).update_xaxes(tickfont_size=7)
    with pytest.raises(LlmTraceError, match="the ticks of its xaxis are under 12 px"):
        shown(book, monkeypatch, fig, "two rows")
