"""A manifest applied to a model that has predicted, trained or been compiled already.

Keras traces a model's predict, test and train functions once and keeps them: applied after
them, a manifest changed nothing that `predict` or `fit` ran, silently, on either backend.
A compiled model keeps its optimizer: made float16 after `compile`, it trained without loss
scaling, silently. Calibration, which decides a manifest for such a model, leaves it as it was.
"""

import keras
import numpy as np
import pytest
from toy_layers import PostNormBlock

import mpt_keras

BFLOAT16 = mpt_keras.PrecisionManifest.from_dict({"version": 1, "default": "mixed_bfloat16"})
FLOAT16 = mpt_keras.PrecisionManifest.from_dict({"version": 1, "default": "mixed_float16"})
FLOAT8_CURRENT = mpt_keras.PrecisionManifest.from_dict(
    {
        "version": 1,
        "default": "mixed_bfloat16",
        "rules": [{"match": {"path": "hidden"}, "policy": "float8", "scaling": "current"}],
    }
)
FLOAT16_IN_A_BLOCK = mpt_keras.PrecisionManifest.from_dict(
    {
        "version": 1,
        "default": "mixed_bfloat16",
        "rules": [{"match": {"path": "block/(norm|inner)"}, "policy": "mixed_float16"}],
    }
)


def _model() -> keras.Model:
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="logits")(hidden))
    rng = np.random.default_rng(1)
    model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.weights])
    return model


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 8)).astype("float32"), rng.normal(size=(16, 4)).astype("float32")


def _refusal(manifest: mpt_keras.PrecisionManifest, model: keras.Model) -> str:
    """The one-line error of applying `manifest` to `model`, after checking it changed nothing."""
    kept = _in_use(model)
    with pytest.raises(mpt_keras.UserInputError) as raised:
        manifest.apply(model)
    assert [layer.dtype_policy.name for layer in model.layers[1:]] == ["float32", "float32"]
    assert all(now is then for now, then in zip(_in_use(model), kept, strict=True))
    return str(raised.value)


def _in_use(model: keras.Model) -> tuple[object, ...]:
    """What a model in use holds that `apply` may replace."""
    steps = (vars(model).get(name) for name in ("train_step", "test_step", "predict_step"))
    functions = (model.train_function, model.test_function, model.predict_function)
    return (*steps, *functions, model.optimizer)


def test_predict_after_the_manifest_runs_its_policies_though_predict_ran_before():
    x, _ = _batch()
    used, fresh = _model(), _model()
    float32 = used.predict(x, verbose=0)

    BFLOAT16.apply(used)
    BFLOAT16.apply(fresh)

    again = used.predict(x, verbose=0)
    np.testing.assert_array_equal(again, fresh.predict(x, verbose=0))
    assert not np.array_equal(again, float32)


def test_fit_after_the_manifest_trains_in_its_policies_though_fit_ran_before():
    x, y = _batch()
    used = _model()
    used.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    used.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    float32_twin = _model()
    float32_twin.set_weights(used.get_weights())
    float32_twin.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    bfloat16_twin = _model()
    bfloat16_twin.set_weights(used.get_weights())
    BFLOAT16.apply(bfloat16_twin)
    bfloat16_twin.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")

    BFLOAT16.apply(used)
    for model in (used, float32_twin, bfloat16_twin):
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)

    for weight, bfloat16, float32 in zip(
        used.get_weights(), bfloat16_twin.get_weights(), float32_twin.get_weights(), strict=True
    ):
        np.testing.assert_array_equal(weight, bfloat16)
    assert not np.array_equal(used.get_weights()[0], float32_twin.get_weights()[0])


def test_float16_after_compile_without_loss_scaling_is_refused_changing_nothing():
    model = _model()
    model.compile(optimizer="adam", loss="mse")

    message = _refusal(FLOAT16, model)

    assert message == (
        "model 'functional': compiled with Adam, which does not scale the loss, and this "
        "manifest makes 1 of its layers compute in float16 ('hidden' first), whose small "
        "gradients would underflow to zero. Allowed: apply the manifest before compile (which "
        "then wraps the optimizer in mpt_keras.LossScaleOptimizer), compile with "
        "mpt_keras.LossScaleOptimizer before applying it, or load the model with compile=False"
    )


def test_after_compile_float16_under_a_loss_scale_and_bfloat16_under_any_optimizer_apply():
    scaled, unscaled = _model(), _model()
    scaled.compile(optimizer=mpt_keras.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse")
    unscaled.compile(optimizer="adam", loss="mse")

    FLOAT16.apply(scaled)
    BFLOAT16.apply(unscaled)  # bfloat16 needs no loss scale.

    assert scaled.get_layer("hidden").dtype_policy.name == "mixed_float16"
    assert unscaled.get_layer("hidden").dtype_policy.name == "mixed_bfloat16"


def test_float8_after_a_train_step_is_refused_changing_nothing_and_applies_after_compile():
    x, y = _batch()
    model = _model()
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)

    message = _refusal(FLOAT8_CURRENT, model)

    assert message == (
        "model 'functional': its optimizer is built (it has trained, or was loaded with its "
        "state), and would not know the float8 variables of the layers turning float8 (1, "
        "'hidden' first). Allowed: float8 layers before the first train step, or after "
        "compiling with a new optimizer"
    )
    model.compile(optimizer="adam", loss="mse")
    FLOAT8_CURRENT.apply(model)
    model.fit(x, y, batch_size=16, verbose=0)
    assert model.get_layer("hidden").dtype_policy.name == "float8_from_mixed_bfloat16"
    assert float(model.get_layer("hidden").inputs_scale.numpy()) != 1.0  # Written by the step.


def test_calibrating_a_compiled_and_trained_model_leaves_it_as_it_was():
    x, y = _batch()
    model = _model()
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    predicted = model.predict(x, verbose=0)

    result = mpt_keras.calibrate(model, (x, y), keras.losses.MeanSquaredError(), batch_size=16)

    assert result.manifest.default == "mixed_float16"  # Refused if applied to this model.
    assert [layer.dtype_policy.name for layer in model.layers[1:]] == ["float32", "float32"]
    assert type(model.optimizer) is keras.optimizers.Adam
    np.testing.assert_array_equal(model.predict(x, verbose=0), predicted)


def test_a_loaded_float8_model_runs_the_manifests_recipe_though_it_predicted_before(tmp_path):
    x, y = _batch()
    model = _model()
    FLOAT8_CURRENT.apply(model)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    keras_own = loaded.predict(x, verbose=0)  # Keras' float8 call: delayed scaling.

    FLOAT8_CURRENT.apply(loaded)

    ours = model.predict(x, verbose=0)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), ours)
    assert not np.array_equal(keras_own, ours)


def test_a_loaded_models_float16_layer_inside_a_block_gets_a_loss_scale_at_compile(tmp_path):
    # Saved, the block holds a DTypePolicyMap; loaded, its layers hold the map too, whose own
    # compute dtype is its default (bfloat16): compile read that, and kept Adam unscaled.
    inputs = keras.Input((4,))
    block = PostNormBlock(name="block")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="logits")(block))
    FLOAT16_IN_A_BLOCK.apply(model)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(
        tmp_path / "model.keras", custom_objects={"PostNormBlock": PostNormBlock}, compile=False
    )

    loaded.compile(optimizer="adam", loss="mse")

    inner = loaded.get_layer("block").inner
    assert (inner.dtype_policy.compute_dtype, inner.compute_dtype) == ("bfloat16", "float16")
    assert type(loaded.optimizer) is mpt_keras.LossScaleOptimizer
