"""Wrapping existing models: parallelize (by plan, in place) and their checkpoints."""
from torchpp.models.hf_checkpoint import load_hf_weights, save_hf_checkpoint
from torchpp.models.parallel_config import (ContextOptions, ExpertOptions, ParallelConfig, PipelineOptions,
                                            TensorOptions)
from torchpp.models.parallelize import ParallelCausalLM, ParallelModule, parallelize

__all__ = ["ContextOptions", "ExpertOptions", "ParallelCausalLM", "ParallelConfig", "ParallelModule",
           "PipelineOptions", "TensorOptions", "load_hf_weights", "parallelize", "save_hf_checkpoint"]
