"""Files written before the package moved into concept folders still load and resume.

`tests/data/legacy_run` is what `mpt-train` wrote at commit 55f8235, when every
module sat flat in `mpt_keras/`: `mpt-train --config=configs/digits_mlp.json
--steps=2 --precision=mixed_float16` with a 16-unit MLP, checkpoints every 2
steps. Keras finds our classes by registered name and `tf.train` restores by
object graph, so neither may depend on where a module lives.
"""

from __future__ import annotations

import json
import os
import shutil

import keras
import numpy as np

import mpt_keras
from mpt_keras.config import TrainConfig

LEGACY_RUN = os.path.join(os.path.dirname(__file__), "data", "legacy_run")


def test_a_model_file_written_before_the_move_loads_with_its_loss_scale():
    model = keras.saving.load_model(os.path.join(LEGACY_RUN, "model.keras"))
    assert isinstance(model.optimizer, mpt_keras.LossScaleOptimizer)
    assert model.optimizer.loss_scale == 32768.0
    assert int(model.optimizer.iterations.numpy()) == 2
    assert model.layers[1].dtype_policy.name == "mixed_float16"


def test_a_run_written_before_the_move_resumes_from_its_checkpoint(tfds_dir, tmp_path):
    model_dir = str(tmp_path / "run")
    shutil.copytree(LEGACY_RUN, model_dir)
    # Only the dataset's home differs here: the run wrote to the default TFDS dir.
    config_path = os.path.join(model_dir, "config.json")
    with open(config_path, encoding="utf-8") as file:
        values = json.load(file)
    values["data"]["data_dir"] = tfds_dir
    with open(config_path, "w", encoding="utf-8") as file:
        json.dump(values, file)
    restored = keras.saving.load_model(os.path.join(model_dir, "model.keras"))
    config = TrainConfig.from_dict(values).merged({"steps": 3})

    steps_run = []
    count = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: steps_run.append(b))
    metrics = mpt_keras.run_training(
        config, mpt_keras.Runtime(model_dir, verbose=0, callbacks=(count,))
    )

    assert metrics["step"] == 3
    assert len(steps_run) == 1  # steps 1 and 2 came from the legacy checkpoint
    assert metrics["loss_scale"] == 32768.0
    resumed = keras.saving.load_model(os.path.join(model_dir, "model.keras"))
    assert int(resumed.optimizer.iterations.numpy()) == 3
    # One more step moved every weight from where the legacy run left it.
    for before, after in zip(restored.weights, resumed.weights, strict=True):
        assert before.shape == after.shape
    assert not np.allclose(restored.layers[-1].kernel.numpy(), resumed.layers[-1].kernel.numpy())
