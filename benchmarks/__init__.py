"""Performance harnesses: ratios measured side by side in one process run.

suite             mpt-bench's suite: measure every variant, run (table, bench.json, plot)
suite_settings    its settings and the variants they select
measuring         builds, reads the memory of, times and profiles the variants
variant_memory    a variant's memory from TensorFlow's allocator statistics
variant_records   a variant's figures and ratios in the result
auto_choice       jit_compile="auto" against the better of XLA on and off
suite_report      the suite's text table and plot
chart             the plot's drawing (PNG, no plotting library)
workloads         what the suite trains: a reference model or a run config's
stacks            stock Keras and ours, piece by piece
float8_variants   the float8 twins: their layers, and emulated or native
flops             a train step's FLOPs from its traced graph
op_profile        the TensorFlow profiler's op times by category
matmul_peak       the matmul FLOP/s per dtype: the machine's limit
harness           reference models and data, FitLoop, interleaved timing, machine
stack_ablation    python -m benchmarks.stack_ablation: our stack piece by piece
ablation_table    the ablation's results file and its table
result_files      what run wrote a result (date, command, CPU flags)
float8_mlp        python -m benchmarks.float8_mlp: float8 MLP blocks against bfloat16 (JAX)
gpu_session       python -m benchmarks.gpu_session: issue 34's GPU measurements, one command
docs_tables       python -m benchmarks.docs_tables: docs/benchmarks.md's tables
common_flags      the flags of the benchmarks run as modules
"""
