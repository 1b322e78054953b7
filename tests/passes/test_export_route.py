"""passes/export_route.py: the torch.export route of the trace pass.

Small Hugging Face models with random weights (no downloads). For each: the
flat graph gives the model's outputs and the model's gradients, on the
model's own parameters, at the exported batch size and on smaller
micro-batches (1 and 2 rows).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

try:
    from autopipe.passes.export_route import ExportRouteError, export_flat_graph
except ImportError:  # running from a checkout without installing
    from passes.export_route import ExportRouteError, export_flat_graph

transformers = pytest.importorskip("transformers")

B, T = 4, 8


def _ids(rows=B, cols=T, vocab=100, seed=0):
    return torch.randint(0, vocab, (rows, cols), generator=torch.Generator().manual_seed(seed))


def _padded_mask():
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    return mask


def _gpt2():
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
        bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg), dict(input_ids=_ids(), labels=_ids(seed=1))


def _bert():
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=32, num_labels=3,
    )
    labels = torch.tensor([0, 2, 1, 2])
    return transformers.BertForSequenceClassification(cfg), dict(
        input_ids=_ids(), attention_mask=_padded_mask(), labels=labels
    )


def _vit():
    cfg = transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=3,
    )
    g = torch.Generator().manual_seed(0)
    return transformers.ViTForImageClassification(cfg), dict(
        pixel_values=torch.randn(B, 3, 16, 16, generator=g), labels=torch.tensor([0, 2, 1, 2])
    )


def _resnet():
    cfg = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, layer_type="basic"
    )
    g = torch.Generator().manual_seed(0)
    return transformers.ResNetForImageClassification(cfg), dict(
        pixel_values=torch.randn(B, 3, 32, 32, generator=g), labels=torch.tensor([0, 2, 1, 2])
    )


def _llama():
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=100, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg), dict(
        input_ids=_ids(), attention_mask=_padded_mask(), labels=_ids(seed=1)
    )


def _t5():
    cfg = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_kv=16, num_heads=2, d_ff=64,
        vocab_size=100, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(cfg), dict(
        input_ids=_ids(),
        attention_mask=_padded_mask(),
        decoder_input_ids=_ids(cols=6, seed=2),
        labels=_ids(cols=6, seed=3),
    )


MODELS = {
    "gpt2": _gpt2,
    "bert": _bert,
    "vit": _vit,
    "resnet": _resnet,
    "llama": _llama,
    "t5": _t5,
}


def _bind(model, inputs):
    return inspect.signature(model.forward).bind(**inputs).arguments


def _rows(bound, n):
    return {k: v[:n] if isinstance(v, torch.Tensor) else v for k, v in bound.items()}


def _run(eg, bound):
    return eg.rebuild_output(eg.graph_module(*eg.flatten_inputs(bound)))


def _assert_same_output(out, ref):
    assert type(out) is type(ref)
    leaves, spec = pytree.tree_flatten(out)
    ref_leaves, ref_spec = pytree.tree_flatten(ref)
    assert spec == ref_spec
    for a, b in zip(leaves, ref_leaves):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert a == b


def _assert_same_grads(model, ref):
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        r = ref_params[name]
        if r.grad is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module", params=list(MODELS))
def exported(request):
    torch.manual_seed(0)
    model, inputs = MODELS[request.param]()
    model.eval()
    bound = _bind(model, inputs)
    return request.param, model, bound, export_flat_graph(model, bound, B)


def test_outputs_and_grads_match_eager(exported):
    name, model, bound, eg = exported
    ref = copy.deepcopy(model)
    for rows in (B, 2, 1):
        part = _rows(bound, rows)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out = _run(eg, part)
        expected = ref(**part, **eg.forced_kwargs)
        _assert_same_output(out, expected)
        out.loss.backward()
        expected.loss.backward()
        _assert_same_grads(model, ref)
    model.zero_grad(set_to_none=True)


def test_graph_structure(exported):
    name, model, bound, eg = exported
    gm = eg.graph_module
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensor_args = [k for k, v in bound.items() if isinstance(v, torch.Tensor)]
    assert [n.name for n in phs] == tensor_args == eg.input_names
    # the model's own objects behind every get_attr, under the model's names
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in own:
            obj = own[node.target]
            got = (
                gm.get_parameter(node.target)
                if isinstance(obj, nn.Parameter)
                else gm.get_buffer(node.target)
            )
            assert got is obj, node.target
    # every parameter the model trains is reachable from the graph
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}
    # flat output tuple; no assertion / guard nodes; metadata kept
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert isinstance(out.args[0], tuple)
    assert len(out.args[0]) == len(eg.output_positions) and eg.output_spec.num_leaves == len(eg.output_leaves)
    for node in gm.graph.nodes:
        assert "assert" not in str(node.target) and "guards" not in str(node.target)
        if node.op == "call_function":
            assert "val" in node.meta, node.name
            for path, _ in node.meta.get("nn_module_stack", {}).values():
                model.get_submodule(path)  # model-relative paths
    assert phs[0].meta["val"].shape[0].node.expr == eg.batch_symbol  # the first input's dim 0 is the batch symbol
    assert eg.training is False


def test_contiguous_pieces_run_on_micro_batches(exported):
    # what the partitioner will do: cut the node order into 3 contiguous
    # pieces (fx's split_module stands in for codegen) and run each piece
    # on micro-batches; SymInt batch sizes cross the cuts as plain ints
    from torch.fx.passes.split_module import split_module

    name, model, bound, eg = exported
    gm = eg.graph_module
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    piece = {n: 3 * i // len(body) for i, n in enumerate(body)}
    split = split_module(gm, model, lambda n: piece[n])
    assert sum(1 for n, _ in split.named_children() if n.startswith("submod_")) >= 3
    for rows in (1, 2):
        part = _rows(bound, rows)
        out = eg.rebuild_output(split(*eg.flatten_inputs(part)))
        with torch.no_grad():
            _assert_same_output(out, model(**part, **eg.forced_kwargs))


def test_gpt2_tied_weights_stay_one_parameter():
    model, inputs = _gpt2()
    model.eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    eg = export_flat_graph(model, _bind(model, inputs), B)
    gm = eg.graph_module
    targets = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    tied = targets & {"lm_head.weight", "transformer.wte.weight"}
    assert tied
    assert all(gm.get_parameter(t) is model.lm_head.weight for t in tied)
    # a readable name: innermost module + op
    names = {n.name for n in gm.graph.nodes}
    assert "transformer_h_0_attn_c_attn_addmm" in names
    assert eg.forced_kwargs == {"use_cache": False}


def test_same_tensor_passed_twice_gives_two_inputs():
    # export ties inputs that are one tensor object; the route must not
    model, _ = _gpt2()
    model.eval()
    ids = _ids()
    eg = export_flat_graph(model, _bind(model, dict(input_ids=ids, labels=ids)), B)
    other = dict(input_ids=ids, labels=_ids(seed=5))
    _assert_same_output(_run(eg, _bind(model, other)), model(**other, use_cache=False))


def test_gpt2_train_mode_dropout_same_seed():
    model, inputs = _gpt2()
    model.train()
    bound = _bind(model, inputs)
    eg = export_flat_graph(model, bound, B)
    assert eg.training
    ref = copy.deepcopy(model)
    for rows in (B, 2):
        part = _rows(bound, rows)
        torch.manual_seed(123)
        out = _run(eg, part)
        torch.manual_seed(123)
        expected = ref(**part, use_cache=False)
        _assert_same_output(out, expected)
    torch.manual_seed(1)
    first = _run(eg, bound).logits
    torch.manual_seed(2)
    assert not torch.equal(_run(eg, bound).logits, first)  # dropout is live


def test_resnet_train_mode_updates_the_users_batchnorm_buffers():
    model, inputs = _resnet()
    model.train()
    bound = _bind(model, inputs)
    before = {n: b.clone() for n, b in model.named_buffers()}
    eg = export_flat_graph(model, bound, B)
    for n, b in model.named_buffers():  # exporting does not run the model
        assert torch.equal(b, before[n]), n
    ref = copy.deepcopy(model)
    for rows in (B, 2, 1):
        part = _rows(bound, rows)
        out = _run(eg, part)
        expected = ref(**part)
        _assert_same_output(out, expected)
        out.loss.backward()
        expected.loss.backward()
    _assert_same_grads(model, ref)
    ref_buffers = dict(ref.named_buffers())
    for n, b in model.named_buffers():
        torch.testing.assert_close(b, ref_buffers[n], msg=n)
    bn = model.resnet.embedder.embedder.normalization
    assert int(bn.num_batches_tracked) == 3
    assert not torch.equal(bn.running_mean, before["resnet.embedder.embedder.normalization.running_mean"])


def test_batch_size_one_example_runs_on_larger_batches():
    model, inputs = _llama()
    model.eval()
    bound = _bind(model, inputs)
    eg = export_flat_graph(model, _rows(bound, 1), 1)
    for rows in (1, 3):
        part = _rows(bound, rows)
        _assert_same_output(_run(eg, part), model(**part, use_cache=False))


@dataclasses.dataclass
class _Out:
    y: torch.Tensor
    aux: dict
    tag: str = "x"


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x, pair, cfg=None, flag=True, n=3, *rest, extra=None, **kw):
        h = self.a(x) * self.scale
        if flag:
            h = h + pair[0] * n
        h = h + pair[1]["z"]
        for r in rest:
            h = h + r
        if extra is not None:
            h = h + extra
        h = h + kw["k"]
        return _Out(self.b(h), {"h": h, "n": n})


def test_nested_inputs_var_args_kwargs_and_dataclass_output():
    model = _Nested()
    g = torch.Generator().manual_seed(0)
    x, p0, r = (torch.randn(B, 6, generator=g) for _ in range(3))
    z, k = torch.randn(1, 6, generator=g), torch.randn(6, generator=g)

    def call(rows):
        return inspect.signature(model.forward).bind(
            x[:rows], (p0[:rows], {"z": z}), None, True, 5, r[:rows], extra=None, k=k
        )

    eg = export_flat_graph(model, call(B).arguments, B)
    assert eg.input_names == ["x", "pair_0", "pair_1_z", "rest_0", "kw_k"]
    for rows in (B, 1):
        ba = call(rows)
        out = _run(eg, ba.arguments)
        _assert_same_output(out, model(*ba.args, **ba.kwargs))
        assert out.aux["n"] == 5 and out.tag == "x"


def test_errors_are_clear():
    class Specialises(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return self.l(x).reshape(4, -1)

    with pytest.raises(ExportRouteError, match="batch size as a constant"):
        export_flat_graph(Specialises(), {"x": torch.randn(4, 4)}, 4)

    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x

    # a sum over the batch: micro-batches need not go the whole batch's way; on meta there are no values to go by
    with pytest.raises(ExportRouteError, match=r"test_export_route.py:\d+ in forward: if x.sum\(\) > 0:.*on a value over the batch"):
        export_flat_graph(DataDependent(), {"x": torch.randn(4, 4)}, 4)
    with pytest.raises(ExportRouteError, match=r"test_export_route.py:\d+ in forward"):
        export_flat_graph(DataDependent(), {"x": torch.randn(4, 4, device="meta")}, 4)

    class ByMax(nn.Module):
        def forward(self, x):
            if x.amax() > 0:  # the batch's value is one micro-batch's: traced the example's way, checked on each micro-batch
                return x * 2
            return x

    eg = export_flat_graph(ByMax(), {"x": torch.randn(4, 4)}, 4)
    assert eg.branches_taken and re.search(r"test_export_route.py:\d+ in forward: if x.amax\(\) > 0:", eg.branches_taken[0]), eg.branches_taken
    assert [n for n in eg.graph_module.graph.nodes if n.meta.get("branch_taken")]

    with pytest.raises(ValueError, match="batch_size=3"):
        export_flat_graph(DataDependent(), {"x": torch.randn(4, 4)}, 3)


def test_a_branch_taken_with_no_check_heard_is_refused_not_specialised(monkeypatch):
    """Where autopipe does not hear export decide a branch (another torch's log wording), no check would be kept: refused, never a graph
    silently holding one way."""
    export_route = inspect.getmodule(export_flat_graph)

    class ByMax(nn.Module):
        def forward(self, x):
            if x.amax() > 0:
                return x * 2
            return x

    monkeypatch.setattr(export_route.BranchesTaken, "filter", lambda self, record: False)
    with pytest.raises(ExportRouteError, match="found no check of it"):
        export_flat_graph(ByMax(), {"x": torch.randn(4, 4)}, 4)


def test_meta_device_model_exports_without_memory():
    with torch.device("meta"):
        model, _ = _gpt2()
    ids = torch.zeros(B, T, dtype=torch.long, device="meta")
    eg = export_flat_graph(model, _bind(model, dict(input_ids=ids, labels=ids)), B)
    gm = eg.graph_module
    assert gm.get_parameter("lm_head.weight") is model.lm_head.weight
    logits = next(n for n in gm.graph.nodes if n.op == "output").args[0][1]
    assert logits.meta["val"].shape[1:] == (T, 100)
