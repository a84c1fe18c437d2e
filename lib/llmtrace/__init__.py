"""llmtrace: a Llama forward pass that records the shape, dtype, cost and value of every operation."""

from .config import PRESETS, Config
from .errors import LlmTraceError
from .generate import Generation, decode_one_token, generate, prefill
from .kv_cache import KVCache
from .model import Model, meta_model
from .models import load_model
from .sampling import sample
from .trace import NO_TRACE, Record, Trace

__all__ = ["Config", "PRESETS", "LlmTraceError", "Generation", "generate", "prefill", "decode_one_token",
           "KVCache", "Model", "meta_model", "load_model", "sample", "Trace", "Record", "NO_TRACE"]
