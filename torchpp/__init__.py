"""torchpp: pipeline x tensor x data (PTD-P) parallelism for existing PyTorch models.

Importing torchpp loads its C++ extension, which registers torch.ops.torchpp.*.
"""
import torch  # noqa: F401  (the extension links against torch's libraries)

from torchpp import _C  # noqa: F401  (registers torch.ops.torchpp)

__version__ = "0.1.0"

from torchpp.parallel.groups import destroy_parallel, get_parallel_state, init_parallel  # noqa: E402,F401
