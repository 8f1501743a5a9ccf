"""absl launchers: each parses its flags and calls one `mpt_keras` function.

A launcher imports TensorFlow only once its flags and config are checked
(`cli.import_tensorflow`), so `--help` and a bad flag or config answer at once.
That import silences TensorFlow's native start-up lines, so that a user error is
the only line a failing launcher prints (`MPT_SHOW_TF_STARTUP=1` shows them),
and makes TensorFlow allocate CPU memory with its BFC allocator, the one CPU
allocator that keeps statistics of every allocation
(`tf.config.experimental.get_memory_info`), which the monitor's
`peak_memory_mib` and `mpt-bench`'s memory figures read
(`TF_CPU_ALLOCATOR_USE_BFC=false` turns that off).
"""
