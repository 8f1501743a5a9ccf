"""The docs run: every fenced code block of README.md and docs/*.md is executed.

Each block is one test case, named after its page and the line of its
opening fence (`README.md:70`, `docs/precision.md:176`), so an example cannot
go stale without a test failing. What a block's language means here:

- ```python: executed. A page's python blocks run in order in one namespace,
  as a reader runs them in one session; Keras' state (the global policy, the
  layer names given) is reset after the page's last one, not between them.
  Selected alone, a block runs the page's earlier ones first; after one
  fails, the later ones fail naming it. A python block whose first line names
  a file of the repository (`# examples/user_models.py`) is an excerpt of it:
  each of its other lines must be a line of that file, in order (`...`
  stands for lines left out); it is compared, not executed.
- ```bash, ```shell, ```sh: each line is a command (a trailing backslash
  continues it), or several joined by `&&`. `mpt-train`, `mpt-calibrate`,
  `mpt-validate`, `mpt-bench` and `python -m trainers.<name>` run in this
  process (`launchers.launch_in_process`, rather than a new Python importing
  TensorFlow for each command) and must exit 0. Any other command fails the test,
  naming it.
- ```console: the lines starting with `$ ` are commands, as above; the lines
  after one are what it prints: each must be a line of its stdout, in order
  (`...` stands for lines left out).
- ```json: parsed. A manifest (it has a `version`) must be accepted by
  `mpt_keras.PrecisionManifest.from_dict`, anything else, as a config, by
  `mpt_keras.TrainConfig.from_dict`; a config section shown on its own
  (`"data": {...}`) is read inside braces.

Where they run: each shell block, and each page's python session, in a fresh
temporary directory holding copies of `configs/` and `examples/` (what the
examples name, relative to the repository root), so that what they write
(`runs/...`) lands there; a command argument naming an absolute path fails
the test, since what it writes would land outside. TFDS' default data
directory is the test session's (the `tfds_dir` fixture), not the home
directory's.

Two overrides, so that the whole file takes about a minute: an `mpt-train`
that sets no `--steps` runs with `--steps=2` appended. Those examples train a
config's full run (the Transformer's 400 steps); two steps take the same
flags, files, assembly, checkpoints and outputs. `mpt-validate`
keeps its steps: its gate means something only over them. And an `mpt-train`
that does not set `--saved_model` writes none (`--nosaved_model`): the
export traces the model once more, and tests/test_runs_training.py tests it.

What is not run, and why (each reported as skipped, with the reason):

- In a line of commands joined by `&&`, the parts that set up an environment
  (`python3 -m venv`, `. .venv/bin/activate`, `pip install`): they would
  install into the one these tests run in; and `python -m pytest`, this
  suite. The rest of the line runs: the `mpt-train` of the README's first
  command. `.ci/run` runs the second command as it stands in the README, and
  `tests/test_build.py` checks both against it.
- `tensorboard`: it serves until it is stopped; `tests/test_telemetry_monitor.py`
  reads the event files it would show.
- ```yaml: Prometheus' own configuration, which nothing of ours reads.
- docs/benchmarks.md, whole (`_PAGES_NOT_RUN` says why).
- A block marked on the line above its fence with
  `<!-- docs-test: skip (reason) -->`: it cannot run as written (a second
  machine, a second terminal, a long run).
- A block that repeats an earlier one (the README's tour repeats some of the
  pages'): a shell block with the same lines, or a python block alone in its
  page's session with the same code as one opening another page's. It is
  tested once, where it comes first.

Blocks with no language, or ```text, are output, listings and synopses:
never run. So that a command cannot escape by a missing language, an
unlabelled block may hold no line that starts with a launcher
(`test_no_command_hides_in_an_unlabelled_block`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import pathlib
import re
import shlex
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import keras
import pytest
from launchers import LAUNCHERS, launch_in_process

import mpt_keras

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = (
    "README.md",
    *sorted(os.path.relpath(path, REPO) for path in glob.glob(f"{REPO}/docs/*.md")),
)
_PAGES_NOT_RUN = {
    "docs/benchmarks.md": "its commands run the benchmarks, minutes each on this machine; "
    "tests/test_bench.py and tests/test_stack_ablation.py run them small",
}
_LANGUAGES_NOT_RUN = {"yaml": "Prometheus' own configuration, which nothing of ours reads"}
_SHELLS = ("bash", "shell", "sh", "console")
# A command line holding one of these is not run: (its words, why).
_COMMANDS_NOT_RUN = (
    (("python3", "-m", "venv"), "sets up an environment: .ci/run runs the README's setup"),
    (("pip", "install"), "installs into the tests' environment: .ci/run runs the README's setup"),
    (
        ("tensorboard",),
        "serves until stopped; tests/test_telemetry_monitor.py reads its event files",
    ),
    ((".",), "activates the environment these tests run in"),
    (("python", "-m", "pytest"), "is this test suite, which .ci/run runs"),
)
# Appended to an `mpt-train` that sets no `--steps`, no `--saved_model` (see above).
_TRAIN_STEPS = "--steps=2"
_NO_SAVED_MODEL = "--nosaved_model"
# What the examples name, relative to the repository root: copied where they run.
_WORKSPACE_DIRECTORIES = ("configs", "examples")
_MODULES = {module: program for program, module in LAUNCHERS.items()}
_FENCE = re.compile(r"```(\S*)")
_MARK = re.compile(r"<!-- docs-test: skip \((.+)\) -->")
# A line of an unlabelled block that would be a command to run.
_COMMAND_LINE = re.compile(r"(\$ )?(mpt-(train|calibrate|validate|bench)|python -m \w+\.\w+) ")


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced code block of a page.

    Attributes:
        page: The page's path from the repository root.
        line: The line of its opening fence, from 1.
        language: What follows the opening fence ("" for none).
        text: Its lines, each ending in a newline.
        skip: The reason of a `docs-test: skip` mark above its fence, or None.
    """

    page: str
    line: int
    language: str
    text: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def read_blocks(page: str) -> list[Block]:
    """The fenced code blocks of `page`, in order."""
    lines = _read(page).splitlines()
    blocks, opening = [], None
    for number, line in enumerate(lines, start=1):
        if not _FENCE.fullmatch(line):
            continue
        if opening is None:
            opening = number
            continue
        mark = _MARK.fullmatch(lines[opening - 2]) if opening > 1 else None
        language = _FENCE.fullmatch(lines[opening - 1]).group(1)
        text = "".join(f"{line}\n" for line in lines[opening : number - 1])
        blocks.append(Block(page, opening, language, text, mark and mark.group(1)))
        opening = None
    return blocks


