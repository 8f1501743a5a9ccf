"""Tests of validation.forward_parity: every layer a model runs, compared between two precisions.

Each builds one model twice, in float32 and in mixed_bfloat16, and compares
them on the float32 one's weights, without training. The rows and their
parents come from mpt_keras.validation.parity_rows.
"""

import keras
import numpy as np
import pytest

from examples.user_models import backbone_with_head
from mpt_keras.keras_bridge.layer_calls import calls_wrapped
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.validation import forward_parity as fp
from mpt_keras.validation.parity_rows import ParityRows, Recorder


def _compare(build, features, candidate_policy="mixed_bfloat16"):
    """`(forward parity, baseline rows)` of `build()` in float32 against `candidate_policy`.

    The rows are the baseline's after a run on `features`, which sets a sublayer's parents.
    """
    baseline = build()
    keras.config.set_dtype_policy(candidate_policy)  # The conftest restores float32.
    candidate = build()
    keras.config.set_dtype_policy("float32")
    baseline(features)
    candidate(features)
    rows = ParityRows(baseline, features)
    _captured(baseline, rows, features)
    return fp.forward_parity(baseline, candidate, [features]), rows


def _captured(model, rows, features):
    """`{path: what the row's call returned}` when `model` ran on `features`."""
    recorder = Recorder(model, rows)
    with calls_wrapped(rows.watched.values(), recorder.watching):
        returned = recorder.run(features)
    return {rows.rows[row].path: keras.ops.convert_to_numpy(returned[row]) for row in returned}


def _parents(rows, holder=None):
    """`{path: its parents' paths}` of the rows no layer holds, or of those inside `holder`."""
    inside = [row for row in rows.rows if row.path.startswith(f"{holder}/")]
    return {
        row.path: [rows.rows[parent].path for parent in row.parents]
        for row in (inside if holder else [row for row in rows.rows if row.holder is None])
    }


def _tokens(vocabulary=64, length=8):
    rng = np.random.default_rng(0)
    return {
        "token_ids": rng.integers(1, vocabulary, (4, length)).astype("int32"),
        "padding_mask": np.ones((4, length), "int32"),
    }


def _with_head(backbone: keras.Model) -> keras.Model:
    """A backbone under the user's own Dense head, its inputs named as the backbone's own."""
    return backbone_with_head(backbone, vocab_size=64, sequence_length=8)


@pytest.fixture
def llama_with_head(tiny_llama):
    """Builds a tiny Llama backbone, named as its first instance, under a head."""
    return lambda: _with_head(tiny_llama(name="llama_backbone"))


_LLAMA_BLOCK = "llama_backbone/transformer_layer_0"


def test_a_llama_backbone_under_a_head_of_ones_own_is_compared_layer_by_layer(llama_with_head):
    """The probe built a keras.Model on the outer inputs: "token_ids" used 2 times."""
    parity, walk = _compare(llama_with_head, _tokens())
    assert _parents(walk) == {
        "llama_backbone/token_embedding": [],
        _LLAMA_BLOCK: ["llama_backbone/token_embedding"],
        "llama_backbone/sequence_output_layernorm": [_LLAMA_BLOCK],
        "lm_head": ["llama_backbone/sequence_output_layernorm"],
    }
    graph_rows = [row for row in parity.layers if row.path in _parents(walk)]
    assert [(row.path, row.compute_dtype) for row in graph_rows] == [
        ("llama_backbone/token_embedding", "bfloat16"),
        (_LLAMA_BLOCK, "bfloat16"),
        ("llama_backbone/sequence_output_layernorm", "bfloat16"),
        ("lm_head", "bfloat16"),
    ]
    assert [output.path for output in parity.outputs] == ["lm_head"]
    assert parity.outputs[0] == parity.layers[-1]
    assert parity.unreached == ()
    assert all(0 < row.relative_error < 0.05 for row in graph_rows)
    assert parity.layers[0].error_jump == parity.layers[0].relative_error  # Fed by inputs only.
    assert parity.outputs[0].top1_agreement > 0.9


