"""The BUILD file mirrors the code: every module, launcher and test has its target."""

import ast
import configparser
import glob
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _targets():
    """`{name: (rule, srcs, deps)}` of the BUILD file (Starlark parses as Python)."""
    with open(os.path.join(REPO, "BUILD")) as file:
        tree = ast.parse(file.read())
    targets = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id.startswith("py_")
        ):
            arguments = {keyword.arg: keyword.value for keyword in node.keywords}
            name = ast.literal_eval(arguments["name"])
            srcs = ast.literal_eval(arguments["srcs"])
            deps = [
                element.value
                for element in getattr(arguments.get("deps"), "elts", [])
                if isinstance(element, ast.Constant)
            ]
            assert name not in targets, f"duplicate target {name}"
            targets[name] = (node.func.id, srcs, deps)
    return targets


def _python_files(*patterns):
    return {
        os.path.relpath(path, REPO)
        for pattern in patterns
        for path in glob.glob(os.path.join(REPO, pattern), recursive=True)
    }


def _launchers():
    """Files runnable as programs: the trainers and the benchmarks."""
    launchers = set()
    for path in _python_files("trainers/*.py", "benchmarks/*.py"):
        with open(os.path.join(REPO, path)) as file:
            if 'if __name__ == "__main__":' in file.read():
                launchers.add(path)
    return launchers


def test_every_module_has_exactly_one_target():
    owners = {}
    for name, (_, srcs, _) in _targets().items():
        for src in srcs:
            assert src not in owners, f"{src} is in targets {owners[src]} and {name}"
            owners[src] = name
    expected = _python_files(
        "mpt_keras/**/*.py",
        "trainers/*.py",
        "tests/**/*.py",
        "benchmarks/*.py",
        "examples/*.py",
    )
    assert sorted(expected - set(owners)) == [], "modules without a target"
    assert sorted(set(owners) - expected) == [], "targets of files that do not exist"


def test_launchers_are_binaries_and_tests_are_tests():
    rules = {src: rule for rule, srcs, _ in _targets().values() for src in srcs}
    assert _launchers(), "no launcher found"
    for launcher in _launchers():
        assert rules[launcher] == "py_binary", launcher
    for test in _python_files("tests/test_*.py"):
        assert rules[test] == "py_test", test
    for path, rule in rules.items():
        if rule == "py_binary":
            assert path in _launchers(), f"{path} is a py_binary but not a launcher"


def test_local_dependencies_exist():
    targets = _targets()
    for name, (_, _, deps) in targets.items():
        for dep in deps:
            assert dep.removeprefix(":") in targets, f"{name} depends on unknown {dep}"


def test_console_scripts_are_the_launchers():
    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO, "setup.cfg"))
    scripts = setup["options.entry_points"]["console_scripts"].strip().splitlines()
    modules = {line.split("=")[1].strip().split(":")[0] for line in scripts}
    trainers = {path for path in _launchers() if path.startswith("trainers/")}
    assert modules == {path.removesuffix(".py").replace("/", ".") for path in trainers}


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(REPO, "README.md")) as file:
        readme = file.read().splitlines()
    # The README opens with a ```bash block of exactly two commands.
    start = readme.index("```bash")
    end = readme.index("```", start + 1)
    commands = readme[start + 1 : end]
    assert len(commands) == 2
    with open(os.path.join(REPO, ".ci", "run")) as file:
        ci_lines = file.read().splitlines()
    assert ci_lines[-1] == commands[1]
    assert commands[0].endswith(
        "mpt-train --config=configs/digits_cnn.json --model_dir=runs/digits_cnn"
    )
