"""Structure walks through autograd (which linear feeds which: the TP plan's split checks, plan="auto",
the pipeline's carried-state checks) tell nodes apart by the node objects, which the walks hold:
never by ``id()`` of a wrapper nothing holds. torch 2.11 frees those, and another node's wrapper
may take the address: on the first GPU run (torch 2.11) tp=2 left every row-split projection of a
Llama whole and failed with a shape error at o_proj (docs/gpu.md). torch 2.13 keeps the wrappers,
so these check the contract: the walk's named, blocked and entry nodes are the nodes themselves."""
import torch

from torchpp.models.autograd_walk import walk_back


def _chain():
    x = torch.randn(3, 4, requires_grad=True)
    a = torch.randn(4, 4, requires_grad=True)
    b = torch.randn(4, 4, requires_grad=True)
    first = x @ a  # a "linear" output
    second = torch.tanh(first) @ b
    return x, a, b, first, second


def test_named_nodes_are_the_nodes_themselves():
    x, a, b, first, second = _chain()
    walk = walk_back([second], named={first.grad_fn: "first"})
    assert walk.reached == {"first"}
    assert id(b) in walk.params and id(a) not in walk.params  # stopped at the named node


def test_blocked_and_entry_nodes_stop_the_walk():
    x, a, b, first, second = _chain()
    assert walk_back([second], blocked=[first.grad_fn]).params == {id(b)}
    walk = walk_back([second], entry=first.grad_fn)
    assert walk.entry and walk.params == {id(b)}