def _read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as file:
        return file.read()


_BLOCKS = [block for page in PAGES for block in read_blocks(page)]
_RUNNABLE = [block for block in _BLOCKS if block.language not in ("", "text")]


# What runs ------------------------------------------------------------------------------


def _excerpted_file(block: Block) -> str | None:
    """The repository file a python block is an excerpt of (its first line names it)."""
    first = block.text.partition("\n")[0]
    path = first.removeprefix("# ")
    return path if path != first and os.path.isfile(os.path.join(REPO, path)) else None


def _session_blocks(page: str) -> list[Block]:
    """The python blocks of `page` that its session runs, in order."""
    return [
        block
        for block in _RUNNABLE
        if block.page == page
        and block.language == "python"
        and not (block.skip or block.page in _PAGES_NOT_RUN or _excerpted_file(block))
    ]


def _tested_at(block: Block) -> Block:
    """The first block that runs as `block` does, with the same text: maybe `block`."""
    if block.language in _SHELLS:
        alike = [other for other in _RUNNABLE if other.language in _SHELLS and not other.skip]
    elif _session_blocks(block.page) == [block]:
        # The first of a session runs as a session of one: from an empty namespace.
        alike = [_session_blocks(page)[0] for page in PAGES if _session_blocks(page)]
    else:
        return block
    return next((other for other in alike if other.text == block.text), block)


def _why_not_run(block: Block) -> str | None:
    if block.page in _PAGES_NOT_RUN:
        return f"{block.page}: {_PAGES_NOT_RUN[block.page]}"
    if block.skip:
        return block.skip
    if block.language in _LANGUAGES_NOT_RUN:
        return f"{block.language}: {_LANGUAGES_NOT_RUN[block.language]}"
    if _tested_at(block) is not block:
        return f"the same as {_tested_at(block).id}, which stands for both"
    return None


# Python --------------------------------------------------------------------------------


