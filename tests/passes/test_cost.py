"""passes/cost.py: shape formulas agree with torch.utils.flop_counter.FlopCounterMode on real modules."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from autopipe.passes.cost import cost
from autopipe.passes.trace import trace

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def costed(model, *args):
    return cost(trace(model, args, route="fx"))


def counted(model, *args) -> int:
    """What FlopCounterMode counts for one eager forward."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*args)
    return counter.get_total_flops()


def double_matmul(a, b):
    return a @ b @ b


torch.fx.wrap("double_matmul")  # a user function fx keeps as one call node


class Fn(nn.Module):
    def __init__(self, fn, **modules):
        super().__init__()
        self.fn = fn
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(self, *args):
        return self.fn(self, *args)


@pytest.mark.parametrize("model, shape", [
    (nn.Linear(16, 24), (4, 16)),
    (nn.Linear(16, 24, bias=False), (4, 7, 16)),
    (nn.Conv1d(3, 8, 5, stride=2), (2, 3, 31)),
    (nn.Conv2d(4, 6, 3, padding=1, groups=2), (2, 4, 9, 9)),
    (nn.Conv3d(2, 3, (1, 2, 3)), (2, 2, 4, 5, 6)),
    (nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), (2, 4, 5, 5)),
])
def test_linear_and_conv_modules_match_flop_counter(model, shape):
    x = torch.randn(shape)
    graph = costed(model, x)
    (node,) = graph.costs.values()
    assert node.flops == counted(model, x) > 0


def test_functional_linear_conv_matmul_and_bmm_match_flop_counter():
    def forward(self, x, a, b):
        h = F.linear(x, self.lin.weight, self.lin.bias)
        c = F.conv2d(x.view(-1, 3, 4, 5), self.conv.weight)
        t = F.conv_transpose1d(x.view(-1, 6, 10), self.up.weight)
        return h, c, t, torch.matmul(a, b), torch.bmm(a, b), a @ b, a.matmul(b), torch.baddbmm(a @ b, a, b)

    model = Fn(forward, lin=nn.Linear(5, 7), conv=nn.Conv2d(3, 4, 2), up=nn.ConvTranspose1d(6, 2, 3))
    args = (torch.randn(2, 3, 4, 5), torch.randn(2, 4, 6), torch.randn(2, 6, 2))  # one batch of 2 in dim 0
    graph = costed(model, *args)
    assert graph.total_flops - _elementwise(graph) == counted(model, *args)


def _elementwise(graph) -> int:
    """The flops of the nodes FlopCounterMode does not count (views, outputs): one per output element."""
    known = ("linear", "conv", "matmul", "bmm", "baddbmm")
    return sum(c.flops for name, c in graph.costs.items() if not any(k in name for k in known))


def test_matmul_of_vectors_and_broadcast_batches():
    def forward(self, b):  # the batch is b's dim 0 alone: v and m are parameters
        v, m = self.v, self.m
        return torch.matmul(v, m), torch.matmul(m, v[:3]), torch.matmul(b, m)

    v, m, b = torch.randn(4), torch.randn(4, 3), torch.randn(4, 2, 6, 4)
    model = Fn(forward)
    model.v, model.m = nn.Parameter(v), nn.Parameter(m)
    flops = {name: c.flops for name, c in costed(model, b).costs.items() if name.startswith("matmul")}
    assert flops == {"matmul": 2 * 4 * 3, "matmul_1": 2 * 4 * 3, "matmul_2": 2 * (4 * 2 * 6 * 3) * 4}
    assert flops["matmul"] == counted(torch.matmul, v, m)  # vector @ matrix runs as mm
    assert flops["matmul_2"] == counted(torch.matmul, b, m)
    assert counted(torch.matmul, m, v[:3]) == 0  # aten.mv has no FlopCounterMode formula; ours counts it


