"""The float8 benchmarks' models (JAX scripts): MLP blocks and the reference Transformer, and
how each stack turns the Transformer's matmuls to float8.

`benchmarks/float8_mlp.py` times the MLP blocks, `benchmarks/gpu_check.py` the Transformer;
`benchmarks/float8_census.py` compiles both for a GPU target. No flags here: each script
defines its own.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

FLOAT8_MANIFEST = "configs/manifests/python_source_transformer_float8.json"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class MlpShape:
    """Two-layer MLP blocks (`width` -> 4 x `width` -> `width`, residual) on a batch of
    `sequences` x `tokens` vectors."""

    width: int
    blocks: int
    sequences: int
    tokens: int


MLP_REFERENCE = MlpShape(width=4096, blocks=2, sequences=8, tokens=1024)
MLP_SMALL = MlpShape(width=32, blocks=1, sequences=2, tokens=8)


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """The Transformer and its batch."""

    width: int
    heads: int
    blocks: int
    tokens: int
    batch: int
    vocabulary: int


TRANSFORMER_REFERENCE = TransformerShape(
    width=768, heads=12, blocks=6, tokens=512, batch=16, vocabulary=32768
)
TRANSFORMER_SMALL = TransformerShape(width=32, heads=2, blocks=1, tokens=16, batch=4, vocabulary=64)


def build_mlp(shape: MlpShape) -> Any:
    """The blocks as a functional model; its Dense layers are `block_<i>_up`, `block_<i>_down`."""
    import keras

    inputs = keras.Input((shape.tokens, shape.width))
    hidden = inputs
    for index in range(shape.blocks):
        normed = keras.layers.LayerNormalization(name=f"block_{index}_norm")(hidden)
        up = keras.layers.Dense(4 * shape.width, activation="gelu", name=f"block_{index}_up")
        down = keras.layers.Dense(shape.width, name=f"block_{index}_down")
        hidden = keras.layers.Add()([hidden, down(up(normed))])
    return keras.Model(inputs, hidden)


def apply_mlp_float8(model: Any, variant: str) -> None:
    """The MLP's Dense layers in float8 by `variant`: `float8 keras` (`quantize("float8")`,
    Keras' own call), `float8 delayed` or `float8 current` (`to_float8`, our GEMMs); any other
    variant leaves them as they are."""
    import keras

    from mpt_keras.precision.float8 import to_float8

    dense = [layer.name for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    if variant == "float8 keras":
        for name in dense:
            model.get_layer(name).quantize("float8")
    elif variant.startswith("float8 "):
        to_float8(model, dense, variant.removeprefix("float8 "))


def build_transformer(shape: TransformerShape) -> Any:
    """The reference Transformer language model of `shape`."""
    from mpt_keras.models.transformer import build_transformer_lm

    return build_transformer_lm(
        shape.vocabulary, shape.tokens, num_layers=shape.blocks, d_model=shape.width,
        num_heads=shape.heads,
    )  # fmt: skip


def apply_float8(model: Any, stack: str) -> None:
    """Ours: the float8 manifest. Stock: Keras' `quantize("float8")` on the layers it names."""
    from mpt_keras.keras_bridge.layer_paths import iter_layers
    from mpt_keras.precision.manifest import PrecisionManifest

    manifest = PrecisionManifest.from_json(os.path.join(_REPO, FLOAT8_MANIFEST))
    if stack == "ours":
        manifest.apply(model)
        return
    pattern = next(rule.path for rule in manifest.rules if rule.policy == "float8")
    for path, layer in iter_layers(model):
        if re.search(pattern, path):
            layer.quantize("float8")
