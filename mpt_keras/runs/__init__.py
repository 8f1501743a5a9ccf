"""Runs: a config becomes a model, data, a loss and a compiled step, and then files.

resolution.py      Components: where a run's model, data, loss and metrics come from
precision_plan.py  the model built with each layer's precision; plan_precision
assembly.py        the compiled model, its optimizer and train step: assemble
training.py        run_training and its Runtime: a config to a `model_dir`
fit_loop.py        model.fit with the toolkit's callbacks, and rollbacks on divergence
model_dir.py       the files of a `model_dir`, and the checks before a run claims it
side_by_side.py    a candidate and float32 trained a few steps each, writing nothing
validation.py      validate / run_validation: a candidate trained beside float32
canary.py          run_canary / train_with_canary: a few steps first
calibration_run.py run_calibration: a run config's model calibrated, its manifest written
serving.py         save_for_serving, export_saved_model
keras_objects.py   losses, metrics and `.keras` models a config names
"""
