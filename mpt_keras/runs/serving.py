"""What a run leaves to serve its model: a Keras file without mpt_keras, and a SavedModel.

A run's `model_dir` holds the trained model three ways, each for one use:

    model.keras     Resume or fine-tune with mpt_keras: float32 weights, each
                    layer's dtype policy, the optimizer with its state and
                    loss scale. Loading it needs mpt_keras (the optimizer is
                    `mpt_keras.LossScaleOptimizer`).
    serving.keras   (`SERVING_MODEL_FILE`, written by `save_for_serving`.) The
                    model alone: float32 weights and each layer's dtype
                    policy (Keras' own `DTypePolicy` or `DTypePolicyMap`), no
                    optimizer or compile state. `keras.saving.load_model`
                    loads it wherever Keras 3 (and the model's own code, for
                    custom layers) is installed, and it computes in the
                    precision it was trained in.
    saved_model/    (`SAVED_MODEL_DIR`, written by `export_saved_model`.) A
                    TensorFlow SavedModel of the forward pass, signature
                    `serve`, for TF Serving or `tf.saved_model.load`; it needs
                    neither Keras nor the model's Python code.

Example:

    save_for_serving(model, os.path.join(model_dir, SERVING_MODEL_FILE))
    export_saved_model(model, os.path.join(model_dir, SAVED_MODEL_DIR))
    # Elsewhere, without mpt_keras:
    served = keras.saving.load_model("model_dir/serving.keras")
    exported = tf.saved_model.load("model_dir/saved_model")  # Keep it: it owns the
    outputs = exported.serve(inputs)                          # variables serve reads.
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

from mpt_keras.precision.policies import global_policy
from mpt_keras.precision.report import LayerPrecision, precision_report

SERVING_MODEL_FILE = "serving.keras"
SAVED_MODEL_DIR = "saved_model"

# The parts of a `.keras` archive (Keras 3 `saving_lib`) that hold training state.
_CONFIG_ENTRY = "config.json"
_WEIGHTS_ENTRY = "model.weights.h5"
_OPTIMIZER_GROUP = "optimizer"
_PACKAGE = "mpt_keras"


class NotServableError(ValueError):
    """The model cannot be written as a Keras file that serves as trained without mpt_keras.

    Raised by `save_for_serving` when the model's config refers to mpt_keras,
    the written file does not load back, or a layer would compute in another
    dtype once loaded; nothing is written. `export_saved_model` serves such a
    model.

    Example:

        try:
            save_for_serving(model, os.path.join(model_dir, SERVING_MODEL_FILE))
        except NotServableError as error:
            logging.warning("No serving.keras: %s", error)
        export_saved_model(model, os.path.join(model_dir, SAVED_MODEL_DIR))
    """


def save_for_serving(model: keras.Model, path: str | os.PathLike) -> None:
    """Writes `model` to `path` as a `.keras` file that loads without mpt_keras.

    The file holds the model's config and float32 weights, and each layer's
    dtype policy, so the loaded model computes as it was trained; not the
    optimizer, its state or the compile config (loss, metrics).

    `model` is not touched (a trainer goes on using it): the model is saved
    whole with `model.save`, as Keras writes it, and the archive is then
    rewritten without `compile_config` and without the weights file's
    optimizer group. Detaching the optimizer from the model, or cloning the
    model, would change or rebuild the caller's object (and
    `keras.models.clone_model` does not clone subclassed models).

    Before the file replaces `path` (atomically; a reader sees the old file or
    the new one) it is checked: its config must name nothing of mpt_keras, and
    loaded back under the float32 global policy (a fresh process's) every layer
    must compute and keep its variables in the dtypes it has in `model`. (So
    for a moment the model is in memory twice.)

    Limitation: a subclassed model re-creates its layers in its own
    `__init__`, so its file keeps a layer's policy only if that `__init__`
    gives it (e.g. `dtype=self.dtype_policy` from the model's own policy); a
    per-layer manifest on a subclassed model fails the check. Serve such a
    model with `export_saved_model`, whose graph keeps every layer's dtypes.

    Args:
        model: A built model (functional, Sequential or subclassed), compiled
            or not.
        path: The file to write; must end in `.keras` (as Keras requires). Its
            directory must exist.

    Raises:
        NotServableError: If the model's config refers to mpt_keras (a layer
            of `mpt_keras.models`), the file does not load back, or a layer
            would compute in another dtype once loaded. The message names the
            model and the reference or layer.
        ValueError: If `path` does not end in `.keras` or the model is not
            built.
    """
    path = os.fspath(path)
    if not path.endswith(".keras"):
        raise ValueError(f"A serving model file must end in .keras. Received: path={path!r}")
    _check_built(model)
    with tempfile.TemporaryDirectory(
        dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}."
    ) as work:
        # Keras insists on the .keras suffix, so the temporary names keep it.
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

    Uses Keras' `model.export(..., format="tf_saved_model")`: the signature
    `serve` takes the model's inputs (their dtypes and shapes, batch size
    free) and returns its outputs, computed in each layer's dtypes as in
    `model`; the optimizer is not exported. Load it with
    `tf.saved_model.load(directory).serve(x)`, or point TF Serving at a
    version directory holding it.

    The export is written to a temporary directory beside `directory` and
    renamed into place, replacing an earlier export: a reader never sees a
    partial export. (A directory cannot be swapped atomically, so for an
    instant between two renames `directory` is absent; a crash there leaves the
    earlier export in a hidden `.<name>.*` directory beside it.)

    Args:
        model: A built model.
        directory: The SavedModel directory to write; its parent must exist.

    Raises:
        ValueError: If the model is not built.
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
    """Copies the `.keras` archive `source` to `target` without compile config or optimizer."""
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
    # The optimizer's variables sit in one top-level group, named after the
    # model's `optimizer` attribute; an uncompiled model never reads it.
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
    """Yields `(location, object config)` for each serialized object of mpt_keras in `value`."""
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
    # A process that loads the file has Keras' default global policy, float32.
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
    for before, after in itertools.zip_longest(trained, served):
        if before is None:
            raise NotServableError(
                f"Cannot save model '{model.name}' for serving: once loaded it has a layer "
                f"'{after.path}' ({after.layer_class}) that the trained model does not"
            )
        if after is None or _dtypes(after) != _dtypes(before):
            loaded_as = "is missing" if after is None else f"would compute in {_shown(after)}"
            raise NotServableError(
                f"Cannot save model '{model.name}' for serving: layer '{before.path}' "
                f"{loaded_as} once loaded, not {_shown(before)} as trained (a subclassed "
                "model must create it with its policy, e.g. dtype=self.dtype_policy; or "
                "serve the SavedModel of export_saved_model)"
            )


def _root_cause(error: BaseException) -> str:
    """`Type: first sentence` of the error that started `error`'s chain.

    Keras wraps a failing layer's error in one that prints the whole config.
    """
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    message = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {message.split('. ')[0]}"


def _dtypes(layer: LayerPrecision) -> tuple[str, str, str]:
    return layer.layer_class, layer.compute_dtype, layer.variable_dtype


def _shown(layer: LayerPrecision) -> str:
    return f"{layer.compute_dtype} ({layer.layer_class}, {layer.variable_dtype} variables)"


@contextlib.contextmanager
def _keras_variable_array_warning_ignored() -> Iterator[None]:
    # Keras 3.15.1 writes each variable of a `.keras` file with np.array(variable)
    # (keras/src/saving/saving_lib.py line 1470, H5IOStore.__setitem__, through
    # keras/src/backend/tensorflow/core.py line 172, convert_to_numpy), and its
    # Variable.__array__(self, dtype=None) (keras/src/backend/common/variables.py,
    # line 444) takes no `copy`, which NumPy 2 deprecates with a warning per
    # variable. Nothing a caller can act on; loading does not warn.
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="__array__ implementation doesn't accept a copy keyword",
            category=DeprecationWarning,
            module=r"keras\.src\.backend\.tensorflow\.core",
        )
        yield