@dataclasses.dataclass
class _Session:
    """A page's python blocks, run in one namespace as a reader runs them."""

    directory: str
    namespace: dict[str, Any] = dataclasses.field(default_factory=dict)
    blocks_run: int = 0
    failed: str | None = None


_SESSIONS: dict[str, _Session] = {}


def _run_python(block: Block, session: _Session) -> None:
    """Runs the session's blocks up to `block` that have not run yet."""
    blocks = _session_blocks(block.page)
    for earlier in blocks[session.blocks_run : blocks.index(block) + 1]:
        if session.failed:
            pytest.fail(f"{earlier.id} needs {session.failed}, which failed", pytrace=False)
        # Blank lines first, so that a traceback gives the page's line numbers.
        code = compile("\n" * earlier.line + earlier.text, os.path.join(REPO, earlier.page), "exec")
        session.failed = earlier.id
        with _working_directory(session.directory):
            exec(code, session.namespace)
        session.failed, session.blocks_run = None, session.blocks_run + 1


def _check_excerpt(block: Block) -> None:
    path = _excerpted_file(block)
    _expect_lines(block.text.splitlines()[1:], _read(path), path)


@pytest.fixture(autouse=True)
def _restore_keras_state(request: pytest.FixtureRequest) -> Iterator[None]:
    """conftest's, but a page's python session keeps Keras' state to its last block.

    The precision page's examples rely on it, as a reader's session does: a
    model is named `gpt2_backbone_1` because the block before built one.
    """
    yield
    block = getattr(request.node, "callspec", None) and request.node.callspec.params["block"]
    if block is None or _why_not_run(block) or _excerpted_file(block):
        return
    if block.language == "python":
        if block != _session_blocks(block.page)[-1]:
            return  # The page's session goes on.
        _SESSIONS.pop(block.page, None)
    elif block.language not in _SHELLS:
        return  # JSON leaves Keras as it was.
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session(free_memory=False)


# Shell ---------------------------------------------------------------------------------


def _command_lines(block: Block) -> list[tuple[str, list[str]]]:
    """The block's command lines, each with the lines it is shown to print."""
    if block.language != "console":
        lines = block.text.replace("\\\n", " ").splitlines()
        return [(line, []) for line in lines if line.strip()]
    commands: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif line.strip():
            commands[-1][1].append(line.rstrip())
    return commands


def _chained(words: list[str]) -> list[list[str]]:
    """The commands of a line, split at `&&`."""
    commands: list[list[str]] = [[]]
    for word in words:
        if word == "&&":
            commands.append([])
        else:
            commands[-1].append(word)
    return commands


def _not_run(words: list[str]) -> str | None:
    """Why a command line is not run, or None to run it."""
    for start, reason in _COMMANDS_NOT_RUN:
        for index in range(len(words)):
            if tuple(words[index : index + len(start)]) == start:
                return f"`{' '.join(start)}` {reason}"
    return None


def _launcher(words: list[str], block: Block) -> tuple[str, list[str]]:
    """The launcher a command runs, and its arguments as the runner passes them."""
    if words[0] in LAUNCHERS:
        program, argv = words[0], words[1:]
    elif words[:2] == ["python", "-m"] and words[2] in _MODULES:
        program, argv = _MODULES[words[2]], words[3:]
    else:
        pytest.fail(
            f"{block.id}: cannot run `{shlex.join(words)}`: this runner runs "
            f"{', '.join(LAUNCHERS)} and python -m {', '.join(_MODULES)}; mark a block that "
            "cannot run as written with <!-- docs-test: skip (why) --> above its fence",
            pytrace=False,
        )
    for argument in argv:
        if argument.partition("=")[2].startswith("/"):
            pytest.fail(
                f"{block.id}: `{argument}` names an absolute path, outside the example's "
                "working directory: use a relative one (runs/...)",
                pytrace=False,
            )
    if program == "mpt-train" and not any(argument.startswith("--steps") for argument in argv):
        argv.append(_TRAIN_STEPS)
    if program == "mpt-train" and not any("saved_model" in argument for argument in argv):
        argv.append(_NO_SAVED_MODEL)
    return program, argv


def _expect_lines(shown: list[str], text: str, where: str) -> None:
    """Each shown line is a line of `text`, in order; `...` stands for lines left out."""
    lines = iter(line.rstrip() for line in text.splitlines())
    for line in shown:
        if line.strip() != "..." and line not in lines:  # Consumes `lines` up to the match.
            pytest.fail(f"{where} has no line {line!r} (in this order):\n{text}", pytrace=False)


