"""llmtrace: a Llama forward pass that records the shape, dtype, cost and value of every
operation."""

# The one place that names the version: the wheel's metadata (lib/pyproject.toml), `llmtrace-book
# --version` and the book's footer (book/build_config.py) read it from this line
__version__ = "0.1.0"

from .config import Config
from .errors import LlmTraceError
from .generate import Tracing, generate
from .lens import logit_lens
from .model import meta_model, trace_shapes
from .load import load_model
from .sampling import sample
from .trace import Patched, Trace
from . import families  # noqa: F401  (each family registers its Model and its HF config mapping)
from .weights import gguf  # noqa: F401  (registers Config.from_gguf)

__all__ = ["Config", "LlmTraceError", "Tracing", "generate", "logit_lens", "meta_model",
           "trace_shapes", "load_model", "sample", "Patched", "Trace"]
