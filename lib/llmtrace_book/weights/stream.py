"""Layers streamed from disk: a checkpoint larger than memory, run a layer at a time.

The tables (the embedding, the final norm, the LM head) are read once and stay, copied out of
the file's mapping (`weights.hf.read_copies`: a tensor that views the mapping would keep the whole
file mapped, and every page read through it resident, for as long as the model lives). Each
layer's weights are read when the pass reaches that layer, through safetensors' own memory
mapping (`weights.hf.read_tensors`: its tensors view the page cache, no copy), and let go when
the pass asks for the next: the model's `forward` walks `weights.layers` in order, so one layer
is resident at a time, its file mapping dropped with it.
The KV cache and the trace stay in memory as always. Every layer is read again on every pass
(a decode step too): streaming trades time for memory, and the operating system's page cache
is what makes the second pass faster than the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..parts import layer_on_disk, load_layer
from .hf import headers, read_config, read_copies, read_tensors, used


class StreamedLayers(Sequence):
    """Each layer's weights (`parts.LayerWeights`), read from disk when asked for: layers[i]
    reads layer i; iterating reads them one after another, holding none of them itself."""

    def __init__(self, blocks: list, where: dict[str, Path], dtype=None, device="cpu"):
        self.blocks, self.where = blocks, where  # where: Hugging Face name -> its file
        self.dtype, self.device = dtype, device

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"layer {i} of {len(self)}")
        i %= len(self)
        names = list(layer_on_disk(self.blocks[i], i))
        tensors = {}
        for f in dict.fromkeys(self.where[n] for n in names):  # a layer may span two shards
            tensors.update(read_tensors(f, [n for n in names if self.where[n] == f],
                                        self.dtype, self.device))
        return load_layer(self.blocks[i], tensors.__getitem__, i)

    def __iter__(self):
        """Each layer in turn, the one handed out before emptied first: a pass that walks the
        layers holds one at a time, though its loop still names the last (index one,
        layers[i], to keep it)."""
        last = None
        for i in range(len(self)):
            if last is not None:
                vars(last).clear()  # its tensors go, and the file mapping they viewed
            last = self[i]
            yield last


def stream_hf(directory: str | Path, name: str | None = None, dtype=None, device="cpu"):
    """(config, weights, tokenizer) of a Hugging Face directory whose layers are read as the
    pass reaches them: every tensor's shape is checked against the config from the headers
    alone, then the tables are read."""
    from ..model import Model, Weights
    from .hf import load_tokenizer

    d, config = read_config(directory, name)
    entries = headers(d)
    keep = used(entries, config, d)
    model = Model(config)
    model.check_shapes({k: tuple(entries[k][1]["shape"]) for k in keep}, str(d))
    where = {k: entries[k][0] for k in keep}
    tables = {field: read_copies(where[hf_name], [hf_name], dtype, device)[hf_name]
              for field, (hf_name, _) in model.tensors().items()}
    tables.setdefault("lm_head", tables["embed"])  # tied: the same tensor
    layers = StreamedLayers(model.blocks, where, dtype, device)
    return config, Weights(layers=layers, **tables), load_tokenizer(d, config)
