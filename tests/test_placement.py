"""Placement without a GPU: what differs when a stage's device is not the device the model was traced on.

A model traced here on the CPU is compiled for stages on ``meta`` (and, for a tied weight, a CPU stage beside a meta
one). Each stage then runs under FakeTensorMode with every tensor it reads where compile's ``placement`` puts it,
a replica where an earlier stage on another device holds it (runtime/task.py), and its inputs moved onto its device
(as the runtime moves them). A tensor placement leaves behind stays on the CPU, and the first op that meets it beside
the stage's device raises FakeTensorDeviceMismatchError, as the op would on a GPU; so does a device the stage code
names. What only a GPU run covers: moving the data (``.data`` cannot go from the CPU to meta), streams, the task
generators on the device, the runtime's transfers (tests/runtime/test_cuda.py).
"""
from __future__ import annotations

import operator

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopipe.options import Options
from autopipe.pass_chain import run_passes
from autopipe.placement import placement, tensors_read
from autopipe.passes.codegen import codegen
from zoo import GPT, ZOO, build, random_inputs, tensor_leaves

META, CPU = torch.device("meta"), torch.device("cpu")


def run_placed(model, args=(), kwargs=None, devices=(META, META), **options):
    """Compile ``model`` for stages on ``devices`` and run the stages one after another, each with the tensors it
    reads placed by ``placement``; returns (the program, the placement, the model's flat outputs, fake). The passes
    are compile's up to its stages; not its runners, whose generators and replicas need the devices."""
    program = run_passes(model, args, kwargs or {}, Options.make(list(devices), chunks=2, **options), generate=False).main
    program.stages = codegen(program.traced.graph_module, program.plan)
    placed = placement(program.stages)
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # a tensor left on the CPU becomes a fake CPU tensor
    with mode:
        where = {id(t): mode.from_tensor(t).to(device) for t, device in placed}
        flat = program.traced.flat_inputs(args, kwargs or {})
        values = {name: mode.from_tensor(t) for name, t in zip(program.plan.graph_inputs, flat)}
        for stage in program.stages:
            tensors = [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]
            substitutes = {name: where[id(t)].to(stage.device) for name, t in tensors if id(t) in where}
            inputs = [on(values[name], stage.device) for name in stage.input_names]
            outputs = torch.func.functional_call(stage, substitutes, tuple(inputs), strict=False)  # generator: torch's
            for name, value in zip(stage.output_names, outputs, strict=True):
                assert on(value, stage.device) is value, f"stage {stage.index}: {name} on {value.device}"
                values[name] = value
        return program, placed, [values[name] for name in program.plan.graph_outputs]


def on(value, device: torch.device):
    """A tensor moved to ``device``, as the runtime moves what a stage receives; a number (a size crossing a cut) as is."""
    return value.to(device) if isinstance(value, torch.Tensor) else value


def assert_outputs_like_the_plain_model(model, args, kwargs, outputs):
    with torch.no_grad():
        want = [t for t in tensor_leaves(model(*args, **(kwargs or {}))) if isinstance(t, torch.Tensor)]
    assert [tuple(t.shape) for t in outputs] == [tuple(t.shape) for t in want]
    assert [t.dtype for t in outputs] == [t.dtype for t in want]


def attributes_read(program, kind: str) -> list[str]:
    """The get_attr targets of the stages whose name holds ``kind``: the test's model has the tensors it is about."""
    return [n.target for s in program.stages for n in s.graph.find_nodes(op="get_attr") if kind in str(n.target)]


def test_parameters_and_buffers_are_placed_on_their_stage():
    model = build("resnet").eval()  # BatchNorm's running statistics: buffers
    args, _ = random_inputs("resnet", 4, torch.Generator().manual_seed(0))
    program, placed, outputs = run_placed(model, args)
    assert {id(t) for t, _ in placed} >= {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert {d for _, d in placed} == {META}
    assert_outputs_like_the_plain_model(model, args, {}, outputs)


class RelativePositionViT(nn.Module):
    """A vision transformer block with a relative-position bias table (Swin's, BEiT's): the index into the table is
    built in the forward from Python ints, and a second table is a plain tensor attribute, so fx holds both as
    ``_tensor_constant*`` of the graph it makes, tensors the model does not register."""

    def __init__(self, grid=4, d=16, heads=2):
        super().__init__()
        self.grid, self.heads = grid, heads
        self.patch = nn.Conv2d(3, d, 4, stride=4)
        self.bias_table = nn.Parameter(torch.randn((2 * grid - 1) ** 2, heads) * 0.02)
        self.scale_per_head = torch.linspace(0.5, 1.0, heads)  # not a buffer: fx makes it a constant
        self.qkv, self.proj, self.head = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, 10)

    def relative_index(self) -> torch.Tensor:
        coords = torch.stack(torch.meshgrid(torch.arange(self.grid), torch.arange(self.grid), indexing="ij")).flatten(1)
        offsets = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + self.grid - 1
        return offsets[..., 0] * (2 * self.grid - 1) + offsets[..., 1]

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.bias_table[self.relative_index()].permute(2, 0, 1) * self.scale_per_head[:, None, None]
        x = x + self.proj(torch.softmax(q @ k.transpose(-2, -1) + bias, -1).matmul(v).transpose(1, 2).reshape(b, n, d))
        return self.head(x.mean(1))


