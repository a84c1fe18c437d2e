"""nbval on the chapters: an interactive figure's JSON (`book.show_figure`) holds floats whose last
digits depend on the CPU's kernels, so it is not compared; the figure's one-line summary is."""

PLOTLY_MIME = "application/vnd.plotly.v1+json"


def pytest_collection_modifyitems(items):
    for item in items:
        notebook = item.parent  # nbval's IPyNbFile: its skip_compare lists what is not compared
        skip = getattr(notebook, "skip_compare", None)
        if isinstance(skip, tuple) and PLOTLY_MIME not in skip:
            notebook.skip_compare = skip + (PLOTLY_MIME,)
