"""Sharded, layout-independent training checkpoints (torch.distributed.checkpoint).

    torchpp.checkpoint.save_checkpoint(root, step, model, optimizer, extra=...)
    loaded = torchpp.checkpoint.load_checkpoint(root, model, optimizer)   # from root/latest

Saves are atomic (a crash at any point leaves a loadable latest checkpoint, never a directory
that blocks the next save; docs/reliability.md), every file's CRC32C is recorded when a save
commits and verified before a load, AsyncCheckpointer writes while training goes on, and a
checkpoint loads under any (tp, pp, dp), with or without ZeRO-1. See docs/ptdp.md,
"Checkpoints", and docs/training.md.
"""
from torchpp.checkpoint.api import LoadedCheckpoint, load_checkpoint, save_checkpoint, stage_state, write_staged
from torchpp.checkpoint.async_save import AsyncCheckpointer
from torchpp.checkpoint.checksums import CorruptCheckpointError, verify_checksums
from torchpp.checkpoint.directory import IncompleteCheckpointError, latest_checkpoint
from torchpp.checkpoint.layout import stage_parameters

__all__ = ["AsyncCheckpointer", "CorruptCheckpointError", "IncompleteCheckpointError", "LoadedCheckpoint",
           "latest_checkpoint", "load_checkpoint", "save_checkpoint", "stage_parameters", "stage_state",
           "verify_checksums", "write_staged"]
