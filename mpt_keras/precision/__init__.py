"""Precision: which dtype each layer computes in, who decided it, and moving it up.

    names.py     every allowed name: POLICY_NAMES, PRECISIONS (with `auto`),
                 RULE_POLICIES (with `float8`), LOW_PRECISION_POLICIES,
                 COMPUTE_DTYPES, the PROMOTIONS ladder,
                 check_policy_name; imports no TensorFlow, so a config checks
                 its precision without it
    policies.py  global_policy (a `with` block) and effective_policy (through
                 a layer's DTypePolicyMap)
    hardware.py  precision `auto`: HardwareProbe, probe_hardware,
                 resolve_auto_policy
    manifest.py  PrecisionManifest and Rule: JSON rules -> a policy per layer
    report.py    PrecisionReport: every layer's policy, dtypes, output dtype and
                 what decided it; precision_report(model); the JSON of
                 `precision_report.json` and the `--dry_run` table
    promote.py   promote: layers one step up the ladder, by a manifest rule
    float8.py    float8 training of chosen Dense and EinsumDense layers on
                 Keras' own mechanism (a manifest rule's `float8`): to_float8,
                 the float8 state and its statistics

Import the modules themselves (`from mpt_keras.precision.manifest import
PrecisionManifest`); this package imports nothing, so that `names` loads
without Keras or TensorFlow. The public names are also on `mpt_keras`.
"""
