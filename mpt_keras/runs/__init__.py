"""Runs: a config becomes a model, data, a loss and a compiled step, and then files.

resolution.py      Components: where a run's model, data, loss and metrics come from
precision_plan.py  build_model: the model built with each layer's precision
assembly.py        assemble: the compiled model, its optimizer and train step;
                   plan_precision (--dry_run), with the float8 census
training.py        run_training and its Runtime: a config to a `model_dir`
fit_loop.py        model.fit with our callbacks, and rollbacks on divergence
model_dir.py       a `model_dir`'s files, checked before a run claims it
side_by_side.py    a candidate and float32 trained a few steps each
validation.py      validate / run_validation: a candidate beside float32
canary.py          run_canary / train_with_canary: a few steps first
calibration_run.py run_calibration: a run config's model calibrated
serving.py         save_for_serving, export_saved_model
keras_objects.py   losses, metrics and `.keras` models a config names
"""
