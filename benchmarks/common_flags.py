"""The flags of the benchmarks run as modules (`python -m benchmarks.<name>`).

Apart from their modules, so that those can be imported together (as the tests do).
"""

from __future__ import annotations

from absl import flags

ROUNDS = flags.DEFINE_integer("rounds", 20, "Interleaved measurement rounds.", lower_bound=1)
STEPS_PER_ROUND = flags.DEFINE_integer(
    "steps_per_round", 10, "Train steps per round.", lower_bound=1
)
WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps", 10, "Untimed steps per variant before the rounds.", lower_bound=1
)
BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "LM sequences per batch.", lower_bound=1)
SEQUENCE_LENGTH = flags.DEFINE_integer(
    "sequence_length", 64, "LM tokens per sequence.", lower_bound=2
)
NUM_LAYERS = flags.DEFINE_integer("num_layers", 2, "LM Transformer blocks.", lower_bound=1)
D_MODEL = flags.DEFINE_integer("d_model", 64, "LM Transformer width.", lower_bound=8)
OUTPUT = flags.DEFINE_string("output", None, "Also write the result as JSON here.")
