"""diagnose_nonfinite on either backend: an Embedding whose table overflows float16.

Its inputs are integer ids, which hold no float: the report once said "no finite input"
there, as if the ids were NaN. It names the table's largest value instead.
"""

import keras
import numpy as np

from mpt_keras import NonfiniteReport, diagnose_nonfinite


def test_an_embedding_table_too_large_for_float16_is_named_by_its_weights():
    ids = keras.Input((3,), dtype="int32")
    embedding = keras.layers.Embedding(4, 2, dtype="mixed_float16", name="tokens")
    pooled = keras.layers.GlobalAveragePooling1D()(embedding(ids))
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(pooled))
    table = np.ones((4, 2), "float32")
    table[2] = [1e5, 3.0]  # 1e5 > 65504, the float16 maximum.
    embedding.set_weights([table])

    report = diagnose_nonfinite(model, np.array([[0, 1, 2]], "int32"))

    assert report == NonfiniteReport(
        first_layer="tokens", compute_dtype="float16", output_max=3.0, weight_max=1e5
    )
    assert (
        str(report) == "first non-finite output: tokens (float16), no float input, weight max 1e+05"
    )
    # Ids that miss the large row: finite.
    assert diagnose_nonfinite(model, np.array([[0, 1, 3]], "int32")) == NonfiniteReport()
