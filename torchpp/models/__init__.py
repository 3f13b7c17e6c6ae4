"""Wrapping existing models: parallelize (by plan, in place) and their checkpoints."""
from torchpp.models.hf_checkpoint import load_hf_weights, save_hf_checkpoint
from torchpp.models.parallelize import ParallelCausalLM, ParallelModule, parallelize

__all__ = ["ParallelCausalLM", "ParallelModule", "load_hf_weights", "parallelize", "save_hf_checkpoint"]
