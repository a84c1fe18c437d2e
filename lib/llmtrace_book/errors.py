"""The one error type the library raises for bad input: its message is a single line that says
what was wrong and how to fix it. The CLI prints it without a traceback."""

import json
from pathlib import Path


class LlmTraceError(ValueError):
    pass


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, to quote inside a one-line error."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def read_json(path: Path, what: str):
    """A JSON file's content, or one line saying why it cannot be read."""
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LlmTraceError(f"{path} is not valid JSON ({e}): it should be {what}; "
                            f"download or write it again") from None
    except OSError as e:
        raise LlmTraceError(f"cannot read {path} ({e.strerror or e})") from None
