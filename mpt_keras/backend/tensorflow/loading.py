"""The one place datasets are loaded: TFDS splits, offline, as numpy arrays.

Nothing is downloaded: a missing dataset fails at once; embedded ones are prepared on first
use. Arrays hold a whole split (datasets that fit in RAM).
"""

import contextlib
import dataclasses
import fcntl
import io
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from tensorflow_datasets.core import naming

# Registers the embedded builders with TFDS.
from mpt_keras.backend.tensorflow import digits, python_source  # noqa: F401
from mpt_keras.checks import check_number
from mpt_keras.compat import tfds_progress
from mpt_keras.embedded_arrays import EMBEDDED_DATASETS, text_windows
from mpt_keras.errors import UserInputError, first_line

_ALLOWED_NAMES = f"Allowed: {', '.join(EMBEDDED_DATASETS)}, or any name in tfds.list_builders()."

# Off by default in tfds 4.9.10; set so a future default stays offline.
_OFFLINE = tfds.download.DownloadConfig(try_download_gcs=False)

_READ_BATCH = 4096


@dataclasses.dataclass(frozen=True)
class ClassificationData:
    """One image classification split in memory: `features` float32 [N, H, W, C] in [0, 1],
    `labels` int32 [N], `num_classes` of the whole dataset."""

    features: np.ndarray
    labels: np.ndarray
    num_classes: int


def load_split(name: str, split: str, data_dir: str | None) -> tf.data.Dataset:
    """Loads a TFDS split as raw example dicts, in stored order, offline.

    `name`: embedded or TFDS (optional `/config`, `:version`); `split`: e.g. "train[:10%]";
    `data_dir`: None for TFDS' default. `UserInputError`: the dataset unknown or not prepared
    in `data_dir`, the split missing or empty.
    """
    _prepared_builder(name, split, data_dir)
    return tfds.load(name, split=split, data_dir=data_dir, download=False)


def classification_arrays(name: str, split: str, data_dir: str | None) -> ClassificationData:
    """An image classification split in memory, images in [0, 1]: `name` has a fixed-shape
    uint8 `image` and a ClassLabel `label` (mpt_digits, mnist, cifar10); else UserInputError."""
    builder = _prepared_builder(name, split, data_dir)
    features = builder.info.features
    image, label = _feature(features, "image"), _feature(features, "label")
    if not (
        isinstance(image, tfds.features.Image)
        and image.np_dtype == np.uint8
        and None not in image.shape
        and isinstance(label, tfds.features.ClassLabel)
    ):
        raise UserInputError(
            f"Dataset {name!r} is not an image classification dataset: its "
            f"features are {_describe(features)}. Allowed: a dataset with a "
            "fixed-shape uint8 'image' Image and a 'label' ClassLabel, such as "
            "mpt_digits, mnist or cifar10."
        )
    dataset = tfds.load(name, split=split, data_dir=data_dir, download=False)
    pairs = dataset.map(lambda example: (example["image"], example["label"]))
    images, labels = _concatenate(tfds.as_numpy(pairs.batch(_READ_BATCH)))
    return ClassificationData(
        features=images.astype(np.float32) / 255.0,
        labels=labels.astype(np.int32),
        num_classes=label.num_classes,
    )


