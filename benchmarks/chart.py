"""The suite's plot: achieved FLOP/s per variant against the measured matmul peaks.

Drawn with numpy and `mpt_keras.images.encode_png` in a built-in 3x5 pixel font (as
`mpt_keras.validation.loss_curves` draws), so the benchmarks need no plotting library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from mpt_keras.images import encode_png

# Each glyph: 5 rows of 3 pixels, a row as 3 binary digits.
_GLYPHS = {
    "A": "010 101 111 101 101",
    "B": "110 101 110 101 110",
    "C": "011 100 100 100 011",
    "D": "110 101 101 101 110",
    "E": "111 100 110 100 111",
    "F": "111 100 110 100 100",
    "G": "011 100 101 101 011",
    "H": "101 101 111 101 101",
    "I": "111 010 010 010 111",
    "J": "001 001 001 101 010",
    "K": "101 101 110 101 101",
    "L": "100 100 100 100 111",
    "M": "101 111 111 101 101",
    "N": "110 101 101 101 101",
    "O": "010 101 101 101 010",
    "P": "110 101 110 100 100",
    "Q": "010 101 101 110 011",
    "R": "110 101 110 101 101",
    "S": "011 100 010 001 110",
    "T": "111 010 010 010 010",
    "U": "101 101 101 101 111",
    "V": "101 101 101 101 010",
    "W": "101 101 111 111 101",
    "X": "101 101 010 101 101",
    "Y": "101 101 010 010 010",
    "Z": "111 001 010 100 111",
    "0": "111 101 101 101 111",
    "1": "010 110 010 010 111",
    "2": "110 001 010 100 111",
    "3": "110 001 010 001 110",
    "4": "101 101 111 001 001",
    "5": "111 100 110 001 110",
    "6": "011 100 111 101 111",
    "7": "111 001 010 010 010",
    "8": "111 101 111 101 111",
    "9": "111 101 111 001 110",
    ".": "000 000 000 000 010",
    "/": "001 001 010 100 100",
    "%": "101 001 010 100 101",
    "-": "000 000 111 000 000",
    ":": "000 010 000 010 000",
    "(": "010 100 100 100 010",
    ")": "010 001 001 001 010",
    "_": "000 000 000 000 111",
    "=": "000 111 000 111 000",
    ";": "000 010 000 010 100",
    " ": "000 000 000 000 000",
}
_SCALE = 2
_GLYPH_WIDTH = 4 * _SCALE  # 3 pixels and a space.
_ROW_HEIGHT = 9 * _SCALE
_LABEL_WIDTH = 200
_COLORS = {
    "float32": (31, 119, 180),
    "mixed_bfloat16": (255, 127, 14),
    "mixed_float16": (44, 160, 44),
}
_PEAK_COLORS = {"float32": (31, 119, 180), "bfloat16": (255, 127, 14), "float16": (44, 160, 44)}
_TEXT = (0, 0, 0)


def plot_throughput(
    bars: Sequence[tuple[str, str, float]], peaks: Mapping[str, float], width: int = 900
) -> bytes:
    """A horizontal bar per variant, with a vertical line per matmul peak, as PNG bytes.

    Args:
        bars: `(label, precision, GFLOP/s)` per variant, top to bottom; the
            precision picks the color.
        peaks: Matmul GFLOP/s per dtype, each a line in the dtype's color.
    """
    margin = 10
    top = margin + 2 * _ROW_HEIGHT  # Room for the title and the peaks' labels.
    height = top + (len(bars) + len(peaks) + 1) * _ROW_HEIGHT
    image = np.full((height, width, 3), 255, np.uint8)
    left, right = margin + _LABEL_WIDTH, width - margin - 120
    scale_max = max([*peaks.values(), *(value for _, _, value in bars), 1e-9])
    _text(image, margin, margin, "ACHIEVED GFLOP/S PER VARIANT; LINES: MATMUL PEAK")

    def x_of(value: float) -> int:
        return left + round((right - left) * value / scale_max)

    for index, (label, precision, value) in enumerate(bars):
        y = top + index * _ROW_HEIGHT
        _text(image, margin, y + _SCALE, label)
        image[y + 2 : y + _ROW_HEIGHT - 2, left : max(x_of(value), left + 1)] = _COLORS.get(
            precision, (128, 128, 128)
        )
        _text(image, x_of(value) + 4, y + _SCALE, f"{value:.1f}")
    bottom = top + len(bars) * _ROW_HEIGHT
    image[top - 2 : bottom + 2, left] = 160
    for row, (dtype, value) in enumerate(peaks.items()):
        x = x_of(value)
        image[top - 2 : bottom + 2, x] = _PEAK_COLORS.get(dtype, (128, 128, 128))
        _text(
            image,
            min(x, width - margin - 12 * _GLYPH_WIDTH),
            bottom + (row + 1) * _ROW_HEIGHT - _ROW_HEIGHT // 2,
            f"{dtype} {value:.0f}",
            _PEAK_COLORS.get(dtype, _TEXT),
        )
    return encode_png(image)


def _text(
    image: np.ndarray, x: int, y: int, text: str, color: tuple[int, int, int] = _TEXT
) -> None:
    """Draws `text` with its top left corner at (x, y), clipped to the image."""
    height, width, _ = image.shape
    for index, character in enumerate(text.upper()):
        glyph = _GLYPHS.get(character, _GLYPHS["-"])
        for row, bits in enumerate(glyph.split()):
            for column, bit in enumerate(bits):
                if bit == "1":
                    top = y + row * _SCALE
                    start = x + index * _GLYPH_WIDTH + column * _SCALE
                    if 0 <= top and top + _SCALE <= height and 0 <= start < width - _SCALE:
                        image[top : top + _SCALE, start : start + _SCALE] = color
