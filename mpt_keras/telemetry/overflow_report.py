"""What an interval's overflows touched (variables with new non-finite gradients), in words:
which layers overflowed, without reading per-variable counts.
"""

from __future__ import annotations


def new_nonfinite(before: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
    """Per variable path, non-finite steps since `before` (those with some)."""
    return {
        path: count - before.get(path, 0)
        for path, count in counts.items()
        if count > before.get(path, 0)
    }


def describe_overflow(
    new: dict[str, int], counts: dict[str, int], skipped: int, first: int, last: int
) -> tuple[str, str]:
    """The log line and the Markdown report of `skipped` overflows in steps `first`-`last`.

    `new`: the interval's `new_nonfinite`; `counts`: the run's so far, per variable path.
    """
    layers = ", ".join(sorted({_layer_of(path) for path in new}))
    line = (
        f"Step {last}: {skipped} of steps {first}-{last} skipped for non-finite gradients; "
        f"layers: {layers}; variables: {', '.join(sorted(new))}"
    )
    report = [
        f"**Step {last}**: {skipped} of steps {first}-{last} skipped for non-finite "
        f"gradients, in layers {layers}.",
        "",
        "| layer | variable | non-finite steps in the interval | in total |",
        "|---|---|---|---|",
        *(
            f"| {_layer_of(path)} | {path} | {count} | {counts[path]} |"
            for path, count in sorted(new.items())
        ),
    ]
    return line, "\n".join(report)


def _layer_of(variable_path: str) -> str:
    return variable_path.rpartition("/")[0] or variable_path