def language_model_windows(
    name: str, split: str, data_dir: str | None, sequence_length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Byte-level next-token windows `(inputs, targets)`, int32 [windows, sequence_length].

    The examples' UTF-8 `text`, joined by b"\\n", cut into non-overlapping windows of
    `sequence_length + 1` tokens; a partial tail is dropped. `UserInputError`: as
    `load_split`, no `text` feature, `sequence_length` < 1, or a split under one window.
    """
    check_number("sequence_length", sequence_length, minimum=1, integer=True)
    builder = _prepared_builder(name, split, data_dir)
    features = builder.info.features
    if not isinstance(_feature(features, "text"), tfds.features.Text):
        raise UserInputError(
            f"Dataset {name!r} has no text to model: its features are "
            f"{_describe(features)}. Allowed: a dataset with a 'text' Text "
            "feature, such as mpt_python_source or imdb_reviews."
        )
    dataset = tfds.load(name, split=split, data_dir=data_dir, download=False)
    texts = dataset.map(lambda example: example["text"]).batch(_READ_BATCH)
    return text_windows(
        [text for batch in tfds.as_numpy(texts) for text in batch], sequence_length, name, split
    )


def reference_shape(name: str, split: str, data_dir: str | None) -> str:
    """A dataset's reference shape: `"image"` (an image and a label) or `"text"`.

    `UserInputError`: as `load_split`, or neither (the config must then name the features).
    """
    features = _prepared_builder(name, split, data_dir).info.features
    if isinstance(_feature(features, "image"), tfds.features.Image) and isinstance(
        _feature(features, "label"), tfds.features.ClassLabel
    ):
        return "image"
    if isinstance(_feature(features, "text"), tfds.features.Text):
        return "text"
    raise UserInputError(
        f"Dataset {name!r} has neither an 'image' and 'label' nor a 'text': its features "
        f"are {_describe(features)}. Allowed: declare them with the config key "
        'data.features, such as {"x": "image", "y": "label"}'
    )


def feature_pairs(
    name: str, split: str, data_dir: str | None, features: Mapping[str, Any]
) -> tuple[tf.data.Dataset, dict[str, Any]]:
    """A TFDS split of any shape as unbatched `(x, y)` elements, as stored, and
    `{"num_classes": ...}` when `y` is a ClassLabel.

    `features`: `{"x": FEATURE, "y": FEATURE}`, or `{"x": {INPUT: FEATURE, ...}, "y": ...}`;
    UserInputError for a feature the dataset lacks.
    """
    stored = _prepared_builder(name, split, data_dir).info.features
    x, y = features["x"], features["y"]
    wanted = [y, *(x.values() if isinstance(x, Mapping) else [x])]
    missing = [feature for feature in wanted if _feature(stored, feature) is None]
    if missing:
        raise UserInputError(
            f"data.features: dataset {name!r} has no feature {missing[0]!r}. "
            f"Allowed: {_describe(stored)}"
        )
    dataset = tfds.load(name, split=split, data_dir=data_dir, download=False)
    if isinstance(x, Mapping):
        pairs = dataset.map(
            lambda example: ({key: example[value] for key, value in x.items()}, example[y])
        )
    else:
        pairs = dataset.map(lambda example: (example[x], example[y]))
    label = _feature(stored, y)
    dimensions = (
        {"num_classes": label.num_classes} if isinstance(label, tfds.features.ClassLabel) else {}
    )
    return pairs, dimensions


def _prepared_builder(name: str, split: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    """A prepared dataset's builder (embedded ones prepared here) having `split`."""
    builder = _builder(name, data_dir)
    if builder.name in EMBEDDED_DATASETS and not builder.is_prepared():
        builder = _prepare_embedded(name, data_dir, builder)
    elif not builder.is_prepared():
        root = builder.data_dir_root
        raise UserInputError(
            f"Dataset {name!r} is not prepared in {root} and cannot be "
            f"downloaded here: run `tfds build {name} --data_dir={root}` on a "
            "machine with network access and copy the directory here, or point "
            "data_dir (config key data.data_dir) at a directory where it is "
            "prepared."
        )
    splits = builder.info.splits
    try:
        num_examples = splits[split].num_examples
    except ValueError as error:
        raise UserInputError(
            f"Unknown split {split!r} for dataset {name!r}. Allowed: "
            f"{', '.join(splits)}, or a TFDS slice of them such as "
            f"'{next(iter(splits))}[:10%]'."
        ) from error
    if num_examples == 0:
        raise UserInputError(
            f"Split {split!r} of dataset {name!r} has no examples. Allowed: a "
            f"split or slice with at least one example among {', '.join(splits)}."
        )
    return builder


def _prepare_embedded(
    name: str, data_dir: str | None, builder: tfds.core.DatasetBuilder
) -> tfds.core.DatasetBuilder:
    """Prepares an embedded dataset once, under a file lock: a multi-worker run's workers
    share a data_dir and TFDS' final rename would race."""
    root = builder.data_dir_root
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f".{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        builder = _builder(name, data_dir)
        if not builder.is_prepared():
            # Under a second: no progress bars, and TFDS' two lines ("Downloading and
            # preparing ...") neither on stdout, the program's (`--dry_run`'s table), nor on
            # stderr, where an error that follows must be the one line.
            with tfds_progress.progress_bar_hidden(), contextlib.redirect_stdout(io.StringIO()):
                builder.download_and_prepare(download_config=_OFFLINE)
    return builder


def _builder(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    """The builder for `name`, refusing names that need the network."""
    try:
        dataset_name, _ = naming.parse_builder_name_kwargs(name)
    except ValueError as error:
        raise UserInputError(
            f"Unknown dataset {name!r}: not a TFDS dataset name. {_ALLOWED_NAMES}"
        ) from error
    if dataset_name.namespace:
        # Community datasets come from their hosts.
        raise UserInputError(
            f"Unknown dataset {name!r}: community datasets (namespace "
            f"{dataset_name.namespace!r}) need network access. {_ALLOWED_NAMES}"
        )
    try:
        return tfds.builder(name, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError as error:
        raise UserInputError(
            f"Unknown dataset {name!r}: not a TFDS dataset. {_ALLOWED_NAMES}"
        ) from error
    except (ValueError, AssertionError) as error:
        # A known dataset, an unknown config or version.
        reason = first_line(error) or type(error).__name__
        raise UserInputError(f"Invalid dataset {name!r}: {reason}") from error


def _feature(
    features: tfds.features.FeaturesDict, key: str
) -> tfds.features.FeatureConnector | None:
    return dict(features.items()).get(key)


def _describe(features: tfds.features.FeaturesDict) -> str:
    return ", ".join(f"{key} ({type(feature).__name__})" for key, feature in features.items())


def _concatenate(batches: Iterable[tuple[np.ndarray, ...]]) -> list[np.ndarray]:
    return [np.concatenate(parts) for parts in zip(*batches)]
