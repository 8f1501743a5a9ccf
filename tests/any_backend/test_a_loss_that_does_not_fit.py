"""A loss that cannot take the model's outputs and the data's labels is refused before anything
is written, on either backend.

`mse` on class ids: it failed at the first step, after the run had written its config.json,
and a rerun on that model_dir with the loss mended was refused as another run.
"""

import json
import os

import keras
from launchers import launch_in_process

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP = os.path.join(REPO, "configs", "digits_mlp.json")
# What each backend says of the loss, after our words.
BACKENDS_OWN = {
    "tensorflow": "ValueError: Dimensions must be equal, but are 64 and 10 for ",
    "jax": "ValueError: Incompatible shapes for broadcasting: shapes=[(64,), (64, 10)])",
}


def _train(model_dir, loss):
    return launch_in_process(
        "mpt-train",
        f"--config={MLP}",
        f"--backend={keras.backend.backend()}",
        f"--config_override={json.dumps({'loss': loss})}",
        f"--model_dir={model_dir}",
        "--steps=1",
    )


def test_a_loss_for_other_labels_is_one_line_and_the_model_dir_stays_free(tmp_path):
    model_dir = tmp_path / "run"
    refused = _train(model_dir, "mse")

    assert refused.status == 2, refused.stderr
    line = refused.stderr.splitlines()[-1]
    assert line.startswith(
        "mpt-train: error: the loss or a metric cannot take the model's outputs float32 "
        "(64, 10) and the labels int32 (64,) of the data's first examples ("
        + BACKENDS_OWN[keras.backend.backend()]
    )
    assert line.endswith("). Allowed: a loss and metrics for those outputs and labels")
    assert not model_dir.exists()
    # The same model_dir, the loss mended: a new run.
    mended = _train(
        model_dir, {"name": "sparse_categorical_crossentropy", "options": {"from_logits": True}}
    )
    assert mended.status == 0, mended.stderr
    assert json.loads((model_dir / "metrics.json").read_text())["step"] == 1
