"""Promotion: moving layers one step up the precision ladder, mid-run.

The ladder is `names.promoted_policy`: a float8 layer (`float8_from_<policy>`)
goes to the policy it computes in otherwise, then `names.PROMOTIONS`:
mixed_float16 -> mixed_bfloat16 (float32's exponent range, so nothing
overflows at float16's 65504) -> float32. A layer
is promoted by a rule for its exact path (`re.escape`d, so a name such as
`mlp.up` matches that layer alone) put first in the manifest, where the first
matching rule wins; the manifest is applied to the model and a compiled
model's train function rebuilt, so that the next step is traced with the new
dtypes while weights and optimizer state are kept.

Every promotion goes through `promote`: the divergence action `promote`
(`mpt_keras.runs.training`) promotes every layer below float32, `AutoPromote` the
layers that keep overflowing.

Example:

    manifest, promotions = promote(model, manifest, reason="diverged at step 40")
    promotions  # (Promotion(path='dense', old='mixed_float16', new='mixed_bfloat16'),)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable

import keras

from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.manifest import PrecisionManifest, Rule
from mpt_keras.precision.names import promoted_policy
from mpt_keras.precision.policies import effective_policy


@dataclasses.dataclass(frozen=True)
class Promotion:
    """One layer moved one step up the ladder.

    Attributes:
        path: The layer's path (`layer_paths.iter_layers`).
        old: The policy it computed with.
        new: The policy it computes with now.
    """

    path: str
    old: str
    new: str


def promote(
    model: keras.Model,
    manifest: PrecisionManifest,
    reason: str | Callable[[Promotion], str],
    paths: Iterable[str] | None = None,
) -> tuple[PrecisionManifest, tuple[Promotion, ...]]:
    """Moves layers of `model` one step up the ladder; see the module docstring.

    Args:
        model: The model `manifest` was applied to.
        manifest: Its manifest.
        reason: The reason of each new rule, or a function of the promotion
            that returns it.
        paths: The paths of the layers to promote; a layer already float32
            is left as it is. `None`: every layer below float32.

    Returns:
        The new manifest, applied to `model`, and the promotions, in the order
        of `paths` (default: the layers' depth-first order). With nothing to
        promote, `manifest` as it was, not applied again.

    Raises:
        UserInputError: For a path that is no layer of `model`.
    """
    policies = {path: effective_policy(layer).name for path, layer in iter_layers(model)}
    paths = tuple(policies if paths is None else paths)
    for path in paths:
        if path not in policies:
            raise UserInputError(
                f"promote: model '{model.name}' has no layer '{path}'. Allowed: the paths "
                "of its layers (layer_paths.iter_layers)"
            )
    promotions = tuple(
        Promotion(path, policies[path], promoted_policy(policies[path]))
        for path in paths
        if promoted_policy(policies[path]) is not None
    )
    if not promotions:
        return manifest, ()
    rules = tuple(
        Rule(
            promotion.new,
            path=re.escape(promotion.path),
            reason=reason if isinstance(reason, str) else reason(promotion),
        )
        for promotion in promotions
    )
    manifest = dataclasses.replace(manifest, rules=(*rules, *manifest.rules))
    manifest.apply(model)
    if model.compiled:
        model.make_train_function(force=True)
    return manifest, promotions