_LLAMA_SUBLAYERS = [  # In call order.
    "self_attention_layernorm",
    "self_attention",
    "self_attention/query",
    # Called for the query, then the key: compared at the query's.
    "self_attention/rotary_embedding_layer",
    "self_attention/key",
    "self_attention/value",
    "self_attention/attention_softmax",
    "self_attention/_dropout_layer",
    "self_attention/attention_output",
    "self_attention_dropout",
    "feedforward_layernorm",
    "feedforward_gate_dense",
    "feedforward_intermediate_dense",
    "feedforward_output_dense",
]


def test_a_llama_block_is_compared_sublayer_by_sublayer_in_call_order(llama_with_head):
    """It was one row, `llama_backbone/transformer_layer_0`."""
    parity, walk = _compare(llama_with_head, _tokens())
    paths = [row.path for row in parity.layers]
    block = paths.index(_LLAMA_BLOCK)
    assert paths[block:-2] == [_LLAMA_BLOCK] + [
        f"{_LLAMA_BLOCK}/{path}" for path in _LLAMA_SUBLAYERS
    ]
    rows = {row.path: row for row in parity.layers}
    assert rows[f"{_LLAMA_BLOCK}/self_attention/attention_softmax"].compute_dtype == "float32"
    assert rows[f"{_LLAMA_BLOCK}/self_attention/query"].compute_dtype == "bfloat16"


def test_a_sublayers_parents_are_found_by_identity_else_what_may_have_fed_it(llama_with_head):
    _, walk = _compare(llama_with_head, _tokens())

    def before(path, inside=""):
        """The block's sublayers called before `path`, all or those inside `inside`."""
        earlier = _LLAMA_SUBLAYERS[: _LLAMA_SUBLAYERS.index(path)]
        return {sublayer for sublayer in earlier if sublayer.startswith(inside)}

    # What an operation made (attention scores, `x + residual`, `x * silu(gate)`):
    # the holder's inputs' rows and the rows returned inside the holder before.
    assert {
        path.removeprefix(f"{_LLAMA_BLOCK}/"): set(parents)
        for path, parents in _parents(walk, _LLAMA_BLOCK).items()
    } == {
        "self_attention_layernorm": {"llama_backbone/token_embedding"},
        "self_attention": {f"{_LLAMA_BLOCK}/self_attention_layernorm"},
        "self_attention/query": {f"{_LLAMA_BLOCK}/self_attention_layernorm"},
        "self_attention/rotary_embedding_layer": {f"{_LLAMA_BLOCK}/self_attention/query"},
        "self_attention/key": {f"{_LLAMA_BLOCK}/self_attention_layernorm"},
        "self_attention/value": {f"{_LLAMA_BLOCK}/self_attention_layernorm"},
        **{
            path: {f"{_LLAMA_BLOCK}/self_attention_layernorm"}
            | {f"{_LLAMA_BLOCK}/{sublayer}" for sublayer in before(path, "self_attention/")}
            for path in ("self_attention/attention_softmax", "self_attention/_dropout_layer")
        },
        "self_attention/attention_output": {f"{_LLAMA_BLOCK}/self_attention/_dropout_layer"},
        "self_attention_dropout": {f"{_LLAMA_BLOCK}/self_attention"},
        "feedforward_gate_dense": {f"{_LLAMA_BLOCK}/feedforward_layernorm"},
        "feedforward_intermediate_dense": {f"{_LLAMA_BLOCK}/feedforward_layernorm"},
        **{
            path: {"llama_backbone/token_embedding"}
            | {f"{_LLAMA_BLOCK}/{sublayer}" for sublayer in before(path)}
            for path in ("feedforward_layernorm", "feedforward_output_dense")
        },
    }


def test_a_sublayer_in_bfloat16_shows_the_largest_jump_where_the_drift_enters(llama_with_head):
    """Only the block's feed-forward gate computes in bfloat16; the block was one row."""
    gate = f"{_LLAMA_BLOCK}/feedforward_gate_dense"
    baseline, candidate = llama_with_head(), llama_with_head()
    dict(iter_layers(candidate))[gate].dtype_policy = keras.DTypePolicy("mixed_bfloat16")
    features = _tokens()
    baseline(features)
    candidate(features)
    parity = fp.forward_parity(baseline, candidate, [features])
    rows = {row.path: row for row in parity.layers}
    assert rows[gate].compute_dtype == "bfloat16"
    assert {row.compute_dtype for path, row in rows.items() if path != gate} == {"float32"}
    assert max(parity.layers, key=lambda row: row.error_jump).path == gate
    assert rows[gate].error_jump == rows[gate].relative_error > 0  # Its inputs are exact.
    # Before it in call order, only its block's row, whose output holds its drift, differs.
    earlier = parity.layers[: list(rows).index(gate)]
    assert [row.path for row in earlier if row.relative_error] == [_LLAMA_BLOCK]


