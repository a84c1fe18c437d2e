"""The weights a config implies, by name and shape: each part of each layer says its own
(`parts.Part.tensors`), and the model its tables (`Model.tensors`). Loaders, converters and the
memory estimate read these two functions.
"""

from __future__ import annotations

from ..config import Config
from ..model import Model
from ..parts import layer_params


def expected_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    """Every weight's Hugging Face name, and the shape the config implies for it on disk."""
    return Model(c).expected_shapes()


def tensor_shapes(c: Config, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """The tables', and layer `layer`'s weights, by the fields the model computes with
    (`Weights`, `parts.LayerWeights`) -> shape."""
    model = Model(c)
    tables = {field: shape for field, (_, shape) in model.tensors().items()}
    return {**tables, **layer_params(model.blocks[layer])}
