"""llmtrace: a Llama forward pass that records the shape, dtype, cost and value of every
operation."""

from .config import Config
from .errors import LlmTraceError
from .generate import generate
from .lens import logit_lens
from .model import meta_model, trace_shapes
from .models import load_model
from .sampling import sample
from .trace import Trace

__all__ = ["Config", "LlmTraceError", "generate", "logit_lens", "meta_model", "trace_shapes",
           "load_model", "sample", "Trace"]
