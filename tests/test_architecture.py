"""The house rules of docs/architecture.md, each checked here and each shown to catch a plant.

- Every module of `mpt_keras/`, `trainers/` and `benchmarks/` is at most
  `MAX_MODULE_LINES` long.
- Imports between the folders of `mpt_keras/` point one way, down `RANKS`:
  a module imports from its own folder or from a folder of lower rank.
  No circle of imports at load time.
- No module reaches another module's private (`_name`) names: neither
  `from mpt_keras.x import _y` nor `x._y` on an imported first-party module.
  A test file may reach the private names of the one module it is named after
  (`tests/test_runs_canary.py` and `mpt_keras/runs/canary.py`).
- Private Keras, TensorFlow and TFDS names (`keras.src`, `tensorflow.python`,
  `tf._x`, `tfds.core._x`) are touched only in `mpt_keras/compat/`.
- The docs name only tests that exist; the README stays a short tour.
"""

from __future__ import annotations

import ast
import itertools
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_PARTY = ("mpt_keras", "trainers", "benchmarks")
MAX_MODULE_LINES = 400
# The floors of the house, lowest first: a folder imports only from lower ones.
# Top-level modules of mpt_keras/ (errors, files, checks, tables) are the ground.
RANKS = {
    "": 0,
    "compat": 1,
    "keras_bridge": 2,
    "backend": 3,
    "precision": 4,
    "scaling": 5,
    "config": 6,
    "data": 7,
    "models": 7,
    "execution": 8,
    "telemetry": 8,
    "reliability": 9,
    "calibration": 10,
    "validation": 10,
    "runs": 11,
}
# Top-level names whose private attributes and submodules are the compat place's alone.
FOREIGN = ("keras", "tensorflow", "tensorflow_datasets")
FOREIGN_PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow_datasets.core")


def _python_files(*folders: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(root, name), REPO)
        for folder in folders
        for root, _, names in os.walk(os.path.join(REPO, folder))
        for name in names
        if name.endswith(".py")
    )


