"""The capture check (passes/graph_capture.py) on real models, on the CPU: which stages replay as CUDA graphs, and the
node, op and reason that keep a stage eager, as the plan prints them."""
import pytest
import torch
import torch.nn as nn

import autopipe
from zoo import GPT, ScaledByItem, build, random_inputs


class ToHost(nn.Module):
    """Two layers with a copy to the host between them (a CPU tensor in a CUDA stage)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(h + h.cpu().to(h.device) * 0)


def stage_of(plan, node_name):
    return next(s.index for s in plan.stages if node_name in s.nodes)


def test_item_falls_back_in_exactly_its_stage():
    plan = autopipe.plan(ScaledByItem(), torch.randn(8, 16), devices=4, chunks=4, cuda_graphs=True)
    report = plan.cuda_graphs
    eager = [s.stage for s in report.stages if not s.captured]
    assert eager == [stage_of(plan, "item")], str(report)
    blocker = report.stages[eager[0]].blockers[0]
    assert blocker.node == "item" and ".item()" in blocker.why
    printed = str(plan)
    assert f"stage {eager[0]}: runs eagerly: Tensor.item (item)" in printed
    assert "3 of 4 stages captured" in printed


def test_a_gpt_with_dropout_has_no_fallback():
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 16))
    plan = autopipe.plan(GPT(dropout=0.1).train(), ids, devices=4, chunks=4, cuda_graphs=True)
    assert all(s.captured for s in plan.cuda_graphs.stages), str(plan.cuda_graphs)
    assert "4 of 4 stages captured" in str(plan)


def test_without_the_option_the_plan_has_no_capture_report():
    plan = autopipe.plan(ScaledByItem(), torch.randn(8, 16), devices=2, chunks=2)
    assert plan.cuda_graphs is None and "CUDA graphs" not in str(plan)


def test_value_sized_rows_name_the_op_and_source_line():
    model = build("moe")
    (x,), _ = random_inputs("moe", 8, torch.Generator().manual_seed(0))
    plan = autopipe.plan(model, x, devices=2, chunks=2, cuda_graphs=True)
    first = plan.cuda_graphs.stages[0].blockers[0]
    assert not plan.cuda_graphs.stages[0].captured
    assert "size is set by values" in first.why and "zoo/models.py:" in first.where, str(first)


def test_a_training_batchnorm_keeps_its_stage_eager():
    model = build("resnet").train()
    (x,), _ = random_inputs("resnet", 8, torch.Generator().manual_seed(0))
    report = autopipe.plan(model, x, devices=2, chunks=2, cuda_graphs=True).cuda_graphs
    assert not any(s.captured for s in report.stages)
    assert "BatchNorm2d" in report.stages[0].blockers[0].op and "running statistics" in report.stages[0].blockers[0].why


def test_a_copy_to_the_host_is_named():
    report = autopipe.plan(ToHost(), torch.randn(4, 8), devices=1, chunks=2, cuda_graphs=True).cuda_graphs
    assert not report.stages[0].captured
    assert "Tensor.cpu" in report.stages[0].blockers[0].op


def test_eval_mode_batchnorm_is_captured():
    model = build("resnet").eval()
    (x,), _ = random_inputs("resnet", 8, torch.Generator().manual_seed(0))
    report = autopipe.plan(model, x, devices=2, chunks=2, cuda_graphs=True).cuda_graphs
    assert all(s.captured for s in report.stages), str(report)


@pytest.mark.parametrize("value", ["yes", 1])
def test_cuda_graphs_must_be_a_bool(value):
    with pytest.raises(TypeError, match="cuda_graphs must be True or False"):
        autopipe.plan(ScaledByItem(), torch.randn(8, 16), devices=2, cuda_graphs=value)
