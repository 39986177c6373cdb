"""Activation checkpointing: which blocks, the modes, what each costs, and the planner that fits a
budget."""
