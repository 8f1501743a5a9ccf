"""Peak device memory per interval, from TensorFlow's allocator statistics."""

from __future__ import annotations

import tensorflow as tf


def tracking_devices() -> list[str]:
    """The logical devices that keep memory statistics (`"CPU:0"`, `"GPU:0"`)."""
    devices = []
    for device in tf.config.list_logical_devices():
        name = device.name.removeprefix("/device:")
        try:
            tf.config.experimental.get_memory_info(name)
        except ValueError:
            continue  # This device does not track its memory.
        devices.append(name)
    return devices


def reset_peaks(devices: list[str]) -> None:
    for device in devices:
        tf.config.experimental.reset_memory_stats(device)


def peaks_mib(devices: list[str]) -> dict[str, float]:
    """Each device's peak since its last reset, in MiB."""
    return {
        device: tf.config.experimental.get_memory_info(device)["peak"] / 2**20 for device in devices
    }
