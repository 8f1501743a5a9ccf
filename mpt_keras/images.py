"""PNG encoding in NumPy and zlib: charts without TensorFlow or a plotting library."""

from __future__ import annotations

import struct
import zlib

import numpy as np

from mpt_keras.checks import refusal

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# PNG's colour type by channel count: grey, grey and alpha, RGB, RGBA.
_COLOR_TYPES = {1: 0, 2: 4, 3: 2, 4: 6}


def encode_png(image: np.ndarray) -> bytes:
    """An 8-bit `[height, width, channels]` image (1 to 4 channels) as PNG bytes."""
    if image.ndim != 3 or image.shape[2] not in _COLOR_TYPES or image.dtype != np.uint8:
        raise refusal("image", f"{image.dtype} {image.shape}", "uint8 [height, width, 1..4]")
    height, width, channels = image.shape
    # Each row prefixed by filter type 0 (none).
    rows = np.concatenate([np.zeros((height, 1), np.uint8), image.reshape(height, -1)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, _COLOR_TYPES[channels], 0, 0, 0)
    return b"".join(
        (
            _SIGNATURE,
            _chunk(b"IHDR", header),
            _chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)),
            _chunk(b"IEND", b""),
        )
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
