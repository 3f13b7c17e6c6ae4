"""Models built from torchpp's parallel layers, and wrappers for existing models."""
from torchpp.models.hf import ParallelCausalLM, parallelize

__all__ = ["ParallelCausalLM", "parallelize"]
