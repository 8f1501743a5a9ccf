"""A keras_hub backbone under a head of the user's own, and keras_hub's own GPT-2 task model,
on Keras' JAX backend: their dict of inputs (`token_ids`, `padding_mask`) comes as arrays
(`data/example_arrays.py`), the only kind of data there, and a float8 manifest of the user's
own reaches the backbone's EinsumDense projections, each compared with float32
(`validation/forward_parity.py`).

`examples/user_data.py:python_bytes` returns the arrays on JAX; tests/test_own_backbones.py
runs the same models through every launcher on TensorFlow.
"""

import json
import os
import sys

import pytest
from launchers import launch_in_process
from tiny_runs import manifest_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = os.path.join(REPO, "examples", "configs", "llama_python_source.json")
BLOCK = "gpt2_backbone/transformer_layer_0"
FLOAT8 = [
    f"{BLOCK}/self_attention/{name}" for name in ("query", "key", "value", "attention_output")
] + [f"{BLOCK}/feedforward_intermediate_dense", f"{BLOCK}/feedforward_output_dense"]
FLOAT8_RULE = {
    "match": {"path": "|".join(FLOAT8)},
    "policy": "float8",
    "reason": "the block's matmuls, e4m3 forward, e5m2 gradients",
}


@pytest.mark.parametrize(
    "factory",
    [
        "gpt2_with_head",
        # keras_hub's GPT2CausalLM (preprocessor=None), whose own fit and evaluate took no
        # iterator of batches: trained by Keras' (`keras_bridge/task_models.py`).
        "gpt2_lm",
    ],
)
def test_a_gpt2_backbone_with_a_head_trains_and_validates_float8_from_dict_arrays(
    factory, tmp_path
):
    override = json.dumps(
        {
            "precision": "mixed_bfloat16",
            "saved_model": False,
            "checkpoint_every": 2,
            "eval_every": 2,
            "model": {
                "factory": f"examples.user_models:{factory}",
                "options": {"num_layers": 1, "hidden_dim": 16, "intermediate_dim": 32},
            },
            "data": {"batch_size": 4, "eval_examples": 8, "options": {"sequence_length": 8}},
        }
    )
    manifest = manifest_file(tmp_path / "float8.json", "mixed_bfloat16", FLOAT8_RULE)
    flags = [f"--config={LLAMA}", f"--config_override={override}", "--backend=jax", "--steps=2"]
    trained = launch_in_process(
        "mpt-train", *flags, f"--manifest={manifest}", f"--model_dir={tmp_path / 'run'}"
    )
    assert trained.status == 0, trained.stderr
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["step"] == 2

    output = tmp_path / "validation.json"
    validated = launch_in_process(
        "mpt-validate", *flags, f"--manifest={manifest}", f"--output={output}"
    )
    assert validated.status in (0, 1), validated.stderr  # 1: a check failed, in its report.
    rows = {row["path"]: row for row in json.loads(output.read_text())["layers"]}
    assert [path for path, row in rows.items() if row["compute_dtype"] == "float8"] == FLOAT8
    assert all(row["relative_error"] > 0.005 for path, row in rows.items() if path in FLOAT8)
    assert "tensorflow" not in sys.modules
