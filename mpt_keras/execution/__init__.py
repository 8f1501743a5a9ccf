"""Execution: how a train step runs, compiled by XLA or not.

jit_rule.py      the `jit_compile` rule: XLA or not, for `auto` by device and model
xla.py           compile_model: the step compiled whole on one device, or per replica
replica_step.py  the step in two parts: forward and backward pass, then the update
"""
