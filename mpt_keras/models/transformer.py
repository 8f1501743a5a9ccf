"""A small decoder-only Transformer LM (pre-norm blocks, as GPT-2's).

Layer paths, stable for manifests:

    token_embedding, position_embedding
    block_<i>/attention_norm            LayerNormalization
    block_<i>/attention                 MultiHeadAttention (causal)
    block_<i>/attention/query|key|value|attention_output
    block_<i>/mlp_norm                  LayerNormalization
    block_<i>/mlp_up                    Dense, GELU
    block_<i>/mlp_down                  Dense
    final_norm                          LayerNormalization
    logits                              Dense over the vocabulary
"""

from __future__ import annotations

import keras

from mpt_keras.errors import UserInputError


@keras.saving.register_keras_serializable(package="mpt_keras")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned position embedding (up to `sequence_length`) to a sequence."""

    def __init__(self, sequence_length: int, **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = sequence_length

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=(self.sequence_length, input_shape[-1]),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            name="embeddings",
        )

    def call(self, inputs):
        length = keras.ops.shape(inputs)[-2]
        positions = keras.ops.cast(self.embeddings[:length], self.compute_dtype)
        return inputs + positions

    def get_config(self):
        return {**super().get_config(), "sequence_length": self.sequence_length}


@keras.saving.register_keras_serializable(package="mpt_keras")
class DecoderBlock(keras.layers.Layer):
    """A pre-norm Transformer decoder block with causal self-attention.

    `d_model`: the residual width, divisible by `num_heads` (else `UserInputError`);
    `mlp_ratio`: MLP width / `d_model`; `dropout`: on the attention and MLP outputs.
    """

    def __init__(
        self, d_model: int, num_heads: int, mlp_ratio: int = 4, dropout: float = 0.0, **kwargs
    ):
        super().__init__(**kwargs)
        if d_model % num_heads:
            raise UserInputError(
                "d_model must be divisible by num_heads. "
                f"Received: d_model={d_model}, num_heads={num_heads}"
            )
        self.d_model = d_model
        self.num_heads = num_heads
        self.mlp_ratio = mlp_ratio
        self.dropout = dropout
        self.attention_norm = keras.layers.LayerNormalization(
            epsilon=1e-5, name="attention_norm", dtype=self.dtype_policy
        )
        self.attention = keras.layers.MultiHeadAttention(
            num_heads,
            d_model // num_heads,
            dropout=dropout,
            name="attention",
            dtype=self.dtype_policy,
        )
        self.mlp_norm = keras.layers.LayerNormalization(
            epsilon=1e-5, name="mlp_norm", dtype=self.dtype_policy
        )
        self.mlp_up = keras.layers.Dense(
            d_model * mlp_ratio, activation="gelu", name="mlp_up", dtype=self.dtype_policy
        )
        self.mlp_down = keras.layers.Dense(d_model, name="mlp_down", dtype=self.dtype_policy)
        self.mlp_dropout = keras.layers.Dropout(
            dropout, name="mlp_dropout", dtype=self.dtype_policy
        )

    def build(self, input_shape):
        self.attention_norm.build(input_shape)
        self.attention.build(input_shape, input_shape)
        self.mlp_norm.build(input_shape)
        self.mlp_up.build(input_shape)
        self.mlp_down.build((*input_shape[:-1], self.d_model * self.mlp_ratio))

    def call(self, inputs, training=None):
        # The residual stays in the block's dtype, whatever a manifest gives sublayers.
        normed = self.attention_norm(inputs)
        attended = self.attention(normed, normed, use_causal_mask=True, training=training)
        x = inputs + keras.ops.cast(attended, inputs.dtype)
        hidden = self.mlp_up(self.mlp_norm(x))
        update = self.mlp_dropout(self.mlp_down(hidden), training=training)
        return x + keras.ops.cast(update, x.dtype)

    def get_config(self):
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "mlp_ratio": self.mlp_ratio,
            "dropout": self.dropout,
        }


def build_transformer_lm(
    vocab_size: int,
    sequence_length: int,
    *,
    num_layers: int = 2,
    d_model: int = 64,
    num_heads: int = 4,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
) -> keras.Model:
    """A decoder-only Transformer LM named `transformer_lm`: int token ids
    `[batch, sequence_length]` to next-token logits `[batch, sequence_length, vocab_size]`;
    `num_layers` decoder blocks, `mlp_ratio` as `DecoderBlock`'s.
    """
    tokens = keras.Input(shape=(sequence_length,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(
        vocab_size,
        d_model,
        embeddings_initializer=keras.initializers.RandomNormal(stddev=0.02),
        name="token_embedding",
    )(tokens)
    x = PositionEmbedding(sequence_length, name="position_embedding")(x)
    for index in range(num_layers):
        x = DecoderBlock(d_model, num_heads, mlp_ratio, dropout, name=f"block_{index}")(x)
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(x)
    logits = keras.layers.Dense(vocab_size, name="logits")(x)
    return keras.Model(tokens, logits, name="transformer_lm")
