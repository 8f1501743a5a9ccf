"""Execution: how a train step runs, compiled by XLA or not.

xla.py  the `jit_compile` rule and the step compiled on one device or per replica
"""
