"""`python -m llmtrace_book.export [--out DIR]`: the command, `cli.main`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