def _module_name(path: str) -> str:
    parts = path[: -len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_first_party(module: str) -> bool:
    return module.split(".")[0] in FIRST_PARTY


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a chain of names and attributes; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def private_reaches(path: str, repo: str = REPO) -> list[str]:
    """Each `module._name` that the file at `path` (relative to `repo`) reaches.

    Its own private names aside.
    """
    with open(os.path.join(repo, path), encoding="utf-8") as file:
        tree = ast.parse(file.read(), path)
    aliases: dict[str, str] = {}  # local name -> first-party module
    reaches = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_first_party(alias.name):
                    aliases[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not _is_first_party(node.module):
                continue
            for alias in node.names:
                if _is_private(alias.name):
                    reaches.append(f"{node.module}.{alias.name}")
                else:
                    # `from mpt_keras.backend import tensorflow as tf_backend`: a module, maybe.
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            base = _dotted(node.value)
            head, _, rest = (base or "").partition(".")
            if head in aliases:
                reaches.append(".".join(filter(None, (aliases[head], rest, node.attr))))
    own = _module_name(path)
    return sorted({reach for reach in reaches if reach.rsplit(".", 1)[0] != own})


def _tested_module(test_path: str) -> str:
    """The module whose private names `tests/test_<name>.py` may reach.

    `test_scaling_optimizer.py` tests `mpt_keras.scaling.optimizer`: each `_`
    of the name may stand for a folder's `/`.
    """
    parts = os.path.basename(test_path)[len("test_") : -len(".py")].split("_")
    for cuts in itertools.product(("_", "."), repeat=len(parts) - 1):
        dotted = parts[0] + "".join(cut + part for cut, part in zip(cuts, parts[1:]))
        path = os.path.join(REPO, "mpt_keras", *dotted.split("."))
        if os.path.exists(path + ".py") or os.path.exists(os.path.join(path, "__init__.py")):
            return f"mpt_keras.{dotted}"
    return f"benchmarks.{'_'.join(parts)}"


def module_size_problems(path: str, repo: str = REPO) -> list[str]:
    with open(os.path.join(repo, path), encoding="utf-8") as file:
        lines = file.read().count("\n")
    return (
        [f"{path}: {lines} lines (at most {MAX_MODULE_LINES})"] if lines > MAX_MODULE_LINES else []
    )


def _folder(module: str, repo: str) -> str:
    """`mpt_keras.scaling.optimizer` or `mpt_keras.scaling` -> `scaling`; top-level -> ``."""
    parts = module.split(".")
    is_folder = len(parts) > 1 and os.path.isdir(os.path.join(repo, "mpt_keras", parts[1]))
    return parts[1] if is_folder else ""


def _imported_modules(tree: ast.AST, path: str, repo: str) -> list[tuple[int, str, bool]]:
    """`(line, first-party module, at load time)` for each import in the tree."""
    at_load = {id(node) for node in getattr(tree, "body", []) if isinstance(node, ast.stmt)}
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.If, ast.Try)):
            at_load |= {id(child) for child in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                is_module = any(
                    os.path.exists(os.path.join(repo, *candidate.split(".")) + suffix)
                    for suffix in (".py", os.sep + "__init__.py")
                )
                names.append(candidate if is_module else node.module)
        for name in names:
            if name.split(".")[0] == "mpt_keras":
                found.append((node.lineno, name, id(node) in at_load))
    return found


def upward_imports(path: str, repo: str = REPO) -> list[str]:
    """Each import of `path` that reaches a folder of the same or a higher rank."""
    own = _module_name(path)
    with open(os.path.join(repo, path), encoding="utf-8") as file:
        tree = ast.parse(file.read(), path)
    problems = []
    for line, module, _ in _imported_modules(tree, path, repo):
        source, target = _folder(own, repo), _folder(module, repo)
        if own == "mpt_keras" or module == "mpt_keras" or source == target:
            continue
        if RANKS.get(target, 99) >= RANKS.get(source, -1):
            problems.append(f"{path}:{line} {source or 'mpt_keras'} -> {target} ({module})")
    return sorted(problems, key=lambda problem: int(problem.split(" ")[0].split(":")[1]))


def import_circles(repo: str = REPO) -> list[list[str]]:
    """Circles of load-time imports between the modules of `mpt_keras/`."""
    graph = {}
    for path in _python_files_in(repo, "mpt_keras"):
        with open(os.path.join(repo, path), encoding="utf-8") as file:
            tree = ast.parse(file.read(), path)
        graph[_module_name(path)] = {
            module for _, module, at_load in _imported_modules(tree, path, repo) if at_load
        }
    circles, done = [], set()

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            circles.append(trail[trail.index(module) :] + [module])
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            if target != "mpt_keras" and not module.startswith(target + "."):
                visit(target, trail + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return circles


def foreign_private_touches(path: str, repo: str = REPO) -> list[str]:
    """Private Keras, TensorFlow or TFDS names that `path` touches outside `mpt_keras/compat/`."""
    if path.startswith(os.path.join("mpt_keras", "compat") + os.sep):
        return []
    with open(os.path.join(repo, path), encoding="utf-8") as file:
        tree = ast.parse(file.read(), path)
    aliases, touches = {}, []
    for node in ast.walk(tree):
        modules = []
        if isinstance(node, ast.Import):
            modules = [
                (alias.name, alias.asname or alias.name.split(".")[0]) for alias in node.names
            ]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [(node.module, None)]
            for alias in node.names:
                if node.module.split(".")[0] in FOREIGN and _is_private(alias.name):
                    touches.append(f"{path}:{node.lineno} {node.module}.{alias.name}")
        for module, alias in modules:
            if module.split(".")[0] not in FOREIGN:
                continue
            if module.startswith(FOREIGN_PRIVATE_MODULES) and module not in FOREIGN_PRIVATE_MODULES:
                touches.append(f"{path}:{node.lineno} {module}")
            elif module in ("keras.src", "tensorflow.python"):
                touches.append(f"{path}:{node.lineno} {module}")
            if alias:
                aliases[alias] = module if alias != module.split(".")[0] else alias
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is None:
                continue
            head, *rest = dotted.split(".")
            if head in aliases and any(
                _is_private(part) or part in ("src", "python") for part in rest
            ):
                touches.append(f"{path}:{node.lineno} {dotted}")
    # `keras.src.utils` is one touch, not also `keras.src`.
    return sorted(
        touch
        for touch in set(touches)
        if not any(other.startswith(touch + ".") for other in touches)
    )


def _python_files_in(repo: str, *folders: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(root, name), repo)
        for folder in folders
        for root, _, names in os.walk(os.path.join(repo, folder))
        for name in names
        if name.endswith(".py")
    )


@pytest.mark.parametrize("path", _python_files(*FIRST_PARTY))
def test_no_module_reaches_another_modules_private_names(path):
    assert private_reaches(path) == []


@pytest.mark.parametrize("path", _python_files("tests"))
def test_a_test_file_reaches_only_its_own_modules_private_names(path):
    tested = _tested_module(path)
    assert [reach for reach in private_reaches(path) if not reach.startswith(tested + ".")] == []


@pytest.mark.parametrize("path", _python_files(*FIRST_PARTY))
def test_every_module_is_at_most_400_lines(path):
    assert module_size_problems(path) == []


@pytest.mark.parametrize("path", _python_files("mpt_keras"))
def test_imports_point_down_the_house(path):
    assert upward_imports(path) == []


def test_no_circle_of_imports_at_load_time():
    assert import_circles() == []


@pytest.mark.parametrize("path", _python_files(*FIRST_PARTY))
def test_private_keras_tensorflow_and_tfds_names_are_touched_only_in_compat(path):
    assert foreign_private_touches(path) == []


def test_the_check_finds_each_kind_of_reach(tmp_path):
    (tmp_path / "mpt_keras").mkdir()
    (tmp_path / "mpt_keras" / "user.py").write_text(
        "from mpt_keras.runs.training import _fit, run_training\n"
        "from mpt_keras import compat\n"
        "import mpt_keras.execution.xla\n"
        "import benchmarks.suite as suite\n"
        "compat._tf_optimizer_class()\n"
        "mpt_keras.execution.xla._xla_function\n"
        "suite._op_profile\n"
        "run_training._private_but_not_a_module_name\n"
        "__name__, compat.__doc__\n"
    )
    assert private_reaches(os.path.join("mpt_keras", "user.py"), str(tmp_path)) == [
        "benchmarks.suite._op_profile",
        "mpt_keras.compat._tf_optimizer_class",
        "mpt_keras.execution.xla._xla_function",
        "mpt_keras.runs.training._fit",
        "mpt_keras.runs.training.run_training._private_but_not_a_module_name",
    ]


def _plant(tmp_path, files: dict[str, str]) -> str:
    for path, source in files.items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source)
    return str(tmp_path)


