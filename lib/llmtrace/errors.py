"""The one error type the library raises for bad input: its message is a single line that says
what was wrong and how to fix it. The CLI prints it without a traceback."""


class LlmTraceError(ValueError):
    pass
