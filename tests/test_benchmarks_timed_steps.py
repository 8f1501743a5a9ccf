"""benchmarks/timed_steps.py: warm-up steps untimed, the timed ones' figures, the last loss."""

from benchmarks import timed_steps


class _Model:
    """Counts its steps; each step's loss is its number."""

    def __init__(self):
        self.steps = 0

    def train_on_batch(self, x, y):
        self.steps += 1
        return self.steps


def test_timed_train_steps_times_only_the_steps_after_the_warm_up():
    model = _Model()
    timed = timed_steps.timed_train_steps(model, None, None, steps=3)
    assert model.steps == timed_steps.WARM_UP_STEPS + 3 == 5
    assert len(timed["step_ms"]) == 3
    assert timed["median_step_ms"] == sorted(timed["step_ms"])[1]
    assert timed["final_loss"] == 5.0
