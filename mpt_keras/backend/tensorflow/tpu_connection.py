"""The `tpu` strategy's connection with bounded waits: no TPU fails in seconds, not never.

Resolving a name asks the GCE metadata server and Cloud TPU API; a silent gRPC address blocks
without limit (measured: over 120 s). Two timeouts bound both.
"""

from __future__ import annotations

import socket
import threading
import urllib.parse
from typing import Any

import tensorflow as tf

from mpt_keras.backend.tensorflow.tf_errors import first_sentence
from mpt_keras.errors import UserInputError

TPU_RESOLVE_TIMEOUT_SECONDS = 30.0
TPU_CONNECT_TIMEOUT_SECONDS = 10.0


def tpu_strategy(address: str | None) -> tf.distribute.TPUStrategy:
    """Connects to the TPU at `address` (None: TPU_NAME) and makes its strategy.

    `UserInputError`: no TPU found there, with TF's reason.
    """
    where = f"at '{address}'" if address else "without an address"

    def not_found(reason: Any) -> UserInputError:
        return UserInputError(
            f"strategy 'tpu': no TPU found {where} ({first_sentence(reason)}). "
            "Allowed: a TPU address via --tpu, or another --strategy"
        )

    outcome: dict[str, Any] = {}

    def resolve() -> None:
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
            outcome["resolved"] = resolver, resolver.master()
        except Exception as error:  # Reported from the calling thread.
            outcome["error"] = f"{type(error).__name__}: {error}"

    # Daemon: a waiting lookup does not keep the process alive.
    thread = threading.Thread(target=resolve, name="mpt-resolve-tpu", daemon=True)
    thread.start()
    thread.join(TPU_RESOLVE_TIMEOUT_SECONDS)
    if thread.is_alive():
        raise not_found(f"no answer within {TPU_RESOLVE_TIMEOUT_SECONDS:g} s")
    if "error" in outcome:
        raise not_found(outcome["error"])
    resolver, master = outcome["resolved"]
    if master.startswith("grpc://"):
        endpoint = urllib.parse.urlsplit(master)
        try:
            socket.create_connection(
                (endpoint.hostname, endpoint.port), timeout=TPU_CONNECT_TIMEOUT_SECONDS
            ).close()
        except OSError as error:
            raise not_found(f"cannot connect to {master}: {error}") from None
    try:
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (tf.errors.OpError, ValueError, RuntimeError) as error:
        raise not_found(getattr(error, "message", error)) from None
    return tf.distribute.TPUStrategy(resolver)
