"""Pipeline errors, raised on every rank of a failed step (the C++ runtime defines them).

``PipelineError``: a step failed (a stage raised, a peer failed); ``PipelineShapeError``: a
message's shape disagrees with what its stage was told; ``PipelineConfigError``: the ranks built
different schedules (found at the step's start, before any message; the groups stay usable);
``PipelineTimeoutError`` (also a ``TimeoutError``): a rank waited on a peer longer than the
pipeline timeout. All but ``PipelineConfigError`` leave the step's process groups broken.
"""
from torchpp._C import PipelineConfigError, PipelineError, PipelineShapeError, PipelineTimeoutError

__all__ = ["PipelineConfigError", "PipelineError", "PipelineShapeError", "PipelineTimeoutError"]