def test_fx_tensor_constants_are_placed():
    torch.manual_seed(0)
    model, x = RelativePositionViT(), torch.randn(4, 3, 16, 16)
    program, _, outputs = run_placed(model, (x,))
    assert program.traced.route == "fx" and len(set(attributes_read(program, "_tensor_constant"))) >= 2
    assert_outputs_like_the_plain_model(model, (x,), {}, outputs)


class ExportedConstant(nn.Module):
    """A tensor made in the forward from Python values, which export lifts into the graph (``lifted_tensor_*``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x) * torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_export_lifted_constants_are_placed():
    model, x = ExportedConstant(), torch.randn(4, 4)
    program, _, outputs = run_placed(model, (x,), route="export")
    assert attributes_read(program, "lifted_tensor")
    assert_outputs_like_the_plain_model(model, (x,), {}, outputs)


def test_a_multi_query_decoder_lm_on_the_export_route_is_placed():
    """Falcon's multi-query attention: the lifted constants of the KeyError on CUDA."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       multi_query=True, new_decoder_architecture=False, use_cache=False)
    model = transformers.FalconForCausalLM(config).eval()
    kwargs = {"input_ids": torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))}
    program, _, outputs = run_placed(model, (), kwargs)
    assert program.traced.route == "export" and attributes_read(program, "lifted_tensor")
    assert_outputs_like_the_plain_model(model, (), kwargs, outputs)


class ScaledBlock(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, x):
        return torch.relu(self.fc(x)) * self.scale


def test_tensors_of_modules_kept_whole_are_placed():
    model, x = nn.Sequential(*(ScaledBlock() for _ in range(4))), torch.randn(4, 8)
    program, placed, outputs = run_placed(model, (x,), leaf_modules=(ScaledBlock,))
    called_whole = [operator.attrgetter(n.target)(s) for s in program.stages for n in s.graph.nodes if n.op in ("call_module", "get_attr")]
    assert sum(isinstance(m, ScaledBlock) for m in called_whole) == 4  # each read whole, not traced into
    assert {id(t) for t, _ in placed} == {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert_outputs_like_the_plain_model(model, (x,), {}, outputs)


def test_a_tied_weight_stays_on_the_first_stage_and_a_later_device_reads_a_replica():
    torch.manual_seed(0)
    model = GPT(dropout=None, tied=True).eval()
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    program, placed, outputs = run_placed(model, (ids,), devices=(CPU, META))
    assert program.plan.shared_params == {"wte.weight": (0, 1)}
    assert dict((id(t), d) for t, d in placed)[id(model.wte.weight)] == CPU
    assert any(t is model.wte.weight for t in tensors_read(program.stages[1]))  # stage 1 reads it: the replica
    assert_outputs_like_the_plain_model(model, (ids,), {}, outputs)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_export_route_models_of_the_cuda_tests_are_placed(name):
    """test_cuda.py's export-route models: export writes the tracing device into the graph (arange(device=cpu))."""
    pytest.importorskip("transformers")
    model, args, kwargs = ZOO[name]()
    program, _, outputs = run_placed(model, args, kwargs)
    assert program.traced.route == "export"
    assert all("stage_device" in s.code for s in program.stages)  # export wrote device=cpu; the stages read their own
    assert_outputs_like_the_plain_model(model, args, kwargs, outputs)


def test_run_passes_hands_the_stages_to_after_codegen_where_compile_places_them():
    """compile places the stages' tensors in run_passes' after_codegen; a misplaced call (after the return, as at
    2991c09) never ran it, so on a GPU no parameter moved, while every CPU test passed."""
    torch.manual_seed(0)
    model, (x,) = build("mlp"), random_inputs("mlp", 4, torch.Generator().manual_seed(0))[0]
    handed = []
    compiled = run_passes(model, (x,), {}, Options.make([torch.device("cpu")] * 2, chunks=2), after_codegen=handed.append)
    assert handed == [compiled.main.stages] and len(handed[0]) == 2
