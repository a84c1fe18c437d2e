"""The walk, chapters 1 to 13, teaches one Llama: no visible cell names another family's switch
or the parts other families add (`llmtrace_book.mechanisms`). What another family changes lives in the
library, in cells whose code the page hides (the comparison with the trace goes through
`book.check_plain`), and in chapter 17."""

import re

import pytest

from test_chapters_any_model import NOTEBOOKS
from test_visible_cells import visible_cells

# the config's switches of other families, the trace names only they record, and the package
# of the parts they add to Llama's (`llmtrace_book.mechanisms`, which no Llama reads)
SWITCHES = ["norm_offset", "sandwich_norm", "qk_norm", "qkv_bias", "is_sliding", "embed_scale",
            "mlp_act", "attn_scale", "sliding_window", "layer_types", "rope_scaling",
            "rope_local_theta", "family", "embed.scaled", "post_norm", "q_norm", "k_norm",
            "gelu_tanh", "mechanisms"]
NAMED = re.compile(r"(?<!\w)(" + "|".join(re.escape(s) for s in SWITCHES) + r")\b")
WALK = [p for p in NOTEBOOKS if int(p.stem[:2]) <= 13]


def switches_named(code: str) -> list[str]:
    """The switches a cell's code names, comments left out."""
    return NAMED.findall(re.sub(r"#.*", "", code))


def test_the_walk_is_chapters_1_to_13():
    assert [p.stem[:2] for p in WALK] == [f"{n:02d}" for n in range(1, 14)]


@pytest.mark.parametrize("path", WALK, ids=[p.stem for p in WALK])
def test_no_visible_cell_names_another_family(path):
    named = {s for cell in visible_cells(path) for s in switches_named(cell.source)}
    assert not named, f"{path.name}: a visible cell names {sorted(named)}: hide it (book.py)"


def test_the_scan_sees_a_switch_and_skips_comments():
    assert switches_named("gain = 1 + w if c.norm_offset else w") == ["norm_offset"]
    assert switches_named('x = trace["embed.scaled"]') == ["embed.scaled"]
    assert switches_named("x = rms_norm(h)  # Gemma 3: sandwich_norm") == []
    assert switches_named("attn_scaled = 1") == []
    assert switches_named("from llmtrace_book.mechanisms.gemma import offset_rms_norm") == [
        "mechanisms"]
