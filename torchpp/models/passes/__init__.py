"""The passes of ``parallelize``, each ``apply_X(model, state, options) -> model`` over a
``WrapState`` that carries what the earlier passes found (torchpp.models.parallelize composes them)."""
from torchpp.models.passes.context_parallel import apply_cp
from torchpp.models.passes.expert_parallel import apply_ep
from torchpp.models.passes.materialize import apply_materialize
from torchpp.models.passes.parallel_class import apply_parallel_class
from torchpp.models.passes.pipeline_cut import apply_pipeline_cut
from torchpp.models.passes.recompute import apply_recompute
from torchpp.models.passes.resolve import apply_plans, resolve_parallel_state
from torchpp.models.passes.schedule import apply_schedule
from torchpp.models.passes.state import Placement, WrapState
from torchpp.models.passes.tensor_parallel import apply_tp
from torchpp.models.passes.zero import apply_zero

__all__ = ["Placement", "WrapState", "apply_cp", "apply_ep", "apply_materialize", "apply_parallel_class",
           "apply_pipeline_cut", "apply_plans", "apply_recompute", "apply_schedule", "apply_tp", "apply_zero",
           "resolve_parallel_state"]
