"""Sharded, layout-independent training checkpoints (torch.distributed.checkpoint).

    torchpp.checkpoint.save_checkpoint(root, step, model, optimizer, extra=...)
    loaded = torchpp.checkpoint.load_checkpoint(root, model, optimizer)   # from root/latest

Saves are atomic (a crash at any point leaves a loadable latest checkpoint, never a directory
that blocks the next save; docs/reliability.md) and a checkpoint loads
under any (tp, pp, dp), with or without ZeRO-1. See docs/ptdp.md, "Checkpoints".
"""
from torchpp.checkpoint.api import LoadedCheckpoint, load_checkpoint, save_checkpoint
from torchpp.checkpoint.directory import IncompleteCheckpointError, latest_checkpoint
from torchpp.checkpoint.layout import stage_parameters

__all__ = ["IncompleteCheckpointError", "LoadedCheckpoint", "latest_checkpoint", "load_checkpoint", "save_checkpoint", "stage_parameters"]
