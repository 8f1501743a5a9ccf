"""absl launchers: each parses its flags and calls one `mpt_keras` function.

    train.py        mpt-train
    validate.py     mpt-validate
    calibrate.py    mpt-calibrate
    bench.py        mpt-bench
    cli.py          what they share: one-line errors, exit codes, --help, a quiet TF import
    field_flags.py  flags declared from a dataclass's fields, read back by field
    backend_flag.py --backend: Keras' backend, set here before any launcher imports Keras

TensorFlow is imported once flags and config are checked (`cli.import_tensorflow`),
so `--help` and bad input answer at once; silently (`MPT_SHOW_TF_STARTUP=1` shows its
start-up lines), and with the BFC CPU allocator, the one that keeps the memory
statistics the monitor and `mpt-bench` read (`TF_CPU_ALLOCATOR_USE_BFC=false`: off).
"""

from trainers import backend_flag

backend_flag.select()
