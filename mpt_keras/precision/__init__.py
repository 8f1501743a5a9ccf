"""Precision: which dtype each layer computes in, who decided it, and moving it up.

    names.py        every allowed name (POLICY_NAMES, PROMOTIONS, ...); no TensorFlow
    limits.py       the float16 limits
    policies.py     global_policy (a `with` block), effective_policy
    hardware.py     precision `auto`: probe_hardware, resolve_auto_policy
    manifest.py     PrecisionManifest: the file, and applying it to a model
    rules.py        Rule: which layers a rule matches; strict JSON parsing
    decisions.py    each layer's policy: first matching rule, safe default, default
    application.py  setting decisions on layers: policy maps, layers built later
    report.py       PrecisionReport, precision_report(model)
    promote.py      promote: layers one step up the ladder
    float8.py       float8 Dense/EinsumDense training on Keras' own variables
    float8_gemms.py    their three GEMMs in XLA's float8 form; delayed or current scaling
    compiled_gemms.py  the GEMMs of a compiled XLA program (optimized HLO text)
    float8_census.py   which float8 GEMMs of a compiled train step run in float8

This package imports nothing, so that `names` loads without Keras or TensorFlow: import
the modules. The public names are also on `mpt_keras`.
"""
