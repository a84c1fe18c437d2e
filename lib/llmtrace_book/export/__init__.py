"""The forward pass exported to ONNX, for the page that runs it in the reader's browser.

`Model.forward` is handed a `GraphTrace` and exported by PyTorch's own exporter
(`torch.onnx.export(..., dynamo=True)`): every record of the trace becomes a graph output under
its trace name, in trace order, and the input `ids` [1, T] keeps T free. The graph is the
library's pass, traced, not a second implementation of it.

What the page loads, made once from the embedded model and kept in `$LLMTRACE_CACHE/web/<key>/`
(the key changes with the weights, the library's code and the exporter's versions):
- `model.onnx`, the page's form: the same graph with the GGUF's own blocks for weights (Q4_1 as
  MatMulNBits, the Q8_0 table as GatherBlockQuantized and an 8-bit MatMulNBits), 120 MB; its
  initializers live in one external file, `model.onnx.data`, stored here in chunks of at most
  50 MB (`model.onnx.data.000`, ...) that static hosts serve; the page checks each chunk's size
  and SHA-256, joins them and hands the whole buffer over as `model.onnx.data`;
- `model-fp32.onnx` and its chunks, the fp32 graph as exported (540 MB), kept beside it;
- `lens.onnx` (and `lens-fp32.onnx`): the logit lens, `lens.lens_grid` exported, which reads
  its two weights from the main graph's data file, so it runs on the same chunks;
- `decode.onnx` (and `decode-fp32.onnx`): one decode step, `Model.forward` of one token reading
  the layers' `KVCache` (inputs `past.{layer}.{k,v}`, the cache after the step among its
  outputs), its weights references into the main graph's data file too;
- `tokenizer.json` (the model's own) and `tokenizer_config.json` (BOS, EOS, whether BOS is added);
- `web.json` (and `web-fp32.json`), the page's manifest, written last: files, sizes, hashes, the
  records, the config, and how far onnxruntime's logits were from the trace's when it was made.

`python -m llmtrace_book.export [--out DIR]` makes them (or finds them made) and prints where they are.

The modules, each importing only the ones above it:
- `manifest`: the files' names, their entries (size, SHA-256), the chunks, `verify`, `session`;
- `pack`: the GGUF's Q4_1 and Q8_0 blocks repacked for onnxruntime (`quantize_graph`);
- `graph`: the ONNX export of the forward pass, the decode step and the logit lens;
- `web`: every file the page loads written and measured (`write_web`);
- `cache`: the export kept in the cache (`cache_key`, `web_dir`) and placed elsewhere (`place`);
- `cli`: the command (`main`), which `__main__` runs.
"""

from .manifest import (CHUNK_BYTES, FORMAT, FP32_GRAPH, FP32_MANIFEST, GRAPH, INPUT, LOGITS,
                       MANIFEST, TOKENIZER, TOKENIZER_CONFIG, _entry, listed_files, session,
                       session_options, sha256, split, verify)
from .pack import (BLOCK, LINEAR_RECORDS, QUANTIZED, _dequantized_4, q4_1_as_matmul_nbits,
                   q8_0_as_uint8, quantize_graph)
from .graph import (DECODE_GRAPH, FP32_DECODE_GRAPH, LENS_INPUT, LENS_OUTPUTS, PAST, PRESENT,
                    GraphTrace, check_exportable, decode_entry, export_decode, export_lens,
                    export_onnx, past_names, share_data)
from .web import (DECODE_STEPS, LOGIT_TOLERANCE, TOLERANCE_PROMPTS, config_for_page,
                  decode_difference, logit_difference, onnx_greedy, versions, write_tokenizer,
                  write_web)
from .cache import KEEP, cache_key, check_out, manifests, place, web_dir
from .cli import main