def test_a_gpt2_backbone_under_a_head_is_compared_through_its_add_and_dropout(tiny_gpt2):
    parity, walk = _compare(lambda: _with_head(tiny_gpt2(num_layers=1)), _tokens())
    backbone = walk.rows[0].path.split("/")[0]  # Keras numbers a second build: gpt2_backbone_1.
    assert _parents(walk) == {
        f"{backbone}/{path}": [f"{backbone}/{parent}" for parent in parents]
        for path, parents in {
            "token_embedding": [],
            # keras_hub's PositionEmbedding takes the token embeddings, for their shape.
            "position_embedding": ["token_embedding"],
            "embeddings_add": ["token_embedding", "position_embedding"],
            "embeddings_dropout": ["embeddings_add"],
            "transformer_layer_0": ["embeddings_dropout"],
            "layer_norm": ["transformer_layer_0"],
        }.items()
    } | {"lm_head": [f"{backbone}/layer_norm"]}
    # Each block's sublayers after it.
    assert [row.path for row in parity.layers if row.path in _parents(walk)] == list(_parents(walk))
    assert parity.layers[3].error_jump == 0.0  # The dropout, inactive.
    assert parity.unreached == ()


def test_a_sublayer_its_block_did_not_call_is_unreached_with_the_reason(tiny_gpt2):
    """GPT-2's attention without dropout runs a fused kernel, beside its softmax and dropout."""

    def build():
        return _with_head(tiny_gpt2(num_layers=1, dropout=0.0, name="gpt2_backbone"))

    parity, _ = _compare(build, _tokens())
    attention = "gpt2_backbone/transformer_layer_0/self_attention"
    reason = f"not called inside {attention!r}, which holds it, when the model ran"
    assert parity.unreached == (
        fp.UnreachedLayer(f"{attention}/_softmax", reason),
        fp.UnreachedLayer(f"{attention}/_dropout_layer", reason),
    )
    assert f"{attention}/attention_output" in [row.path for row in parity.layers]


def test_a_tied_embedding_is_compared_as_the_logits_and_as_the_token_lookup(tiny_gpt2):
    """As keras_hub's GPT2CausalLM: the backbone's token embedding also makes the logits."""

    def build():
        backbone = tiny_gpt2(num_layers=1)
        inputs = {
            name: keras.Input((8,), dtype="int32", name=name)
            for name in ("token_ids", "padding_mask")
        }
        logits = backbone.token_embedding(backbone(inputs), reverse=True)
        return keras.Model(inputs, logits)

    parity, walk = _compare(build, _tokens())
    backbone = walk.rows[0].path.split("/")[0]
    rows = {row.path: row for row in parity.layers}
    assert [output.path for output in parity.outputs] == ["token_embedding"]
    assert _parents(walk)["token_embedding"] == [f"{backbone}/layer_norm"]
    # The lookup only rounds the table to bfloat16; the logits carry every layer's drift.
    lookup, logits = rows[f"{backbone}/token_embedding"], rows["token_embedding"]
    assert logits.relative_error > lookup.relative_error > 0
    assert logits.top1_agreement is not None and lookup.top1_agreement is None


def test_a_shared_layer_is_compared_at_the_call_that_makes_the_output():
    """Its first call's output was compared before: for a keras_hub GPT-2, the
    float32 token lookup stood for the logits, with an error of 0."""

    inputs = keras.Input((4,), name="x")
    shared = keras.layers.Dense(4, name="shared")
    hidden = keras.layers.Activation("relu", name="relu")(shared(inputs))
    model = keras.Model(inputs, [shared(hidden), hidden])
    walk = ParityRows(model)
    # Rows in the order of the calls compared; the parent of each is the other's row.
    assert _parents(walk) == {"relu": ["shared"], "shared": ["relu"]}
    assert [walk.rows[row].path for row in walk.outputs] == ["shared", "relu"]
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    outputs = model(x)
    captured = _captured(model, walk, x)
    np.testing.assert_array_equal(captured["shared"], keras.ops.convert_to_numpy(outputs[0]))
    np.testing.assert_array_equal(captured["relu"], keras.ops.convert_to_numpy(outputs[1]))


