"""What `mpt-bench` measures: its settings, checked at once, and the variants they select.

Apart from the measuring, so that launchers name the choices without measuring.
"""

from __future__ import annotations

import dataclasses

from benchmarks import float8_variants
from mpt_keras.checks import check_number, refusal
from mpt_keras.config import TrainConfig
from mpt_keras.precision.names import POLICY_NAMES

MODELS = ("transformer_lm", "cnn", "mlp")
XLA_SETTINGS = ("off", "on")
STACKS = ("ours", "stock")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the suite measures, and how long (mpt-bench's flags say each field).

    Attributes:
        models: Reference models, of `MODELS`; `None`: all of them, or none
            with `config`, a resolved run config to measure instead.
        config_name: The config's model's name in the variants' names (no `/`).
        batch_size, sequence_length, num_layers, d_model, image_batch_size:
            The reference models' sizes (a config has its own).

    Raises:
        UserInputError: For a bad field, naming it and what is allowed.
    """

    models: tuple[str, ...] | None = None
    config: TrainConfig | None = None
    config_name: str = "config"
    precisions: tuple[str, ...] = POLICY_NAMES
    xla: tuple[str, ...] = XLA_SETTINGS
    stacks: tuple[str, ...] = STACKS
    rounds: int = 10
    steps_per_round: int = 10
    warmup_steps: int = 10
    memory_steps: int = 3
    batch_size: int = 32
    sequence_length: int = 64
    num_layers: int = 2
    d_model: int = 64
    image_batch_size: int = 64
    matmul_size: int = 2048
    matmul_rounds: int = 5
    profile_steps: int = 0
    float8: bool = False

    def __post_init__(self):
        if self.config is not None:
            if not isinstance(self.config, TrainConfig):
                raise refusal(
                    "config",
                    type(self.config).__name__,
                    "a TrainConfig (mpt_keras.config.resolve_config)",
                )
            if self.models:
                raise refusal(
                    "models and config", "both", "reference models or a run config, not both"
                )
            if not self.config_name or "/" in self.config_name:
                raise refusal("config_name", repr(self.config_name), "a name without '/'")
            object.__setattr__(self, "models", ())
        elif self.models is None:
            object.__setattr__(self, "models", MODELS)
        for name, allowed in (
            ("models", MODELS),
            ("precisions", POLICY_NAMES),
            ("xla", XLA_SETTINGS),
            ("stacks", STACKS),
        ):
            values = tuple(getattr(self, name))
            object.__setattr__(self, name, values)
            unknown = [value for value in values if value not in allowed]
            empty = not values and not (name == "models" and self.config is not None)
            if unknown or empty or len(set(values)) != len(values):
                raise refusal(
                    name,
                    repr(unknown[0]) if unknown else str(list(values)),
                    f"one or more of {', '.join(allowed)}, each once",
                )
        for field in dataclasses.fields(self):
            if field.type == "int":
                minimum = 0 if field.name == "profile_steps" else 1
                check_number(field.name, getattr(self, field.name), minimum=minimum, integer=True)
        if self.float8 and not set(self.precisions) & set(float8_variants.PRECISIONS):
            raise refusal(
                "float8",
                f"with precisions {list(self.precisions)}",
                f"with {' or '.join(float8_variants.PRECISIONS)} among the precisions",
            )
        if self.d_model % 4:
            raise refusal("d_model", str(self.d_model), "a multiple of 4 (the attention heads)")

    @property
    def model_names(self) -> tuple[str, ...]:
        """The reference models, or `config_name`."""
        return self.models if self.config is None else (self.config_name,)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One measured configuration; `name` is its key in the result.

    `float8`: its Dense and EinsumDense layers train in float8.
    """

    model: str
    precision: str
    xla: str
    stack: str
    float8: bool = False

    @property
    def name(self) -> str:
        precision = self.precision + ("+float8" if self.float8 else "")
        return f"{self.model}/{precision}/xla_{self.xla}/{self.stack}"


def variants(settings: Settings) -> list[Variant]:
    """The variants `settings` selects, in measurement order (float8 ones after their twins)."""
    return [
        Variant(model, precision, xla_setting, stack, float8)
        for model in settings.model_names
        for precision in settings.precisions
        for float8 in (False, True)
        if not float8 or (settings.float8 and precision in float8_variants.PRECISIONS)
        for xla_setting in settings.xla
        for stack in settings.stacks
    ]
