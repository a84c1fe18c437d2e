"""python -m llmtrace_book --lens: the logit-lens grid as text and in --json, run in-process."""

import json

from llmtrace_book.__main__ import main
from helpers import PROMPT



def test_lens_grid_as_text(capsys):
    assert main(["--model", "embedded", "--lens", "--max-new-tokens", "1", PROMPT]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layer "))
    assert lines[header].split() == ["layer", "'The'", "'", "capital'", "'", "of'", "'", "France'",
                                     "'", "is'", "p('", "Paris')"]
    rows = lines[header + 1: header + 31]
    assert [r.split()[0] for r in rows] == [str(i) for i in range(30)]
    assert rows[-1].endswith("' Paris'    0.7725")  # the last layer's lens is the model's output
    assert rows[0].endswith("0.0000")
    assert "layers.0.attn.scores" not in out  # the grid replaces the data-flow table
    assert all(len(line) <= 100 for line in lines[header:header + 31])


def test_lens_in_json(capsys):
    assert main(["--model", "embedded", "--lens", "--json", "--max-new-tokens", "1", PROMPT]) == 0
    out = json.loads(capsys.readouterr().out)
    lens = out["lens"]
    assert lens["greedy_id"] == 7042 and lens["greedy_piece"] == " Paris"
    assert len(lens["top_ids"]) == 30 and all(len(row) == 5 for row in lens["top_ids"])
    assert lens["top_ids"][-1][-1] == 7042 and lens["top_pieces"][-1][-1] == " Paris"
    assert lens["top_probs"][-1][-1] == lens["greedy_probs"][-1]
    assert abs(lens["greedy_probs"][-1] - out["top10"][0]["prob"]) < 1e-4  # the model's own p
    assert lens["greedy_probs"][:20] == [0.0] * 20  # readable only in the last layers
    assert out["generated_ids"] == [7042]


def test_lens_refuses_shapes_only(capsys):
    assert main(["--lens", "--shapes-only", PROMPT]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("error: --lens needs values and --shapes-only has none: "
                           "drop one of the two")


def test_lens_ends_on_the_greedy_token_for_every_kind_of_layer(capsys, tmp_path):
    """Gemma 4 adds a per-layer input and a layer scalar after resid_out, and soft-caps the
    logits: the lens reads all of it, so its last layer's top token is the one generated."""
    from tiny_checkpoint import make_tiny_checkpoint

    d = make_tiny_checkpoint(tmp_path / "tiny-gemma4", family="gemma4_text")
    assert main(["--model", str(d), "--lens", "--json", "--max-new-tokens", "1", PROMPT]) == 0
    out = json.loads(capsys.readouterr().out)
    lens = out["lens"]
    assert lens["top_ids"][-1][-1] == lens["greedy_id"] == out["generated_ids"][0]
    assert abs(lens["greedy_probs"][-1] - out["top10"][0]["prob"]) < 1e-4
