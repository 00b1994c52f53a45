"""GPU: every family checked on a CUDA GPU, and the whole GPU table in one call."""
