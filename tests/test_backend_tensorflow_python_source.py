"""Tests for the `mpt_python_source` TFDS builder."""

import glob
import hashlib
import os
import sys

import pytest
import tensorflow_datasets as tfds

from mpt_keras import embedded_arrays


def _prepare(data_dir) -> dict[str, list[tuple[str, str]]]:
    builder = tfds.builder("mpt_python_source", data_dir=str(data_dir))
    builder.download_and_prepare()
    return {
        split: [
            (example["path"].decode(), example["text"].decode())
            for example in tfds.as_numpy(builder.as_dataset(split=split))
        ]
        for split in ("train", "validation")
    }


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    return _prepare(tmp_path_factory.mktemp("python_source"))


def _expected_files() -> list[str]:
    stdlib = os.path.dirname(os.__file__)
    return sorted(os.path.basename(path) for path in glob.glob(f"{stdlib}/*.py"))


def _in_validation(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest()[:16], 16) % 10 == 0


def test_splits_are_disjoint_and_cover_all_files(splits):
    train = [path for path, _ in splits["train"]]
    validation = [path for path, _ in splits["validation"]]
    assert not set(train) & set(validation)
    assert sorted(train + validation) == _expected_files()
    assert len(train) + len(validation) > 100


def test_split_membership_and_order_follow_the_documented_rule(splits):
    files = _expected_files()
    for split, in_validation in (("train", False), ("validation", True)):
        paths = [path for path, _ in splits[split]]
        assert paths == [f for f in files if _in_validation(f) == in_validation]
    assert len(splits["validation"]) > 0


def test_texts_are_the_files_and_non_empty(splits):
    stdlib = os.path.dirname(os.__file__)
    for split in ("train", "validation"):
        for path, text in splits[split]:
            assert text
            with open(os.path.join(stdlib, path), "rb") as source:
                assert text.encode() == source.read()


def test_description_records_python_version(tmp_path):
    info = tfds.builder("mpt_python_source", data_dir=str(tmp_path)).info
    assert f"Python {sys.version_info[0]}.{sys.version_info[1]}" in info.description


def test_two_preparations_are_identical(splits, tmp_path):
    assert _prepare(tmp_path) == splits


def test_invalid_utf8_is_replaced(tmp_path, monkeypatch):
    source_dir = tmp_path / "stdlib"
    source_dir.mkdir()
    (source_dir / "a.py").write_bytes(b"ok = 1\n")
    (source_dir / "f.py").write_bytes(b"bad = '\xff\xfe'\n")  # "f.py" is validation
    (source_dir / "notes.txt").write_bytes(b"not python\n")
    monkeypatch.setattr(embedded_arrays, "stdlib_dir", lambda: str(source_dir))
    splits = _prepare(tmp_path / "data")
    assert splits == {
        "train": [("a.py", "ok = 1\n")],
        "validation": [("f.py", "bad = '\ufffd\ufffd'\n")],
    }
