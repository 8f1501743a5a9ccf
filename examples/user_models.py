"""Model factories of a user's own, for `"model": {"factory": "examples.user_models:..."}`.

Each is a plain function returning a Keras model. `mpt-train` binds the
config's `options` to its keyword arguments before anything runs, and passes
what the data decides (`input_shape`, `num_classes`, `vocab_size`,
`sequence_length`) only where the function takes it. Nothing here knows
mpt_keras: the precision comes from the run (`--precision`, `--manifest`).
"""

from __future__ import annotations

from collections.abc import Sequence

import keras


def mobilenet(input_shape: Sequence[int], num_classes: int, alpha: float = 0.25) -> keras.Model:
    """`keras.applications.MobileNet` from scratch (no pretrained weights: no network).

    Args:
        input_shape: `(height, width, 3)`, height and width at least 32.
        num_classes: Classes of the softmax-free head (the model outputs logits).
        alpha: Width multiplier of MobileNet.
    """
    return keras.applications.MobileNet(
        input_shape=tuple(input_shape),
        alpha=alpha,
        weights=None,
        classes=num_classes,
        classifier_activation=None,
    )


def gpt2_lm(
    vocab_size: int,
    sequence_length: int,
    num_layers: int = 2,
    num_heads: int = 2,
    hidden_dim: int = 32,
    intermediate_dim: int = 64,
) -> keras.Model:
    """A small keras_hub GPT-2 language model built from arguments (no preset).

    Its inputs are keras_hub's `{"token_ids", "padding_mask"}`; it outputs the
    next-token logits.
    """
    import keras_hub  # The user's dependency, not mpt_keras'.

    backbone = _gpt2_backbone(
        vocab_size, sequence_length, num_layers, num_heads, hidden_dim, intermediate_dim
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _gpt2_backbone(
    vocab_size: int,
    sequence_length: int,
    num_layers: int,
    num_heads: int,
    hidden_dim: int,
    intermediate_dim: int,
) -> keras.Model:
    import keras_hub

    return keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        intermediate_dim=intermediate_dim,
        max_sequence_length=sequence_length,
        dropout=0.0,
    )


def _llama_backbone(
    vocab_size: int,
    num_layers: int,
    hidden_dim: int,
    intermediate_dim: int,
    num_query_heads: int = 4,
    num_key_value_heads: int = 2,
) -> keras.Model:
    import keras_hub

    return keras_hub.models.LlamaBackbone(
        vocabulary_size=vocab_size,
        num_layers=num_layers,
        num_query_heads=num_query_heads,
        num_key_value_heads=num_key_value_heads,
        hidden_dim=hidden_dim,
        intermediate_dim=intermediate_dim,
    )


def backbone_with_head(backbone: keras.Model, vocab_size: int, sequence_length: int) -> keras.Model:
    """`backbone` called on the user's own inputs, under a `Dense` head of their own.

    The most common way to put a head on a keras_hub backbone. The outer inputs
    take the backbone's input names, as users name them.
    """
    inputs = {
        "token_ids": keras.Input((sequence_length,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((sequence_length,), dtype="int32", name="padding_mask"),
    }
    hidden = backbone(inputs)
    logits = keras.layers.Dense(vocab_size, name="lm_head")(hidden)
    return keras.Model(inputs, logits, name="lm_with_head")


def llama_with_head(
    vocab_size: int,
    sequence_length: int,
    num_layers: int = 2,
    num_query_heads: int = 4,
    num_key_value_heads: int = 2,
    hidden_dim: int = 32,
    intermediate_dim: int = 64,
) -> keras.Model:
    """A keras_hub `LlamaBackbone` built from arguments (no preset) under a `Dense` head.

    Inputs `{"token_ids", "padding_mask"}`; outputs the next-token logits.
    """
    backbone = _llama_backbone(
        vocab_size, num_layers, hidden_dim, intermediate_dim, num_query_heads, num_key_value_heads
    )
    return backbone_with_head(backbone, vocab_size, sequence_length)


def gpt2_with_head(
    vocab_size: int,
    sequence_length: int,
    num_layers: int = 2,
    num_heads: int = 2,
    hidden_dim: int = 32,
    intermediate_dim: int = 64,
) -> keras.Model:
    """A keras_hub `GPT2Backbone` built from arguments (no preset) under a `Dense` head."""
    backbone = _gpt2_backbone(
        vocab_size, sequence_length, num_layers, num_heads, hidden_dim, intermediate_dim
    )
    return backbone_with_head(backbone, vocab_size, sequence_length)


def bert_with_head(
    vocab_size: int,
    sequence_length: int,
    num_layers: int = 2,
    num_heads: int = 2,
    hidden_dim: int = 32,
    intermediate_dim: int = 64,
) -> keras.Model:
    """A keras_hub `BertBackbone` built from arguments (no preset) under a `Dense` head.

    BERT's blocks are post-norm, as RoBERTa's, ELECTRA's and DistilBERT's: each adds its
    sublayers' outputs to its residual with `+` and then normalizes. One segment (its
    `segment_ids` made in the model, all 0). Bidirectional, it sees the byte it is asked
    for: here for its blocks, not as a language model.
    """
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        intermediate_dim=intermediate_dim,
        max_sequence_length=sequence_length,
        dropout=0.0,
    )
    inputs = {
        "token_ids": keras.Input((sequence_length,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((sequence_length,), dtype="int32", name="padding_mask"),
    }
    segments = keras.ops.zeros_like(inputs["token_ids"])
    hidden = backbone({**inputs, "segment_ids": segments})["sequence_output"]
    logits = keras.layers.Dense(vocab_size, name="lm_head")(hidden)
    return keras.Model(inputs, logits, name="bert_with_head")


@keras.saving.register_keras_serializable(package="examples")
class LlamaLanguageModel(keras.Model):
    """A subclassed model: a keras_hub `LlamaBackbone` and a `Dense` head in `call`.

    No graph to read layer outputs from: what mpt_keras reaches inside it
    is what a layer call shows while the model runs.
    """

    def __init__(
        self,
        vocab_size: int,
        num_layers: int = 2,
        hidden_dim: int = 32,
        intermediate_dim: int = 64,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.backbone = _llama_backbone(vocab_size, num_layers, hidden_dim, intermediate_dim)
        self.head = keras.layers.Dense(vocab_size, name="lm_head")

    def call(self, inputs):
        return self.head(self.backbone(inputs))

    def get_config(self):
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size,
            "num_layers": self.num_layers,
            "hidden_dim": self.hidden_dim,
            "intermediate_dim": self.intermediate_dim,
        }


def llama_subclassed(vocab_size: int, num_layers: int = 2, hidden_dim: int = 32) -> keras.Model:
    """`LlamaLanguageModel`, unbuilt: it makes its variables on its first call."""
    return LlamaLanguageModel(vocab_size, num_layers=num_layers, hidden_dim=hidden_dim)


@keras.saving.register_keras_serializable(package="examples")
class SmallCNN(keras.Model):
    """A subclassed model: two convolutions and a dense head."""

    def __init__(self, num_classes: int = 10, filters: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.filters = filters
        self.conv = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(num_classes)

    def call(self, inputs):
        return self.head(self.pool(self.conv(inputs)))

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes, "filters": self.filters}


def small_cnn(num_classes: int, filters: int = 16) -> keras.Model:
    """`SmallCNN`, unbuilt: it makes its variables on its first call."""
    return SmallCNN(num_classes=num_classes, filters=filters)
