"""The public surface of `mpt_keras`: the names of before the move, each seen by type checkers."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys

import mpt_keras

# The public names at commit 55f8235, before the package moved into concept folders.
PUBLIC_NAMES = [
    "AutoPromote",
    "BadBatchLimit",
    "CalibrationResult",
    "CalibrationThresholds",
    "CanaryResult",
    "CanaryThresholds",
    "DivergenceGuard",
    "HardwareProbe",
    "LossScaleOptimizer",
    "LossScaleSettings",
    "MetricsCsv",
    "MixedPrecisionMonitor",
    "NonfiniteReport",
    "PeerFailedError",
    "PrecisionManifest",
    "PrecisionReport",
    "PrometheusExporter",
    "Rule",
    "RunStoppedError",
    "Runtime",
    "ScaledLearningRate",
    "StepHealth",
    "Thresholds",
    "TrainConfig",
    "UserInputError",
    "ValidationReport",
    "calibrate",
    "diagnose_nonfinite",
    "export_saved_model",
    "global_policy",
    "plan_precision",
    "precision_report",
    "probe_hardware",
    "resolve_auto_policy",
    "resolve_config",
    "run_calibration",
    "run_canary",
    "run_training",
    "run_validation",
    "save_for_serving",
    "train_with_canary",
    "validate",
]


def _type_checking_imports() -> dict[str, str]:
    """`{name: module}` of the `if TYPE_CHECKING:` imports of `mpt_keras/__init__.py`."""
    with open(mpt_keras.__file__, encoding="utf-8") as file:
        tree = ast.parse(file.read())
    imports = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom), ast.dump(statement)
                for alias in statement.names:
                    imports[alias.asname or alias.name] = statement.module
    return imports


def test_the_public_names_are_those_of_before_the_move():
    assert mpt_keras.__all__ == PUBLIC_NAMES


def test_each_public_name_is_imported_for_type_checkers_from_where_it_loads():
    imports = _type_checking_imports()
    assert sorted(imports) == PUBLIC_NAMES
    for name, module in imports.items():
        assert getattr(importlib.import_module(module), name) is getattr(mpt_keras, name), name


def test_the_package_and_its_config_load_without_tensorflow():
    code = (
        "import sys, mpt_keras, mpt_keras.config\n"
        "mpt_keras.TrainConfig, mpt_keras.LossScaleSettings, mpt_keras.resolve_config\n"
        "print(sorted({'tensorflow', 'keras'} & {m.partition('.')[0] for m in sys.modules}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(mpt_keras.__file__)),
    )
    assert result.stdout.strip() == "[]"
