"""DCP planners that also save and load ChunkedTensor values (several rectangles per rank).

Everything else (tensors, DTensors, picklable objects) goes through DCP's default planners
unchanged; chunked values are kept beside the state dict and added to the plans as shards of
their global tensor, so DCP deduplicates, validates and reshards them like any DTensor.
"""
from __future__ import annotations

import dataclasses
from typing import Dict

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from torchpp.checkpoint.chunks import ChunkedTensor


def _find_chunk(chunked: ChunkedTensor, index: MetadataIndex) -> torch.Tensor:
    for offsets, tensor in zip(chunked.offsets, chunked.tensors):
        if offsets == index.offset:
            return tensor
    raise KeyError(f"torchpp.checkpoint: {index.fqn} has no local chunk at offset {tuple(index.offset)}")


class ChunkedSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner plus `chunked`: fqn -> ChunkedTensor, written as shards.

    Args:
        chunked: values saved as the rectangles this rank holds.
    """

    def __init__(self, chunked: Dict[str, ChunkedTensor]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunked = chunked

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for fqn, chunked in self.chunked.items():
            for offsets, tensor in zip(chunked.offsets, chunked.tensors):
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=tensor.size()),
                            properties=TensorProperties.create_from_tensor(tensor),
                            size=chunked.global_shape,
                        ),
                    )
                )
        self.plan = dataclasses.replace(plan, items=plan.items + items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        chunked = self.chunked.get(write_item.index.fqn)
        if chunked is None:
            return super().resolve_data(write_item)
        return _find_chunk(chunked, write_item.index)


class ChunkedLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner plus `chunked`: fqn -> ChunkedTensor, read into its chunks.

    Args:
        chunked: values whose local rectangles are filled from whatever rectangles were saved.
    """

    def __init__(self, chunked: Dict[str, ChunkedTensor]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunked = chunked

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = []
        for fqn, chunked in self.chunked.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise KeyError(f"torchpp.checkpoint: the checkpoint has no tensor {fqn!r}")
            if md.size != chunked.global_shape:
                raise ValueError(
                    f"torchpp.checkpoint: {fqn} was saved with shape {tuple(md.size)}, "
                    f"loading expects {tuple(chunked.global_shape)}"
                )
            local = [ChunkStorageMetadata(offsets=o, sizes=t.size()) for o, t in zip(chunked.offsets, chunked.tensors)]
            items += create_read_items_for_chunk_list(fqn, md, local)
        return dataclasses.replace(plan, items=plan.items + items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        chunked = self.chunked.get(index.fqn)
        if chunked is None:
            return super().lookup_tensor(index)
        return _find_chunk(chunked, index)
