"""What a run leaves to serve its model: a Keras file without mpt_keras, and a SavedModel.

model.keras     resume or fine-tune with mpt_keras (the optimizer is ours)
serving.keras   the model alone, float32 weights, each layer's dtype policy: loads with
                just Keras 3, computing as trained
saved_model/    the forward pass as a TF SavedModel (`serve`): no Keras or model code
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from typing import Any

import h5py
import keras
import numpy as np

from mpt_keras import compat
from mpt_keras.errors import first_line
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.policies import global_policy
from mpt_keras.precision.report import LayerPrecision, precision_report

SERVING_MODEL_FILE = "serving.keras"
SAVED_MODEL_DIR = "saved_model"

# The `.keras` archive's parts (Keras 3 `saving_lib`) holding training state.
_CONFIG_ENTRY = "config.json"
_WEIGHTS_ENTRY = "model.weights.h5"
_OPTIMIZER_GROUP = "optimizer"
_PACKAGE = "mpt_keras"
_PROBE_ROWS = 8  # Rows of the probe input: one row alone may round the same both ways.


class NotServableError(ValueError):
    """No file would serve as trained without mpt_keras; nothing written (use
    `export_saved_model`)."""


def save_for_serving(model: keras.Model, path: str | os.PathLike) -> None:
    """Writes `model` to `path` (`.keras`, in an existing directory) loadable without mpt_keras.

    `model` is untouched: saved whole, rewritten without `compile_config` and the optimizer,
    replacing `path` atomically once it loads back (float32 global policy) with every layer's
    dtypes. A subclassed model's `__init__` must pass each layer's policy
    (`dtype=self.dtype_policy`); else use `export_saved_model`.

    Raises:
        NotServableError: The config refers to mpt_keras, the file does not load back, a
            layer would compute in another dtype, or, where a layer hands its outputs back
            to its block (`precision/hand_back.py`), the loaded model computes other outputs.
        ValueError: `path` does not end in `.keras`, or the model is not built.
    """
    path = os.fspath(path)
    if not path.endswith(".keras"):
        raise ValueError(f"A serving model file must end in .keras. Received: path={path!r}")
    _check_built(model)
    with tempfile.TemporaryDirectory(
        dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}."
    ) as work:
        # Keras insists on the .keras suffix.
        trained = os.path.join(work, "trained.keras")
        serving = os.path.join(work, "serving.keras")
        with _keras_variable_array_warning_ignored():
            model.save(trained)
        _strip_training_state(trained, serving, work, model.name)
        _check_loads_as_trained(model, serving)
        with open(serving, "rb") as file:
            os.fsync(file.fileno())
        os.replace(serving, path)


def export_saved_model(model: keras.Model, directory: str | os.PathLike) -> None:
    """Exports `model`'s forward pass as a TF SavedModel to `directory`, for TF Serving.

    `serve` takes the model's inputs (any batch size), computing in each layer's dtypes:
    `tf.saved_model.load(directory).serve(x)`; keep the loaded object (it owns the variables).
    Renamed into place, replacing an earlier export (a crash between the renames leaves that
    in a hidden `.<name>.*` beside it). The parent must exist; `ValueError` if not built.
    """
    directory = os.path.normpath(os.fspath(directory))
    _check_built(model)
    with tempfile.TemporaryDirectory(
        dir=os.path.dirname(directory) or ".", prefix=f".{os.path.basename(directory)}."
    ) as work:
        exported = os.path.join(work, "export")
        model.export(exported, format="tf_saved_model", verbose=False)
        if os.path.lexists(directory):
            # Into `work`, which is removed on exit.
            os.rename(directory, os.path.join(work, "previous"))
        os.rename(exported, directory)


def _check_built(model: keras.Model) -> None:
    if not model.built:
        raise ValueError(
            f"Model '{model.name}' is not built: call it on a batch or build it before "
            "saving it for serving"
        )


def _strip_training_state(source: str, target: str, work: str, model_name: str) -> None:
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(target, "w") as stripped:
        for entry in archive.infolist():
            if entry.filename == _CONFIG_ENTRY:
                config = json.loads(archive.read(entry))
                config.pop("compile_config", None)
                _check_no_mpt_keras(config, model_name)
                stripped.writestr(entry, json.dumps(config))
            elif entry.filename == _WEIGHTS_ENTRY:
                weights = archive.extract(entry, os.path.join(work, "trained"))
                kept = os.path.join(work, _WEIGHTS_ENTRY)
                _copy_without_optimizer(weights, kept)
                stripped.write(kept, entry.filename, compress_type=entry.compress_type)
            else:
                with archive.open(entry) as data, stripped.open(entry, "w") as copy:
                    shutil.copyfileobj(data, copy)


def _copy_without_optimizer(source: str, target: str) -> None:
    # The optimizer's variables: one top-level group an uncompiled model never reads.
    with h5py.File(source, "r") as weights, h5py.File(target, "w") as kept:
        kept.attrs.update(weights.attrs)
        for name in weights:
            if name != _OPTIMIZER_GROUP:
                weights.copy(weights[name], kept, name=name)


def _check_no_mpt_keras(config: dict[str, Any], model_name: str) -> None:
    found = next(_mpt_keras_references(config, ""), None)
    if found is None:
        return
    location, reference = found
    inner = reference.get("config")
    name = inner.get("name") if isinstance(inner, dict) else None
    raise NotServableError(
        f"Cannot save model '{model_name}' for serving: "
        f"{reference.get('registered_name') or reference.get('class_name')}"
        f"{f' {name!r}' if isinstance(name, str) else ''} (at {location or 'the top level'}) "
        "loads only where mpt_keras is installed; serve the SavedModel of "
        "export_saved_model instead"
    )


def _mpt_keras_references(value: Any, location: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """`(location, object config)` of each serialized mpt_keras object in `value`."""
    if isinstance(value, dict):
        module = value.get("module")
        registered = value.get("registered_name")
        if (isinstance(module, str) and module.split(".")[0] == _PACKAGE) or (
            isinstance(registered, str) and registered.startswith(_PACKAGE + ">")
        ):
            yield location, value
        for key, item in value.items():
            yield from _mpt_keras_references(item, f"{location}.{key}" if location else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _mpt_keras_references(item, f"{location}[{index}]")


def _check_loads_as_trained(model: keras.Model, path: str) -> None:
    # A loading process has Keras' default global policy, float32.
    with global_policy("float32"):
        try:
            loaded = keras.saving.load_model(path)
        except Exception as error:
            raise NotServableError(
                f"Cannot save model '{model.name}' for serving: the written file does not "
                f"load back ({_root_cause(error)})"
            ) from error
    trained = precision_report(model, trace=False).layers
    served = precision_report(loaded, trace=False).layers
    # A nested functional or Sequential model computes nothing in its own dtype (each of its
    # layers in theirs), and Keras saves none for a functional one: its dtype is not compared.
    graphs = frozenset(path for path, layer in iter_layers(model) if compat.runs_graph(layer))
    _check_dtypes_as_trained(model, trained, served, graphs)
    _check_outputs_without_hand_backs(model, loaded, trained)


def _check_dtypes_as_trained(
    model: keras.Model,
    trained: tuple[LayerPrecision, ...],
    served: tuple[LayerPrecision, ...],
    graphs: frozenset[str],
) -> None:
    for before, after in itertools.zip_longest(trained, served):
        if before is None:
            raise NotServableError(
                f"Cannot save model '{model.name}' for serving: once loaded it has a layer "
                f"'{after.path}' ({after.layer_class}) that the trained model does not"
            )
        if after is None or (
            after.layer_class != before.layer_class
            if before.path in graphs
            else _dtypes(after) != _dtypes(before)
        ):
            loaded_as = "is missing" if after is None else f"would compute in {_shown(after)}"
            raise NotServableError(
                f"Cannot save model '{model.name}' for serving: layer '{before.path}' "
                f"{loaded_as} once loaded, not {_shown(before)} as trained (a subclassed "
                "model must create it with its policy, e.g. dtype=self.dtype_policy; or "
                "serve the SavedModel of export_saved_model)"
            )


def _check_outputs_without_hand_backs(
    model: keras.Model, loaded: keras.Model, trained: tuple[LayerPrecision, ...]
) -> None:
    """A layer handing its outputs back to its block in another dtype (a float32 norm in a
    bfloat16 block: `precision/hand_back.py`) does so only with mpt_keras. Where the next
    layer casts them anyway (a pre-norm block) the loaded model computes the same outputs;
    where its block adds them with `+` (a post-norm block), not, or it fails on TensorFlow.
    So the two are run on one probe input: ones and Gaussians, a batch of `_PROBE_ROWS`, each
    other open dimension 1."""
    handing = [layer.path for layer in trained if layer.returns_dtype]
    if not handing:
        return
    named = ", ".join(f"'{path}'" for path in handing[:3]) + (" ..." if handing[3:] else "")
    refused = (
        f"Cannot save model '{model.name}' for serving: its layers {named} hand their outputs "
        "back to their blocks in the blocks' dtype, which only mpt_keras does"
    )
    advice = "; serve the SavedModel of export_saved_model"
    if not getattr(model, "inputs", None):
        raise NotServableError(f"{refused}, and a subclassed model has no inputs to probe{advice}")
    probe = keras.tree.map_structure(_probe_value, model.input)
    try:
        expected = keras.tree.flatten(model(probe, training=False))
    except Exception as error:
        raise NotServableError(
            f"{refused}, and the trained model fails on a probe input (ones and Gaussians, "
            f"a batch of {_PROBE_ROWS}, each other open dimension 1: {_root_cause(error)}){advice}"
        ) from error
    try:
        served = keras.tree.flatten(loaded(probe, training=False))
    except Exception as error:  # As a caller would meet it.
        raise NotServableError(
            f"{refused}: without it the loaded model fails ({_root_cause(error)}){advice}"
        ) from error
    for before, after in zip(expected, served, strict=True):
        before, after = (_as_float64(value) for value in (before, after))
        if not np.allclose(before, after, rtol=1e-6, atol=1e-6, equal_nan=True):
            raise NotServableError(
                f"{refused}: without it the loaded model computes other outputs{advice}"
            )


def _as_float64(tensor: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(tensor, "float32")), np.float64)


def _probe_value(tensor: keras.KerasTensor) -> Any:
    shape = tuple(
        (_PROBE_ROWS if axis == 0 else 1) if size is None else size
        for axis, size in enumerate(tensor.shape)
    )
    if keras.backend.is_float_dtype(tensor.dtype):
        values = np.random.default_rng(0).normal(size=shape).astype("float32")
        return keras.ops.convert_to_tensor(values, dtype=tensor.dtype)
    return keras.ops.ones(shape, tensor.dtype)


def _root_cause(error: BaseException) -> str:
    """`Type: first sentence` of the chain's root error (Keras' wrapper prints the config)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {first_line(error).split('. ')[0]}"


def _dtypes(layer: LayerPrecision) -> tuple[str, str, str]:
    return layer.layer_class, layer.compute_dtype, layer.variable_dtype


def _shown(layer: LayerPrecision) -> str:
    return f"{layer.compute_dtype} ({layer.layer_class}, {layer.variable_dtype} variables)"


@contextlib.contextmanager
def _keras_variable_array_warning_ignored() -> Iterator[None]:
    # Keras 3.15.1 saves with np.array(variable) (saving_lib.py, H5IOStore.__setitem__);
    # Variable.__array__ takes no `copy`, so NumPy 2 warns per variable: not actionable.
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="__array__ implementation doesn't accept a copy keyword",
            category=DeprecationWarning,
            module=r"keras\.src\.backend\.tensorflow\.core",
        )
        yield
