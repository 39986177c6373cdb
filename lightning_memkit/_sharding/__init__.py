"""Sharded steps: FSDP2 (``fully_shard``) read on a real run and simulated over a fake process group."""
