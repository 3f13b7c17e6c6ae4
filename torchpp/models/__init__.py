"""Models built from torchpp's parallel layers, and wrappers for existing models."""
from torchpp.models.hf import ParallelCausalLM, parallelize
from torchpp.models.hf_checkpoint import load_hf_weights, save_hf_checkpoint

__all__ = ["ParallelCausalLM", "load_hf_weights", "parallelize", "save_hf_checkpoint"]