def _run_shell(block: Block, directory: str) -> None:
    not_run, ran = [], False
    for line, shown in _command_lines(block):
        for command in _chained(shlex.split(line, comments=True)):
            reason = _not_run(command)
            if reason:
                not_run.append(reason)
                continue
            ran = True
            program, argv = _launcher(command, block)
            with _working_directory(directory), _sys_path_kept():
                launched = launch_in_process(program, *argv)
            if launched.status != 0:
                pytest.fail(
                    f"`{shlex.join(command)}` exited with {launched.status}:\n"
                    f"{launched.stderr[-4000:]}",
                    pytrace=False,
                )
            _expect_lines(shown, launched.stdout, f"what `{shlex.join(command)}` printed")
    if not_run and not ran:
        pytest.skip("; ".join(dict.fromkeys(not_run)))


@contextlib.contextmanager
def _sys_path_kept() -> Iterator[None]:
    """A launcher puts its working directory on `sys.path`, for the user's modules."""
    path = list(sys.path)
    try:
        yield
    finally:
        sys.path[:] = path


# JSON ----------------------------------------------------------------------------------


def _check_json(block: Block) -> None:
    text = block.text.strip()
    values = json.loads(text if text.startswith("{") else f"{{{text}}}")
    if "version" in values:
        mpt_keras.PrecisionManifest.from_dict(values, source=block.id)
    else:
        mpt_keras.TrainConfig.from_dict(values, source=block.id)


# The tests -----------------------------------------------------------------------------


@contextlib.contextmanager
def _working_directory(directory: str) -> Iterator[None]:
    previous = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(previous)


@pytest.fixture
def workspace(tmp_path: pathlib.Path) -> str:
    """A working directory like the repository root, with what the examples name."""
    for name in _WORKSPACE_DIRECTORIES:
        shutil.copytree(os.path.join(REPO, name), tmp_path / name)
    return str(tmp_path)


@pytest.fixture
def default_tfds_dir(tfds_dir: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """TFDS' default data directory, where the examples' configs read: the session's."""
    from tensorflow_datasets.core import constants

    monkeypatch.setattr(constants, "DATA_DIR", tfds_dir)
    return tfds_dir


@pytest.mark.parametrize(
    "block",
    [
        # A page's python session on one worker under xdist, so it runs once.
        pytest.param(block, marks=pytest.mark.xdist_group(f"docs:{block.page}"))
        if block.language == "python"
        else block
        for block in _RUNNABLE
    ],
    ids=lambda block: block.id,
)
def test_block(block: Block, request: pytest.FixtureRequest) -> None:
    reason = _why_not_run(block)
    if reason:
        pytest.skip(reason)
    if block.language == "json":
        _check_json(block)
    elif _excerpted_file(block):
        _check_excerpt(block)
    elif block.language == "python":
        request.getfixturevalue("default_tfds_dir")
        if block.page not in _SESSIONS:
            _SESSIONS[block.page] = _Session(request.getfixturevalue("workspace"))
        _run_python(block, _SESSIONS[block.page])
    elif block.language in _SHELLS:
        request.getfixturevalue("default_tfds_dir")
        _run_shell(block, request.getfixturevalue("workspace"))
    else:
        pytest.fail(f"{block.id}: no runner for ```{block.language}", pytrace=False)


def test_no_command_hides_in_an_unlabelled_block() -> None:
    hidden = [
        f"{block.id}: {line}"
        for block in _BLOCKS
        if block.language == "" and block.page not in _PAGES_NOT_RUN
        for line in block.text.splitlines()
        if _COMMAND_LINE.match(line)
    ]
    assert hidden == [], "label these blocks ```bash, or ```text if they are not to run"


def test_every_docs_test_mark_is_above_a_fence() -> None:
    marks = [
        f"{page}:{number}"
        for page in PAGES
        for number, line in enumerate(_read(page).splitlines(), start=1)
        if "docs-test" in line
    ]
    assert marks == [f"{block.page}:{block.line - 1}" for block in _BLOCKS if block.skip], (
        "write a mark as <!-- docs-test: skip (reason) --> on the line above a fence"
    )
