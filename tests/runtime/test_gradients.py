"""Parameter gradients summed as the engine makes them (autopipe/runtime/gradients.py, ``summed_as_made``)."""
from collections import OrderedDict
from types import SimpleNamespace

import torch
from torch import nn

from autopipe.runtime.gradients import add_param_grads, summed_as_made
from autopipe.runtime.split_backward import engine_grad


def test_gradients_summed_as_made_are_the_engines_in_task_order_and_leave_no_hook_behind():
    """Three micro-batches' engine calls towards a stage's parameters: each parameter's sum is bit for bit the
    engine's own gradients added in task order, the engine holds none of them (it got zero tensors), the sum is in the
    parameter's layout (a Linear's weight gradient is a transposed view), and each parameter's hooks are as before
    (a hooked one, differentiated through an alias in the runtime, is left alone here)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    params = list(model.parameters())
    params[1]._backward_hooks = OrderedDict()  # a hook registered and removed by the user: an empty dict, kept
    seen = []
    params[3].register_hook(lambda g: seen.append(g.sum().item()))
    batches = [torch.randn(4, 6, dtype=torch.float64) for _ in range(3)]

    expected = None
    for x in batches:
        got = engine_grad([model(x).sin().sum()], [torch.ones((), dtype=torch.float64)], params, keep_graph=False)
        expected = [g.clone() for g in got] if expected is None else [e.add_(g) for e, g in zip(expected, got)]
    seen.clear()

    mine = SimpleNamespace(wrt_params=params, param_grads=[], owned=[])
    for x in batches:
        with summed_as_made(mine, more=True):
            got = engine_grad([model(x).sin().sum()], [torch.ones((), dtype=torch.float64)], params, keep_graph=False)
        assert [g._is_zerotensor() for g in got] == [True, True, True, False]  # the hooked bias: as the engine made it
        add_param_grads(mine, got)
    for k, (s, e) in enumerate(zip(mine.param_grads, expected)):
        assert torch.equal(s, e), k
        assert s.stride() == params[k].stride(), k
    assert len(seen) == 3  # the user's hook ran once a call, on the engine's gradient
    assert params[0]._backward_hooks is None and params[2]._backward_hooks is None
    assert params[1]._backward_hooks == OrderedDict() and len(params[3]._backward_hooks) == 1