def test_attention_formula():
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=False)

    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
    graph = costed(Fn(forward), q, k, v)
    (node,) = graph.costs.values()
    # QK^T: 2*5*7*8 and PV: 2*5*7*4 per batch and head; FlopCounterMode counts 0 here on some CPU builds
    by_hand = 2 * 3 * (2 * 5 * 7 * 8 + 2 * 5 * 7 * 4)
    assert node.flops == by_hand == sdpa_flop_count(q.shape, k.shape, v.shape)
    assert counted(Fn(forward), q, k, v) in (0, by_hand)


def test_uncounted_ops_weigh_one_flop_per_output_element_and_user_functions_are_run():
    def forward(self, x):
        return self.norm(torch.relu(x)).sum(-1), torch.einsum("ij,jk->ik", x, self.w), double_matmul(x, self.w)

    model = Fn(forward, norm=nn.LayerNorm(6))
    model.w = nn.Parameter(torch.randn(6, 6))
    graph = costed(model, torch.randn(4, 6))
    flops = {name: c.flops for name, c in graph.costs.items()}
    assert flops["relu"] == flops["norm"] == 4 * 6 and flops["sum_1"] == 4
    assert flops["einsum"] == 2 * 4 * 6 * 6
    assert flops["double_matmul"] == 2 * (2 * 4 * 6 * 6)


def matmul_seeing_global_hooks(a, b):
    GLOBAL_HOOKS_SEEN.append(len(torch.nn.modules.module._global_forward_pre_hooks) + len(torch.nn.modules.module._global_forward_hooks))
    return a @ b


torch.fx.wrap("matmul_seeing_global_hooks")
GLOBAL_HOOKS_SEEN: list[int] = []


def test_counting_flops_sets_no_global_module_hook():
    """FlopCounterMode's module tracker registers global module hooks, which reached the modules of a pipeline training on another thread
    while this one compiled (its backward then failed: _will_engine_execute_node inside autograd.grad)."""
    model = Fn(lambda self, x: matmul_seeing_global_hooks(x, self.w))
    model.w = nn.Parameter(torch.randn(6, 6))
    GLOBAL_HOOKS_SEEN.clear()
    assert costed(model, torch.randn(4, 6)).costs["matmul_seeing_global_hooks"].flops == 2 * 4 * 6 * 6  # counted by running it
    assert GLOBAL_HOOKS_SEEN and set(GLOBAL_HOOKS_SEEN) == {0}


def test_bytes_params_and_tied_weights():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight
            self.register_buffer("scale", torch.ones(4))

        def forward(self, ids):
            return self.head(self.emb(ids) * self.scale)

    graph = costed(Tied(), torch.randint(0, 10, (3, 5)))
    assert graph.tensor_bytes == {"emb.weight": 10 * 4 * 4, "scale": 4 * 4}
    params = {name: c.params for name, c in graph.costs.items()}
    assert params["emb"] == params["head"] == ("emb.weight",) and params["mul"] == ("scale",)
    assert graph.costs["head"].out_bytes == 3 * 5 * 10 * 4
    assert graph.costs["head"].flops == 2 * 3 * 5 * 4 * 10


def test_measured_seconds_leave_running_statistics_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    x = torch.randn(8, 4)
    traced = trace(model, (x,), route="fx")
    before = model[1].running_mean.clone(), int(model[1].num_batches_tracked)
    start = time.perf_counter()
    timed = cost(traced, measure_inputs=[x])
    elapsed = time.perf_counter() - start
    seconds = [c.seconds for c in timed.costs.values()]
    assert len(seconds) == 2  # the Linear and the BatchNorm, each timed running on x
    assert all(s > 0 for s in seconds) and sum(seconds) <= elapsed, (seconds, elapsed)
    assert torch.equal(model[1].running_mean, before[0]) and int(model[1].num_batches_tracked) == before[1]
    assert all(c.seconds is None for c in cost(traced).costs.values())
