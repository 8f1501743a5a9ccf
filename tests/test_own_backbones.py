"""keras_hub backbones under a head of the user's own, and a subclassed model, through
every launcher: calibrate, train with the manifest (and, for one, a canary), validate.

The models are the ones `examples/user_models.py` ships: a keras_hub
`LlamaBackbone` and `GPT2Backbone` built from arguments (no preset, no
network) and called on the user's own `keras.Input`s named like the
backbone's, under a `Dense` head (the most common way to put a head on a
backbone), and `LlamaLanguageModel`, a subclassed model holding a Llama
backbone. Each launcher runs in this process (tests/launchers.py), a few tiny
steps each; tests/test_own_model.py runs launchers as processes. Last, bare keras_hub
backbones with post-norm blocks, without a launcher: a forward and backward pass under the
safe defaults, which stopped at their first `+` on TensorFlow before their layers handed
their outputs back (`precision/hand_back.py`).
"""

import json
import os

import numpy as np
import pytest
from launchers import launch_in_process
from replicas import on_two_cpus, run_on_two_cpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(REPO, "examples", "configs", "llama_python_source.json")
TINY = {"num_layers": 1, "hidden_dim": 16}
MODELS = {
    "llama_with_head": {**TINY, "intermediate_dim": 32},
    "gpt2_with_head": {**TINY, "intermediate_dim": 32},
    "llama_subclassed": TINY,
}
# The canary runs on one of them: its only model-specific work, training the
# candidate and float32 side by side (`side_by_side.train_steps`), is what
# `mpt-validate` runs on every model here; a subclassed model's canary is
# tests/test_runs_canary.py::test_a_subclassed_model_of_ones_own_runs_the_canary_without_a_config.
CANARY = "llama_with_head"


def _override(factory: str) -> str:
    return json.dumps(
        {
            "jit_compile": "false",
            "saved_model": False,  # tests/test_own_model.py exports a keras_hub model's.
            "checkpoint_every": 2,
            "eval_every": 2,
            "model": {"factory": f"examples.user_models:{factory}", "options": MODELS[factory]},
            "data": {"batch_size": 4, "eval_examples": 8, "options": {"sequence_length": 8}},
        }
    )


def _train(model: dict, model_dir, *flags: str):
    """2 steps of `mpt-train` on the Llama example's config, its model section `model`."""
    override = json.loads(_override("llama_with_head"))
    override["model"] = model
    return launch_in_process(
        "mpt-train",
        f"--config={LLAMA}",
        f"--config_override={json.dumps(override)}",
        f"--model_dir={model_dir}",
        "--steps=2",
        *flags,
    )


def _read(path):
    with open(path) as file:
        return json.load(file)


@pytest.mark.parametrize("factory", MODELS)
def test_every_launcher_runs_on_a_backbone_of_the_users_own(factory, tmp_path):
    config = [f"--config={LLAMA}", f"--config_override={_override(factory)}"]
    manifest = str(tmp_path / "manifest.json")
    calibrated = launch_in_process("mpt-calibrate", *config, "--steps=1", f"--output={manifest}")
    assert calibrated.status == 0, calibrated.stderr
    decided = _read(manifest.replace(".json", ".stats.json"))["layers"]
    # Decided inside the blocks, not a block as one unit.
    assert any(path.endswith("transformer_layer_0/self_attention/query") for path in decided)

    model_dir = str(tmp_path / "run")
    canary = ["--canary_steps=1"] if factory == CANARY else []
    trained = launch_in_process(
        "mpt-train",
        *config,
        f"--model_dir={model_dir}",
        f"--manifest={manifest}",
        *canary,
        "--steps=2",
    )
    assert trained.status == 0, trained.stderr
    assert _read(os.path.join(model_dir, "metrics.json"))["step"] == 2
    if canary:
        assert not _read(os.path.join(model_dir, "canary.json"))["diverged"]
    assert "2/2" in trained.stdout + trained.stderr

    output = str(tmp_path / "validation.json")
    validated = launch_in_process(
        "mpt-validate", *config, f"--manifest={manifest}", "--steps=2", f"--output={output}"
    )
    assert validated.status in (0, 1), validated.stderr
    report = _read(output)
    assert report["candidate"] == manifest
    compared = [layer["path"] for layer in report["layers"]]
    assert compared, report


def test_a_post_norm_bert_trains_under_the_safe_defaults(tmp_path):
    # BERT's blocks add a layer norm's output to the residual with `+`: with the norm float32
    # (the safe default) and the block float16, TensorFlow refused that `+` at the first step.
    model_dir = str(tmp_path / "run")
    trained = _train({"factory": "examples.user_models:bert_with_head", "options": TINY}, model_dir)
    assert trained.status == 0, trained.stderr
    assert _read(os.path.join(model_dir, "metrics.json"))["step"] == 2
    report = _read(os.path.join(model_dir, "precision_report.json"))
    norms = {
        layer["path"].removeprefix("bert_backbone/"): (layer["policy"], layer["returns_dtype"])
        for layer in report["layers"]
        if layer["class"] == "LayerNormalization"
    }
    assert norms == {
        "embeddings_layer_norm": ("float32", None),  # In the backbone's graph.
        "transformer_layer_0/self_attention_layer_norm": ("float32", "float16"),
        "transformer_layer_0/feedforward_layer_norm": ("float32", "float16"),
    }
    assert report["output_dtype_mismatches"] == []


