"""models.autograd_walk tells autograd nodes apart by the node objects, which its callers hold:
never by ``id()`` of a wrapper nothing holds (torch 2.11 frees those, and another node's wrapper
may take the address: tp=2 then left every row-split projection of a Llama whole, found on the
first GPU run, docs/gpu.md)."""
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
