"""Tensors a layer stores on a module and a later layer (or the model after the stack) reads back:
under pipeline parallelism the reader may sit on another stage, which reads what its own run left
there (nothing, or a placeholder's value): a silent wrong value. ``carried_check`` finds such
state where autograd connects it; integer positions, masks and detached states are outside the
graph, so a traced forward also watches module attributes.

While a layer runs, ``nn.Module.__setattr__`` records each tensor written on a module other than
the one running (a module caching on itself while it runs, a rotary table's, is its own business,
and so is reading that cache back); ``nn.Module.__getattribute__`` then records who reads those
attributes: another layer, the model's own code before a later layer (which passes it on), or the
modules after the stack. The pairs join ``PipelineLayout.reads_inside``, so a cut between writer
and reader is refused (``carried_check.check_cut``) and a cut keeping them on one stage is not.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Set, Tuple

from torch import nn
from torch.nn.modules import module as module_hooks

from torchpp.models.autograd_walk import tensors_in

AFTER_STACK = "the model's forward after the stack"


class StateOnModules:
    """Module attributes one traced forward's layers wrote and who read them back."""

    def __init__(self) -> None:
        self._running: List[int] = []  # ids of the modules whose forward is on the stack, innermost last
        self.layer: Optional[int] = None  # the layer running now (run_order's hooks set it)
        self.started = False  # a layer has run: reads outside layers from here on are between or after them
        self._written: Dict[Tuple[int, str], int] = {}  # (module id, attribute) -> the layer that wrote it last
        self._names: Set[str] = set()  # attribute names written (a fast test on every read)
        self._pending: Set[int] = set()  # layers whose state the model's own code read since the last layer
        self.reads: Dict[object, Set[int]] = {}  # reader (layer index, or AFTER_STACK) -> writer layers

    @contextlib.contextmanager
    def watching(self):
        """For the trace's duration: the running modules followed, module attribute writes and reads seen."""
        set_attr, get_attr = nn.Module.__setattr__, nn.Module.__getattribute__
        own_getattribute = nn.Module.__dict__.get("__getattribute__")  # None: object's (torch defines none)
        watcher = self

        def recording_setattr(module, name, value):
            watcher._wrote(module, name, value)
            set_attr(module, name, value)

        def recording(lookup):  # __getattribute__: the module's __dict__; __getattr__: buffers, parameters
            def get(module, name):
                value = lookup(module, name)
                if name in watcher._names:
                    watcher._read(module, name)
                return value
            return get

        get_missing = nn.Module.__getattr__
        recording_getattr, recording_getattribute = recording(get_missing), recording(get_attr)

        def entered(module, args):
            self._running.append(id(module))

        def left(module, args, output):  # returns None: the module's output stays its own
            self._running.pop()

        handles = [module_hooks.register_module_forward_pre_hook(entered),
                   module_hooks.register_module_forward_hook(left)]
        nn.Module.__setattr__, nn.Module.__getattr__ = recording_setattr, recording_getattr
        nn.Module.__getattribute__ = recording_getattribute
        try:
            yield self
        finally:
            nn.Module.__setattr__, nn.Module.__getattr__ = set_attr, get_missing
            if own_getattribute is None:
                del nn.Module.__getattribute__
            else:
                nn.Module.__getattribute__ = own_getattribute
            for handle in handles:
                handle.remove()
            if self._pending:
                self.reads.setdefault(AFTER_STACK, set()).update(self._pending)

    def enter(self, index: int) -> None:
        self.layer, self.started = index, True
        if self._pending:  # what the model's code read between the layers reaches this one as an argument
            self.reads.setdefault(index, set()).update(self._pending - {index})
            self._pending.clear()

    def leave(self) -> None:
        self.layer = None

    def _innermost(self) -> Optional[int]:
        return self._running[-1] if self._running else None

    def _wrote(self, module: nn.Module, name: str, value) -> None:
        if self.layer is None or id(module) == self._innermost():
            return
        if isinstance(value, nn.Module) or not tensors_in([value]):
            return
        self._written[(id(module), name)] = self.layer
        self._names.add(name)

    def _read(self, module: nn.Module, name: str) -> None:
        writer = self._written.get((id(module), name))
        if writer is None or writer == self.layer or not self.started:
            return
        if self.layer is None:
            self._pending.add(writer)
        else:
            self.reads.setdefault(self.layer, set()).add(writer)

    def reads_inside(self) -> Dict[int, Tuple[int, ...]]:
        """{reader layer: earlier layers whose module state it reads} (``PipelineLayout.reads_inside``)."""
        return {j: tuple(sorted(i for i in writers if i < j)) for j, writers in self.reads.items()
                if j != AFTER_STACK and any(i < j for i in writers)}

    def read_after_stack(self) -> Tuple[int, ...]:
        """Layers whose module state the model reads after the stack (the last stage's modules)."""
        return tuple(sorted(self.reads.get(AFTER_STACK, ())))
