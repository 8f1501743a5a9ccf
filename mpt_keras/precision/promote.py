"""Promotion: moving layers one step up the precision ladder (`names.promoted_policy`), mid-run.

A rule for the layer's exact path (`re.escape`d) goes first in the manifest, which is applied
again; a compiled model's train function is rebuilt, so the next step traces the new dtypes
with weights and optimizer state kept.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

import keras

from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.names import promoted_policy
from mpt_keras.precision.policies import effective_policy
from mpt_keras.precision.rules import Rule


@dataclasses.dataclass(frozen=True)
class Promotion:
    """One layer (`path`, as `layer_paths.iter_layers`) moved from policy `old` to `new`."""

    path: str
    old: str
    new: str


def promote(
    model: keras.Model,
    manifest: PrecisionManifest,
    reason: str | Callable[[Promotion], str],
    paths: Iterable[str] | None = None,
    inputs: Any = None,
) -> tuple[PrecisionManifest, tuple[Promotion, ...]]:
    """Moves layers of `model` (which `manifest` was applied to) one step up the ladder.

    `paths`: the layers to promote (None: all; float32 ones are left). `reason`: each new
    rule's, or a function of its `Promotion`. `inputs`: as `PrecisionManifest.apply` takes
    them (a subclassed model's heads keep float32 by its call on them). Returns the new
    manifest, applied, and the promotions in the order of `paths` (none: `manifest`, not
    reapplied). Raises `UserInputError` for a path that is no layer of `model`.
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
    manifest.apply(model, inputs=inputs)  # Which also makes the train function again.
    return manifest, promotions
