"""The step levers: gradient release, the fused step, the offloaded optimizer and the chunked loss."""
