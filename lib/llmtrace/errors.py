"""The one error type the library raises for bad input: its message is a single line that says
what was wrong and how to fix it. The CLI prints it without a traceback."""


class LlmTraceError(ValueError):
    pass


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, to quote inside a one-line error."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
