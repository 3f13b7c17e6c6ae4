"""torch.distributed.pipelining._utils's public names, at torch's module path (code imports
``generate_stage_to_rank_mapping`` from there)."""
from torchpp.pipeline.errors import PipelineShapeError
from torchpp.pipeline.placement import generate_rank_to_stage_mapping, generate_stage_to_rank_mapping

# torch's error for a stage input or output whose shape or dtype is not what was inferred
# (named PipeliningShapeError before torch 2.13).
PipeliningMetadataError = PipeliningShapeError = PipelineShapeError

__all__ = ["PipeliningMetadataError", "PipeliningShapeError", "generate_rank_to_stage_mapping",
           "generate_stage_to_rank_mapping"]