def test_the_size_check_finds_a_long_module(tmp_path):
    repo = _plant(
        tmp_path, {"mpt_keras/runs/long.py": "x = 1\n" * 401, "mpt_keras/ok.py": "x = 1\n"}
    )
    assert module_size_problems("mpt_keras/runs/long.py", repo) == [
        "mpt_keras/runs/long.py: 401 lines (at most 400)"
    ]
    assert module_size_problems("mpt_keras/ok.py", repo) == []


def test_the_import_check_finds_an_upward_and_a_sideways_import(tmp_path):
    repo = _plant(
        tmp_path,
        {
            "mpt_keras/__init__.py": "",
            "mpt_keras/errors.py": "",
            "mpt_keras/scaling/__init__.py": "",
            "mpt_keras/scaling/optimizer.py": (
                "from mpt_keras.errors import UserInputError\n"
                "from mpt_keras.scaling import health\n"
                "def f():\n"
                "    from mpt_keras.telemetry import layout\n"
                "from mpt_keras.config.train_config import TrainConfig\n"
            ),
            "mpt_keras/scaling/health.py": "",
            "mpt_keras/telemetry/__init__.py": "",
            "mpt_keras/telemetry/layout.py": "from mpt_keras.execution import xla\n",
            "mpt_keras/execution/xla.py": "",
            "mpt_keras/config/train_config.py": "",
        },
    )
    assert upward_imports("mpt_keras/scaling/optimizer.py", repo) == [
        "mpt_keras/scaling/optimizer.py:4 scaling -> telemetry (mpt_keras.telemetry.layout)",
        "mpt_keras/scaling/optimizer.py:5 scaling -> config (mpt_keras.config.train_config)",
    ]
    assert upward_imports("mpt_keras/telemetry/layout.py", repo) == [
        "mpt_keras/telemetry/layout.py:1 telemetry -> execution (mpt_keras.execution.xla)"
    ]


