"""Precision: which dtype each layer computes in, who decided it, and moving it up.

    names.py        every allowed name (POLICY_NAMES, PRECISIONS, RULE_POLICIES,
                    COMPUTE_DTYPES, the PROMOTIONS ladder), check_policy_name;
                    imports no TensorFlow, so a config checks its precision without it
    limits.py       the float16 limits (FLOAT16_MAX, smallest normal and subnormal)
    policies.py     global_policy (a `with` block) and effective_policy
    hardware.py     precision `auto`: HardwareProbe, probe_hardware, resolve_auto_policy
    manifest.py     PrecisionManifest: the file, and applying it to a model
    rules.py        Rule: which layers a rule matches; strict parsing of a rule's JSON
    decisions.py    each layer's policy: first matching rule, safe default, default
    application.py  setting decisions on layers: policy maps, layers built later
    report.py       PrecisionReport and precision_report(model): each layer's policy,
                    dtypes, output dtype and what decided it
    promote.py      promote: layers one step up the ladder, by a manifest rule
    float8.py       float8 training of chosen Dense and EinsumDense layers on
                    Keras' own mechanism: to_float8, the float8 state and statistics

Import the modules themselves (`from mpt_keras.precision.manifest import
PrecisionManifest`); this package imports nothing, so that `names` loads
without Keras or TensorFlow. The public names are also on `mpt_keras`.
"""
