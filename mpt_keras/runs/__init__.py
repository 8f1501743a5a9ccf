"""Runs: a config becomes a model, data, a loss and a compiled step, and then files.

assembly.py      the run's components, precision plan and compiled model
training.py      run_training and its Runtime: a config to a `model_dir`
validation.py    validate / run_validation: a candidate trained beside float32
canary.py        run_canary / train_with_canary: a few steps first
serving.py       save_for_serving, export_saved_model
keras_objects.py losses, metrics and `.keras` models a config names
"""
