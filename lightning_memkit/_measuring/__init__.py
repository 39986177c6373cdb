"""Measuring a real step: the dispatch-mode storage tracker, and what CPU kernels allocate unseen."""
