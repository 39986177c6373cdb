"""Estimating a step before it runs: analytic formulas, optimizer-state bytes, and the fake-tensor
simulation with its shadow values, tracer and repeated-block shortcut."""