def test_a_sequential_inside_a_functional_model_is_descended_into():
    def build():
        inputs = keras.Input((4,), name="x")
        encoder = keras.Sequential(
            [keras.layers.Dense(8, name="hidden"), keras.layers.Dense(8, name="code")],
            name="encoder",
        )
        added = keras.ops.add(encoder(inputs), 1.0)  # An operation between layers.
        return keras.Model(inputs, keras.layers.Dense(2, name="head")(added))

    parity, walk = _compare(build, np.ones((4, 4), "float32"))
    assert _parents(walk) == {
        "encoder/hidden": [],
        "encoder/code": ["encoder/hidden"],
        "head": ["encoder/code"],  # Through the add.
    }
    assert [row.path for row in parity.layers] == ["encoder/hidden", "encoder/code", "head"]
    assert parity.unreached == ()


def test_a_model_of_dict_inputs_traces_each_input_into_a_nested_model():
    def build():
        inner_inputs = {name: keras.Input((3,), name=name) for name in ("a", "b")}
        inner = keras.Model(
            inner_inputs,
            keras.layers.Dense(2, name="from_b")(inner_inputs["b"]),
            name="inner",
        )
        inputs = {name: keras.Input((3,), name=name) for name in ("a", "b")}
        scaled = keras.layers.Dense(3, name="scale_b")(inputs["b"])
        return keras.Model(inputs, inner({"a": inputs["a"], "b": scaled}))

    features = {name: np.ones((2, 3), "float32") for name in ("a", "b")}
    parity, walk = _compare(build, features)
    assert _parents(walk) == {"scale_b": [], "inner/from_b": ["scale_b"]}
    assert [output.path for output in parity.outputs] == ["inner/from_b"]


def test_an_embedding_mask_reaches_the_layers_as_in_training():
    def build():
        tokens = keras.Input((6,), dtype="int32", name="tokens")
        embedded = keras.layers.Embedding(10, 4, mask_zero=True, name="embed")(tokens)
        pooled = keras.layers.GlobalAveragePooling1D(name="pool")(embedded)
        return keras.Model(tokens, keras.layers.Dense(3, name="logits")(pooled))

    tokens = np.array([[1, 2, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0]], "int32")
    parity, walk = _compare(build, tokens)
    assert [row.path for row in parity.layers] == ["embed", "pool", "logits"]
    # The mask left the padding out of the mean: without it, a mean over 6 positions.
    pooled = _captured(walk.rows[0].graph.model, walk, tokens)["pool"]
    embeddings = keras.ops.convert_to_numpy(walk.rows[0].layer.embeddings)
    np.testing.assert_allclose(pooled[1], embeddings[3], rtol=1e-6)
    assert parity.unreached == ()


def test_a_subclassed_model_in_a_functional_model_is_compared_as_a_block():
    """Its layers were unreached: "inside 'block', a model whose call is Python code"."""

    class Block(keras.Model):
        def __init__(self):
            super().__init__(name="block")
            self.first = keras.layers.Dense(4, name="first")
            self.second = keras.layers.Dense(4, name="second")

        def call(self, inputs):
            return self.second(self.first(inputs))

    def build():
        inputs = keras.Input((4,), name="x")
        return keras.Model(inputs, keras.layers.Dense(2, name="head")(Block()(inputs)))

    parity, walk = _compare(build, np.ones((2, 4), "float32"))
    assert [row.path for row in parity.layers] == ["block", "block/first", "block/second", "head"]
    assert _parents(walk, "block") == {"block/first": [], "block/second": ["block/first"]}
    assert parity.unreached == ()


