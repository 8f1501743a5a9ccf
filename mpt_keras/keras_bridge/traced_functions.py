"""A model's train, test and predict functions, which Keras traces once and keeps.

Keras makes `model.train_function` (and the test and predict ones) on the first `fit`,
`evaluate` or `predict` and reuses it: a layer's dtype policy or call changed afterwards is
not seen until the function is made again. Keras' own `Model.quantize` forgets them for
that reason; a manifest applied, or a layer promoted, forgets them here.
"""

from __future__ import annotations

import keras


def forget_traced_functions(model: keras.Model) -> None:
    """Makes the next `fit`, `evaluate` and `predict` of `model` trace its layers as they are now.

    The train function is made again at once rather than dropped: inside `fit` (a promotion
    from a callback) Keras calls `model.train_function` each step without making it first.
    """
    if model.train_function is not None:
        model.make_train_function(force=True)
    model.test_function = model.predict_function = None
