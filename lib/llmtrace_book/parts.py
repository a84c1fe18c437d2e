"""What every part of a layer says of its weights, and the loops that read a layer by its parts.

A part (an attention, an MLP, a norm, the block that holds them) names the weights it reads in
`tensors`: each one's field in the layer's weights (`w.q_proj`), its Hugging Face name after
"model.layers.N.", and the shape its config implies. Loading a checkpoint, saving one, checking
its shapes and counting parameters are each one loop over a layer's parts (`walk`); no list of
families is kept anywhere. A part that holds its weights otherwise (experts stacked from one
tensor per expert, latent attention's in an object of their own) says so in `load`, `save` and
`on_disk`.
"""

from __future__ import annotations

from types import SimpleNamespace


class Part:
    """A part of a layer. Its weights: `tensors`; the parts inside it, in model order, `parts`
    (its own weights come after theirs)."""

    def tensors(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """field -> (Hugging Face name after "model.layers.N.", shape): the weights it reads."""
        return {}

    def parts(self) -> tuple:
        return ()

    def on_disk(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face name after "model.layers.N." -> the shape stored under it."""
        return {name: shape for name, shape in self.tensors().values()}

    def load(self, get, prefix: str) -> dict:
        """Its fields of the layer's weights; get(name) -> tensor, prefix "model.layers.3"."""
        return {field: get(f"{prefix}.{name}") for field, (name, _) in self.tensors().items()}

    def save(self, w, prefix: str) -> dict:
        """The inverse: Hugging Face name -> tensor, from the layer's weights w."""
        return {f"{prefix}.{name}": getattr(w, field)
                for field, (name, _) in self.tensors().items()}


class Norm(Part):
    """A norm's weight [D], under its name: the block's norms are parts of it."""

    def __init__(self, field: str, name: str, size: int):
        self.field, self.name, self.size = field, name, size

    def tensors(self):
        return {self.field: (self.name, (self.size,))}


class LayerWeights(SimpleNamespace):
    """One layer's weights, by the fields its parts read (w.q_proj, w.gate, ...). A weight no
    part of this layer reads is None (w.q_bias of a Llama), as code written for several
    families asks."""

    def __getattr__(self, name: str):  # only for a name not set
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def replace(self, **changes) -> "LayerWeights":
        """A copy with these fields changed."""
        return LayerWeights(**{**vars(self), **changes})


def walk(part):
    """Each part inside it, in model order, then the part itself."""
    for p in part.parts():
        yield from walk(p)
    yield part


def layer_params(block) -> dict[str, tuple[int, ...]]:
    """field -> shape of every weight the layer's parts compute with."""
    return {f: shape for p in walk(block) for f, (_, shape) in p.tensors().items()}


def layer_on_disk(block, layer: int) -> dict[str, tuple[int, ...]]:
    """Every weight of layer `layer` by its full Hugging Face name, and the shape stored."""
    return {f"model.layers.{layer}.{name}": shape for p in walk(block)
            for name, shape in p.on_disk().items()}


def load_layer(block, get, layer: int) -> LayerWeights:
    """Layer `layer`'s weights from get(Hugging Face name) -> tensor."""
    fields = {}
    for p in walk(block):
        fields.update(p.load(get, f"model.layers.{layer}"))
    return LayerWeights(**fields)


def save_layer(block, w, layer: int) -> dict:
    """The inverse: every weight of the layer under its Hugging Face name."""
    out = {}
    for p in walk(block):
        out.update(p.save(w, f"model.layers.{layer}"))
    return out
