"""Activation checkpointing: which blocks, the policies, what each costs, and the planner that fits a
budget."""
