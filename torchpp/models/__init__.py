"""Models built from torchpp's parallel layers, and (later) wrappers for existing models."""
