"""Process groups for dp x pp x cp x tp, data parallelism (with ZeRO-1), gradient clipping and fp16 loss scaling."""
from torchpp.parallel.groups import (ParallelState, destroy_parallel, get_parallel_state, init_parallel, mesh_grid,
                                     new_layout_group, rank_grid)

__all__ = ["ParallelState", "destroy_parallel", "get_parallel_state", "init_parallel", "mesh_grid", "new_layout_group",
           "rank_grid"]
from torchpp.parallel.clip import clip_grad_norm_, global_grad_norm
from torchpp.parallel.data_parallel import GradReducer
from torchpp.parallel.finalize import finalize_grads
from torchpp.parallel.grad_scaler import GradScaler
from torchpp.parallel.nonfinite import NonFiniteGradientError
from torchpp.parallel.optimizer import DistributedOptimizer
from torchpp.parallel.zero import ZeroRedundancyOptimizer

__all__ += ["clip_grad_norm_", "global_grad_norm", "GradReducer", "ZeroRedundancyOptimizer", "finalize_grads",
            "DistributedOptimizer", "GradScaler", "NonFiniteGradientError"]
