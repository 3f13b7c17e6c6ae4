"""Pipeline errors, raised on every rank of a failed step (the C++ runtime defines them)."""
from torchpp._C import PipelineError, PipelineShapeError

__all__ = ["PipelineError", "PipelineShapeError"]
