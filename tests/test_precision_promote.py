"""Tests of mpt_keras.precision.promote: layers one step up the ladder, by a manifest rule."""

import keras
import numpy as np
import pytest

from mpt_keras.errors import UserInputError
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.promote import Promotion, promote
from mpt_keras.precision.report import precision_report
from mpt_keras.precision.rules import Rule


@pytest.fixture(autouse=True)
def _restore_keras():
    yield
    keras.backend.clear_session(free_memory=False)


def _model():
    """`mlp.up` in float16; `mlpXup`, which its name as a regex would match, in bfloat16."""
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, name="mlp.up")(inputs)
    hidden = keras.layers.Dense(4, name="mlpXup")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2, name="logits")(hidden), name="mlp")
    manifest = PrecisionManifest(
        "mixed_bfloat16", (Rule("mixed_float16", path="mlp\\.up", reason="fast"),)
    )
    manifest.apply(model)
    return model, manifest


def test_every_layer_below_float32_moves_one_step_up():
    model, manifest = _model()

    promoted, promotions = promote(model, manifest, reason="divergence at step 7")

    assert promotions == (
        Promotion("mlp.up", "mixed_float16", "mixed_bfloat16"),
        Promotion("mlpXup", "mixed_bfloat16", "float32"),
    )
    assert promoted.rules == (
        Rule("mixed_bfloat16", path="mlp\\.up", reason="divergence at step 7"),
        Rule("float32", path="mlpXup", reason="divergence at step 7"),
        *manifest.rules,
    )
    assert precision_report(model).policies == {
        "mlp.up": "mixed_bfloat16",
        "mlpXup": "float32",
        "logits": "float32",
    }
    assert promote(model, promoted, reason="again")[1] == (
        Promotion("mlp.up", "mixed_bfloat16", "float32"),
    )


def test_the_rule_of_a_path_matches_that_layer_alone():
    model, manifest = _model()

    promoted, promotions = promote(
        model, manifest, reason=lambda promotion: f"{promotion.old} overflowed", paths=["mlp.up"]
    )

    assert promotions == (Promotion("mlp.up", "mixed_float16", "mixed_bfloat16"),)
    assert promoted.rules[0] == Rule(
        "mixed_bfloat16", path="mlp\\.up", reason="mixed_float16 overflowed"
    )
    # Unescaped, "mlp.up" would also have matched mlpXup, which stays bfloat16.
    report = promoted.apply(model)
    assert {layer.path: layer.decided_by for layer in report.layers} == {
        "mlp.up": "rules[0] (path 'mlp\\.up')",
        "mlpXup": "default",
        "logits": "safe default: model output",
    }


def test_float32_layers_are_left_and_nothing_to_promote_changes_nothing():
    model, manifest = _model()

    promoted, promotions = promote(model, manifest, reason="why", paths=["logits", "mlpXup"])
    assert promotions == (Promotion("mlpXup", "mixed_bfloat16", "float32"),)

    unchanged, none = promote(model, promoted, reason="why", paths=["logits", "mlpXup"])
    assert (unchanged, none) == (promoted, ())


def test_a_compiled_model_steps_with_the_new_dtypes():
    model, manifest = _model()
    model.compile(optimizer="sgd", loss="mse")
    features, targets = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    model.fit(features, targets, verbose=0)
    traced = model.train_function

    promote(model, manifest, reason="why")

    assert model.train_function is not traced
    model.fit(features, targets, verbose=0)
    assert {variable.dtype for variable in model.weights} == {"float32"}


def test_a_path_of_no_layer_is_refused():
    model, manifest = _model()
    with pytest.raises(UserInputError) as raised:
        promote(model, manifest, reason="why", paths=["mlp/up"])
    assert str(raised.value) == (
        "promote: model 'mlp' has no layer 'mlp/up'. Allowed: the paths of its layers "
        "(layer_paths.iter_layers)"
    )


def test_a_float8_layer_is_promoted_to_the_policy_it_computes_in():
    inputs = keras.Input((4,))
    model = keras.Model(
        inputs, keras.layers.Dense(1, name="out")(keras.layers.Dense(8, name="hidden")(inputs))
    )
    manifest = PrecisionManifest(default="mixed_float16", rules=(Rule("float8", path="hidden"),))
    manifest.apply(model)
    model.compile(optimizer="adam", loss="mse")
    x, y = np.ones((4, 4), "float32"), np.ones((4, 1), "float32")
    model.fit(x, y, verbose=0)
    manifest, promotions = promote(model, manifest, reason="test", paths=["hidden"])
    assert promotions == (Promotion("hidden", "float8_from_mixed_float16", "mixed_float16"),)
    assert model.get_layer("hidden").quantization_mode is None
    assert np.isfinite(model.fit(x, y, verbose=0).history["loss"]).all()  # Trains on.
    _, again = promote(model, manifest, reason="test", paths=["hidden"])
    assert again == (Promotion("hidden", "mixed_float16", "mixed_bfloat16"),)


class _TwoHeads(keras.Model):
    def __init__(self):
        super().__init__(name="two_heads")
        self.hidden = keras.layers.Dense(4, name="hidden")
        self.first = keras.layers.Dense(2, name="first")  # Not its last layer.
        self.second = keras.layers.Dense(2, name="second")

    def call(self, inputs):
        features = self.hidden(inputs)
        return {"a": self.first(features), "b": self.second(features)}


@pytest.mark.parametrize(
    "inputs, first", [(np.ones((2, 3), "float32"), "float32"), (None, "mixed_float16")]
)
def test_a_subclassed_models_heads_keep_float32_by_its_call_on_the_inputs(inputs, first):
    model = _TwoHeads()
    x = np.ones((2, 3), "float32")
    model(x)
    manifest = PrecisionManifest("mixed_float16")
    manifest.apply(model, inputs=x)
    _, promotions = promote(model, manifest, "overflow", ["hidden"], inputs=inputs)
    assert promotions == (Promotion("hidden", "mixed_float16", "mixed_bfloat16"),)
    policies = {layer.path: layer.policy for layer in precision_report(model, trace=False).layers}
    # Without them, its last layer alone stands for its outputs.
    assert policies == {"hidden": "mixed_bfloat16", "first": first, "second": "float32"}