def test_a_layer_the_graph_never_calls_is_unreached():
    class WithSpare(keras.Model):  # Functional: its call is its graph's.
        def __init__(self):
            inputs = keras.Input((2,), name="x")
            super().__init__(inputs, keras.layers.Dense(2, name="used")(inputs), name="spare")
            self.spare = keras.layers.Dense(2, name="never_called")

    parity, _ = _compare(WithSpare, np.ones((2, 2), "float32"))
    assert [row.path for row in parity.layers] == ["used"]
    assert parity.unreached == (
        fp.UnreachedLayer("never_called", "held by 'spare' but not called by its graph"),
    )


def test_an_output_an_operation_makes_is_read_from_what_the_model_returned():
    def build():
        inputs = keras.Input((4,), name="x")
        logits = keras.layers.Dense(3, name="logits")(inputs)
        return keras.Model(inputs, keras.ops.softmax(logits))

    parity, walk = _compare(build, np.ones((2, 4), "float32"))
    assert walk.rows[1].frame is None and walk.rows[1].returned == 0
    assert parity.layers[0].path == "logits"
    assert parity.layers[1].path.startswith("softmax")
    assert parity.outputs == parity.layers[1:]
    assert _parents(walk)[parity.layers[1].path] == ["logits"]
    assert parity.layers[1].compute_dtype == "bfloat16"  # What the operation returned.


def test_rows_pair_by_position_when_two_builds_name_layers_differently():
    def build():
        inputs = keras.Input((4,))
        return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(3)(inputs)))

    baseline, candidate = build(), build()
    assert baseline.layers[1].name != candidate.layers[1].name  # dense, dense_2
    x = np.ones((2, 4), "float32")
    parity = fp.forward_parity(baseline, candidate, [x])
    assert [row.path for row in parity.layers] == [layer.name for layer in baseline.layers[1:]]
    assert all(row.max_abs_error == 0.0 for row in parity.layers)  # Same weights, same precision.
    assert parity.unreached == ()


def test_a_subclassed_model_returning_several_tensors_has_a_row_for_each():
    """Pooled into one row, a one-column head's trivial agreement would dilute the other's."""

    class TwoHeads(keras.Model):
        def __init__(self):
            super().__init__(name="two_heads")
            self.hidden = keras.layers.Dense(8, activation="relu", name="hidden")
            self.digit = keras.layers.Dense(3, name="digit")
            self.parity = keras.layers.Dense(1, name="parity")

        def call(self, inputs):
            features = self.hidden(inputs)
            return {"parity": self.parity(features), "digit": self.digit(features)}

    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    parity, walk = _compare(TwoHeads, x)
    assert [row.path for row in parity.outputs] == ["two_heads/digit", "two_heads/parity"]
    assert [row.path for row in parity.layers] == [
        "two_heads",
        "hidden",
        "parity",  # In call order.
        "digit",
        "two_heads/digit",  # Keras' order of a dict: by key.
        "two_heads/parity",
    ]
    assert _parents(walk) == {"two_heads": ["digit", "parity"],
                              "two_heads/digit": ["digit"],
                              "two_heads/parity": ["parity"]}  # fmt: skip
    assert [row.compute_dtype for row in parity.outputs] == ["bfloat16", "bfloat16"]
    # Each output's figures are its own tensor's.
    baseline, candidate = walk.rows[0].layer, None
    keras.config.set_dtype_policy("mixed_bfloat16")
    candidate = TwoHeads()
    keras.config.set_dtype_policy("float32")
    candidate(x)
    candidate.set_weights(baseline.get_weights())
    expected, received = baseline(x), candidate(x)
    for row, key in zip(parity.outputs, ["digit", "parity"], strict=True):
        mine = keras.ops.convert_to_numpy(expected[key]).astype("float64")
        theirs = keras.ops.convert_to_numpy(received[key]).astype("float64")
        relative = np.linalg.norm(theirs - mine) / np.linalg.norm(mine)
        assert row.relative_error == pytest.approx(relative, rel=1e-12)
        assert row.max_abs_error == pytest.approx(np.max(np.abs(theirs - mine)), rel=1e-12)
        agreement = np.mean(mine.argmax(-1) == theirs.argmax(-1))
        assert row.top1_agreement == agreement
    assert parity.outputs[1].top1_agreement == 1.0  # One column: argmax is always 0.
    assert parity.outputs[0].error_jump == 0.0  # Returned as its head made it.