def test_the_circle_check_finds_a_circle_at_load_time_only(tmp_path):
    repo = _plant(
        tmp_path,
        {
            "mpt_keras/__init__.py": "",
            "mpt_keras/a.py": "from mpt_keras import b\n",
            "mpt_keras/b.py": "import mpt_keras.a\n",
            "mpt_keras/c.py": "def f():\n    from mpt_keras import a\n",
        },
    )
    assert import_circles(repo) == [["mpt_keras.a", "mpt_keras.b", "mpt_keras.a"]]


def test_the_foreign_check_finds_each_kind_of_private_touch(tmp_path):
    source = (
        "import tensorflow as tf\n"
        "import keras\n"
        "from keras.src import backend\n"
        "from tensorflow.python.eager import context\n"
        "from tensorflow import _private\n"
        "tf.distribute._private_helper\n"
        "keras.src.utils\n"
        "keras.layers.Dense\n"
    )
    repo = _plant(tmp_path, {"mpt_keras/user.py": source, "mpt_keras/compat/ok.py": source})
    assert foreign_private_touches("mpt_keras/user.py", repo) == [
        "mpt_keras/user.py:3 keras.src",
        "mpt_keras/user.py:4 tensorflow.python.eager",
        "mpt_keras/user.py:5 tensorflow._private",
        "mpt_keras/user.py:6 tf.distribute._private_helper",
        "mpt_keras/user.py:7 keras.src.utils",
    ]
    assert foreign_private_touches("mpt_keras/compat/ok.py", repo) == []


def _named_tests() -> list[tuple[str, str, str]]:
    """Each `tests/test_x.py::name` (or a following `::name` of the same file) in the docs."""
    named = []
    for page in ["README.md"] + sorted(
        os.path.join("docs", name) for name in os.listdir(os.path.join(REPO, "docs"))
    ):
        with open(os.path.join(REPO, page), encoding="utf-8") as file:
            text = file.read()
        for line in text.splitlines():
            test_file = None
            for match in re.finditer(r"(tests/test_\w+\.py)?::(\w+)", line):
                test_file = match.group(1) or test_file
                if test_file:
                    named.append((page, test_file, match.group(2)))
    return named


@pytest.mark.parametrize(("page", "test_file", "name"), _named_tests())
def test_the_docs_name_only_tests_that_exist(page, test_file, name):
    with open(os.path.join(REPO, test_file), encoding="utf-8") as file:
        defined = {
            node.name
            for node in ast.walk(ast.parse(file.read()))
            if isinstance(node, ast.FunctionDef)
        }
    assert name in defined, f"{page} names {test_file}::{name}, which is not a test there"


def test_the_readme_is_a_short_tour():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as file:
        lines = file.read().count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move details to docs/"


# Only backend/tensorflow/ and compat/ import TensorFlow: JAX runs have none.
TENSORFLOW_OUTSIDE_BACKEND: list[str] = []


def _imports_tensorflow(path: str) -> bool:
    with open(os.path.join(REPO, path)) as file:
        tree = ast.parse(file.read())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        if any(name == "tensorflow" or name.startswith("tensorflow.") for name in names):
            return True
    return False


def test_tensorflow_is_imported_in_backend_tensorflow_and_compat_and_the_known_rest():
    outside = [
        path
        for path in sorted(_python_files("mpt_keras"))
        if not path.startswith(("mpt_keras/backend/tensorflow/", "mpt_keras/compat/"))
        and _imports_tensorflow(path)
    ]
    assert outside == TENSORFLOW_OUTSIDE_BACKEND
