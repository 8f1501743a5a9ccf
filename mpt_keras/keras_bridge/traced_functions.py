"""A model's train, test and predict functions, which Keras traces once and keeps.

Keras makes `model.train_function` (and the test and predict ones) on the first `fit`,
`evaluate` or `predict` and reuses it: a layer's dtype policy or call changed afterwards is
not seen until the function is made again. Keras' own `Model.quantize` forgets them for
that reason; a manifest applied, or a layer promoted, forgets them here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras

_STEPS = ("train_step", "test_step", "predict_step")


def forget_traced_functions(model: keras.Model) -> None:
    """Makes the next `fit`, `evaluate` and `predict` of `model` trace its layers as they are now.

    The train function is made again at once rather than dropped: inside `fit` (a promotion
    from a callback) Keras calls `model.train_function` each step without making it first.
    A step set on the instance (the compile hook's, or the user's) is replaced by a copy: JAX
    keeps a trace by the function jitted, and a new `jax.jit` of the same step object ran the
    old trace. A class's step is a new bound method at each access, which JAX finds equal to
    the last one while the function jitted from that one lives: Keras drops its only
    reference here, as it makes the function again. (The float8 census lowers a copy too:
    `backend/jax/compiled.py`.)
    """
    for name in _STEPS:
        step = vars(model).get(name)
        if step is not None:
            setattr(model, name, fresh_copy(step))
    if model.train_function is not None:
        model.make_train_function(force=True)
    model.test_function = model.predict_function = None


def fresh_copy(step: Callable[..., Any]) -> functools.partial:
    """A new object calling what `step` calls, with its attributes (marks set on it), which JAX
    has never traced; a copy of a copy is as flat as the first."""
    if isinstance(step, functools.partial):
        copy = functools.partial(step.func, *step.args, **step.keywords)
    else:
        copy = functools.partial(step)
    copy.__dict__.update(getattr(step, "__dict__", {}))
    return copy
