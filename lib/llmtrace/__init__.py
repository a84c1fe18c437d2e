"""llmtrace: a Llama forward pass that records the shape, dtype, cost and value of every
operation."""

from .config import Config
from .errors import LlmTraceError
from .generate import Tracing, generate
from .lens import logit_lens
from .model import meta_model, trace_shapes
from .load import load_model
from .sampling import sample
from .trace import Patched, Trace

__all__ = ["Config", "LlmTraceError", "Tracing", "generate", "logit_lens", "meta_model",
           "trace_shapes", "load_model", "sample", "Patched", "Trace"]
