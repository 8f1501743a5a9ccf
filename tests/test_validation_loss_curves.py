"""Tests of mpt_keras.validation.loss_curves: the PNG of the two loss curves."""

import tensorflow as tf

from mpt_keras.validation.loss_curves import plot_loss_curves


def test_plot_draws_both_curves_in_their_colors():
    image = tf.io.decode_png(plot_loss_curves([2.0, 1.0], [2.0, float("nan")])).numpy()
    colors = {tuple(pixel) for pixel in image.reshape(-1, 3)}
    assert (31, 119, 180) in colors
    # The candidate's only finite point makes no segment.
    assert (255, 127, 14) not in colors
