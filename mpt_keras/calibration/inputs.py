"""`calibrate`'s inputs, checked: the model or factory, the loss, the data as
`(x, y, sample_weight or None)` batches."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

from mpt_keras.checks import check_number, refusal
from mpt_keras.errors import UserInputError

_MODEL_ALLOWED = "a keras.Model, or a function of no arguments returning one"
_LOSS_ALLOWED = (
    "a keras.losses.Loss, a name of one, a function loss(y_true, y_pred), or a dict or list "
    "of those per output"
)
_DATA_ALLOWED = (
    "a tf.data.Dataset or another iterable of (x, y) or (x, y, sample_weight) batches, or a "
    "tuple (x, y) or (x, y, sample_weight) of arrays; x an array or a dict of arrays"
)


class _FunctionLoss(keras.losses.Loss):
    """A function `loss(y_true, y_pred)` as a Keras loss, which weighs and reduces."""

    def __init__(self, function: Callable[[Any, Any], Any]):
        super().__init__(name=getattr(function, "__name__", "loss"))
        self.function = function

    def call(self, y_true, y_pred):
        return self.function(y_true, y_pred)


class _LossPerOutput:
    """The losses of a model of several outputs, summed as `Model.compile` sums them (no
    loss weights): a dict by output name, a list by position, or one loss for each output."""

    def __init__(self, losses: Any):
        self.losses = losses

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        if isinstance(y_pred, dict):
            names = self.losses if isinstance(self.losses, dict) else y_pred
            terms = [(self._loss(name), y_true[name], y_pred[name]) for name in names]
        elif isinstance(y_pred, (list, tuple)):
            terms = [
                (self._loss(index), truth, prediction)
                for index, (truth, prediction) in enumerate(zip(y_true, y_pred, strict=True))
            ]
        else:
            terms = [(self.losses, y_true, y_pred)]
        values = [loss(truth, pred, sample_weight=sample_weight) for loss, truth, pred in terms]
        return functools.reduce(lambda total, value: total + value, values)

    def _loss(self, output: str | int) -> Any:
        if isinstance(self.losses, (dict, list, tuple)):
            return self.losses[output]
        return self.losses


def as_loss(loss: Any) -> Callable[..., Any]:
    """`loss(y_true, y_pred, sample_weight=None)`: a Keras loss, a name, a function wrapped as
    a Keras loss, or a dict or list of those per output (as `Model.compile` takes them)."""
    if isinstance(loss, dict):
        return _LossPerOutput(
            {name: _one_loss(each, f"loss[{name!r}]") for name, each in loss.items()}
        )
    if isinstance(loss, (list, tuple)):
        return _LossPerOutput(
            [_one_loss(each, f"loss[{index}]") for index, each in enumerate(loss)]
        )
    return _LossPerOutput(_one_loss(loss, "loss"))


def _one_loss(loss: Any, name: str) -> Any:
    if isinstance(loss, keras.losses.Loss):
        return loss
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)  # A class's name gives one; a function's, itself.
        except ValueError:
            raise refusal(name, repr(loss), _LOSS_ALLOWED) from None
        return _one_loss(loss, name)
    if callable(loss):
        return _FunctionLoss(loss)
    raise refusal(name, type(loss).__name__, _LOSS_ALLOWED)


def as_model(model_or_factory: Any) -> keras.Model:
    """The model, or the one its factory returns."""
    if isinstance(model_or_factory, keras.Model):
        return model_or_factory
    if not callable(model_or_factory):
        raise refusal("model_or_factory", type(model_or_factory).__name__, _MODEL_ALLOWED)
    model = model_or_factory()
    if not isinstance(model, keras.Model):
        raise UserInputError(
            f"model_or_factory: the factory returned {type(model).__name__}. "
            f"Allowed: {_MODEL_ALLOWED}"
        )
    return model


def batches(data: Any, steps: int, seed: int, batch_size: int) -> Iterator[tuple[Any, Any, Any]]:
    """`(x, y, sample_weight or None)` for each of `steps` batches; see `calibrate`'s `data`."""
    tensorflow = sys.modules.get("tensorflow")
    if tensorflow is not None and isinstance(data, tensorflow.data.Dataset):
        spec = data.element_spec
        if not (isinstance(spec, tuple) and len(spec) in (2, 3)):
            shape = f"{len(spec)}-tuples" if isinstance(spec, tuple) else type(spec).__name__
            raise UserInputError(f"data: the dataset yields {shape}. Allowed: {_DATA_ALLOWED}")
        yield from _iterated_batches(data.take(steps), steps)
        return
    if not isinstance(data, tuple) and hasattr(data, "__iter__"):
        # A generator of batches, such as a JAX run's stream.
        yield from _iterated_batches(data, steps)
        return
    if not (isinstance(data, tuple) and len(data) in (2, 3)):
        raise refusal("data", type(data).__name__, _DATA_ALLOWED)
    check_number("batch_size", batch_size, minimum=1, integer=True)
    arrays = keras.tree.map_structure(np.asarray, data)
    features, labels, *weights = arrays
    examples = {len(array) for array in keras.tree.flatten(features)}
    if len(examples) != 1:
        raise UserInputError(
            f"data: the arrays of x hold {' and '.join(map(str, sorted(examples)))} examples. "
            "Allowed: as many in each"
        )
    (count,) = examples
    label_counts = {len(array) for array in keras.tree.flatten(labels)}
    if not count or label_counts != {count}:
        raise refusal(
            "data",
            f"{count} examples and {' and '.join(map(str, sorted(label_counts)))} labels",
            "as many labels as examples (in each output's array), at least one",
        )
    if weights and len(weights[0]) != count:
        raise refusal(
            "data",
            f"{count} examples and {len(weights[0])} sample weights",
            "one weight per example",
        )
    order = np.random.default_rng(seed).permutation(count)
    # Wraps around when there are fewer than steps * batch_size examples.
    indices = np.resize(order, steps * batch_size).reshape(steps, batch_size)
    for batch in indices:
        yield (*keras.tree.map_structure(lambda array: array[batch], arrays), None)[:3]


def _iterated_batches(data: Any, steps: int) -> Iterator[tuple[Any, Any, Any]]:
    count = 0
    for element in data:
        if count == steps:
            break
        if not (isinstance(element, tuple) and len(element) in (2, 3)):
            what = (
                f"{len(element)}-tuples" if isinstance(element, tuple) else type(element).__name__
            )
            raise UserInputError(f"data: the batches are {what}. Allowed: {_DATA_ALLOWED}")
        count += 1
        yield (*element, None)[:3]
    if not count:
        raise UserInputError(f"data: the dataset yielded no batch. Allowed: {_DATA_ALLOWED}")
