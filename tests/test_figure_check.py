"""The book's rule for figures, checked on every matplotlib figure a chapter shows
(`book.check_figure`, through `plt.show` and `show_figure`): within the column, no text under 9
pt, every axis with tick labels titled, a colour bar where colour carries a value. The chapters'
runs (nbval, and the runs on tiny checkpoints) execute it on every figure; here the check itself
is held to what it must find."""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
import book  # noqa: E402

from llmtrace_book import LlmTraceError  # noqa: E402


@pytest.fixture(autouse=True)
def style():
    """The book's style and checked plt.show for one test, the process's own restored after."""
    show = plt.show
    with matplotlib.rc_context():
        book.use_book_style()
        yield
    plt.close("all")
    plt.show = show


def good():
    fig, ax = plt.subplots(figsize=(book.COLUMN_INCHES, 3))
    ax.plot([0, 1, 2], [1, 3, 2])
    ax.set_xlabel("layer")
    ax.set_ylabel("RMS")
    ax.set_title("a line")
    return fig


def test_a_figure_that_follows_the_rule_passes():
    assert book.figure_problems(good()) == []
    book.check_figure(good())


def test_too_wide():
    fig = good()
    fig.set_size_inches(12, 3)
    assert book.figure_problems(fig) == ["12.0 in wide (the column is 8.2)"]


def test_small_text():
    fig = good()
    fig.axes[0].tick_params(labelsize=7)
    (problem,) = book.figure_problems(fig)
    assert problem.startswith("text under 9 pt: 7 pt ")


def test_an_untitled_axis():
    fig = good()
    fig.axes[0].set_ylabel("")
    assert book.figure_problems(fig) == ["the y axis of 'a line' has no title"]


def test_an_axis_without_ticks_needs_no_title():
    fig = good()
    ax = fig.axes[0]
    ax.set_ylabel("")
    ax.set_yticks([])
    assert book.figure_problems(fig) == []


def test_colour_needs_a_colour_bar():
    fig, ax = plt.subplots(figsize=(6, 4))
    im = ax.imshow(np.eye(3))
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    assert book.figure_problems(fig) == ["'a plot' carries values in colour and has no colour bar"]
    fig.colorbar(im, ax=ax, label="weight")
    assert book.figure_problems(fig) == []


def test_show_raises_on_a_figure_that_breaks_the_rule():
    fig = good()
    fig.set_size_inches(11, 3)
    with pytest.raises(LlmTraceError, match="a figure does not fit the book: 11.0 in wide"):
        plt.show()


def test_an_rgb_image_needs_no_colour_bar():
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.imshow(np.zeros((3, 4, 3)))  # colours as they are: written, read, empty
    ax.set_xlabel("position")
    ax.set_ylabel("head")
    assert book.figure_problems(fig) == []
