"""Generated files (the fp32 embedded model, TinyLlama's tokenizer.model) live in the project's .cache,
for the tests and for the notebook kernels nbval starts (they inherit this environment)."""

import os
from pathlib import Path

os.environ.setdefault("LLMTRACE_CACHE", str(Path(__file__).resolve().parent / ".cache"))