def gpt2_lm_with_a_preprocessor(vocab_size: int, sequence_length: int):
    """A keras_hub task holding its preprocessor (a tokenizer of a made-up vocabulary)."""
    import keras_hub

    vocabulary = {"<|endoftext|>": 0, "a": 1, "b": 2, "Ġ": 3, "Ġa": 4, "Ġb": 5}
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=["Ġ a", "Ġ b"])
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab_size,
        max_sequence_length=sequence_length,
        **{**TINY, "num_heads": 1, "intermediate_dim": 32},
    )
    return keras_hub.models.GPT2CausalLM(
        backbone=backbone,
        preprocessor=keras_hub.models.GPT2CausalLMPreprocessor(
            tokenizer=tokenizer, sequence_length=sequence_length
        ),
    )


def test_a_keras_hub_task_with_a_preprocessor_is_refused_before_anything_is_written(tmp_path):
    # It stopped in the middle of its first step (a TypeError from its preprocessor, mapped
    # over the run's batches of token ids); the run makes the model's inputs itself.
    model_dir = tmp_path / "run"
    trained = _train({"factory": "test_own_backbones:gpt2_lm_with_a_preprocessor"}, model_dir)
    assert trained.status == 2
    assert trained.stderr.splitlines()[-1] == (
        "mpt-train: error: the model factory returned a keras_hub GPT2CausalLM with a "
        "preprocessor (GPT2CausalLMPreprocessor), but the run feeds the model its inputs "
        "itself, batched from the data's. Allowed: the task built with preprocessor=None, its "
        "inputs (token ids, masks) made by the data factory"
    )
    assert not model_dir.exists()


@on_two_cpus
def test_a_keras_hub_task_trains_mirrored_on_its_bool_padding_mask(tmp_path):
    # Keras summed a batch over the replicas to build the model at each fit, and
    # TensorFlow sums no bool: the task's padding_mask (as the data makes it) stopped it.
    model_dir = tmp_path / "run"
    status, stderr = run_on_two_cpus("test_own_backbones", "_mirrored_task_run", str(model_dir))
    assert status == 0, stderr
    assert _read(model_dir / "metrics.json")["step"] == 2


def _mirrored_task_run(model_dir: str) -> tuple[int | str, str]:
    """In the two-CPU host: 2 steps of keras_hub's GPT2CausalLM on two replicas."""
    model = {"factory": "examples.user_models:gpt2_lm", "options": MODELS["gpt2_with_head"]}
    run = _train(model, model_dir, "--strategy=mirrored", "--virtual_cpus=2")
    return run.status, run.stderr


def _text_inputs(length: int = 8, **names: str) -> dict:
    tokens = np.random.default_rng(0).integers(1, 60, (2, length)).astype("int32")
    return {
        name: tokens if kind == "tokens" else np.ones_like(tokens) for name, kind in names.items()
    }


TEXT = {"token_ids": "tokens", "padding_mask": "mask"}
SEQ2SEQ = {f"{side}_{name}": kind for side in ("encoder", "decoder") for name, kind in TEXT.items()}
ARGUMENTS = {"vocabulary_size": 64, "num_layers": 2, "num_heads": 2, "hidden_dim": 16}
# Bare backbones: their last block makes a model output (float32, a safe default). Per
# backbone: how many layers hand their outputs back in float16 (the norms of the blocks
# before, and of DeBERTa's relative embeddings) and in float32 (the last block's sublayers;
# BART's encoder and decoder each have one).
POST_NORM_BACKBONES = {
    "DistilBertBackbone": ({"intermediate_dim": 32, "max_sequence_length": 8}, TEXT, 2, 5),
    "RobertaBackbone": ({"intermediate_dim": 32, "max_sequence_length": 8}, TEXT, 2, 5),
    "DebertaV3Backbone": (
        {"intermediate_dim": 32, "max_sequence_length": 8, "bucket_size": 4},
        TEXT,
        3,
        5,
    ),
    "BartBackbone": ({"intermediate_dim": 32, "max_sequence_length": 8}, SEQ2SEQ, 5, 12),
}


@pytest.mark.parametrize("name", POST_NORM_BACKBONES)
def test_post_norm_keras_hub_backbones_run_forward_and_backward_under_the_safe_defaults(name):
    # Imported here: keras_hub takes seconds, and the launcher tests above import it in
    # their own runs.
    import keras
    import keras_hub
    import tensorflow as tf

    import mpt_keras

    options, names, float16, float32 = POST_NORM_BACKBONES[name]
    backbone = getattr(keras_hub.models, name)(**ARGUMENTS, **options)
    inputs = _text_inputs(**names)
    backbone(inputs)
    report = mpt_keras.PrecisionManifest.from_dict(
        {"version": 1, "default": "mixed_float16"}
    ).apply(backbone)

    with tf.GradientTape() as tape:
        outputs = keras.tree.flatten(backbone(inputs, training=True))
        loss = tf.add_n([tf.reduce_mean(tf.square(output)) for output in outputs])
    gradients = tape.gradient(loss, backbone.trainable_variables)

    assert all(np.isfinite(tf.convert_to_tensor(gradient).numpy()).all() for gradient in gradients)
    assert {output.dtype for output in outputs} == {tf.float32}
    assert report.output_dtype_mismatches == ()
    returned = [layer.returns_dtype for layer in report.layers if layer.returns_dtype]
    assert {dtype: returned.count(dtype) for dtype in set(returned)} == {
        "float16": float16,
        "float32": float32,
    }
