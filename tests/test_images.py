"""`images.encode_png`: what TensorFlow's PNG decoder reads back pixel for pixel."""

import numpy as np
import pytest
import tensorflow as tf

from mpt_keras.errors import UserInputError
from mpt_keras.images import encode_png


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
def test_tensorflow_decodes_the_same_pixels(channels):
    image = np.random.default_rng(channels).integers(0, 256, (5, 7, channels), dtype=np.uint8)
    np.testing.assert_array_equal(tf.io.decode_png(encode_png(image)).numpy(), image)


def test_anything_but_an_8_bit_image_is_one_line():
    with pytest.raises(UserInputError) as raised:
        encode_png(np.zeros((4, 4, 3), np.float32))
    assert str(raised.value) == (
        "image: received float32 (4, 4, 3). Allowed: uint8 [height, width, 1..4]"
    )
