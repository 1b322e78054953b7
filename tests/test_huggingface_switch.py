"""transformers' Switch Transformer (a routed-MoE encoder-decoder; small config, random weights, no downloads) with
labels: its router casts its own classifier in the forward (``self.classifier = self.classifier.to(self.dtype)``), a
no-op in a model already of that dtype, which the export route failed on ("Couldn't swap Linear.weight"), and a real
change refused by name."""
import copy

import pytest
import torch

import autopipe

transformers = pytest.importorskip("transformers")
switch = pytest.importorskip("transformers.models.switch_transformers.modeling_switch_transformers")


class DenseExperts(torch.nn.Module):
    """The same sums as SwitchTransformersExperts over the same experts, every token through every expert, weighted by
    its one-hot routing. transformers' own loops over the experts hit (``for expert_idx in expert_hit``, the rows of a
    nonzero), which neither route traces yet: fx cannot iterate a Proxy, and torch.export's second try with real values
    reads the parameters as other values (torch 2.13), so it routes otherwise and its shapes disagree."""

    def __init__(self, experts: torch.nn.ModuleDict):
        super().__init__()
        self.experts = experts

    def forward(self, hidden_states, selected_experts, routing_weights):
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self.experts.values()):
            out = out + expert(hidden_states) * (selected_experts[:, 0, e, None] * routing_weights)
        return out


def tiny_switch(router_dtype=torch.float64):
    """A float64 Switch Transformer, one sparse layer in the encoder and one in the decoder, two experts; routers in
    ``router_dtype`` (the config takes float32, float16 or bfloat16 alone: the router's ``dtype`` is what its forward
    casts to)."""
    torch.manual_seed(0)
    cfg = transformers.SwitchTransformersConfig(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                num_decoder_layers=1, num_heads=2, num_experts=2, expert_capacity=4,
                                                num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = transformers.SwitchTransformersForConditionalGeneration(cfg).double().eval()
    for module in model.modules():
        if isinstance(module, switch.SwitchTransformersTop1Router):
            module.dtype = router_dtype
    generator = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(2, 64, (6, 6), generator=generator), torch.randint(2, 64, (6, 5), generator=generator)
    mask = torch.ones(6, 6, dtype=torch.long)
    mask[1, 4:] = 0  # padding
    labels[1, 3:] = -100
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_a_switch_transformer_whose_router_casts_its_classifier_trains_as_the_plain_model():
    model, batch = tiny_switch()
    reference = copy.deepcopy(model)
    dense = model(**batch).loss
    for module in list(model.modules()) + list(reference.modules()):
        if isinstance(module, switch.SwitchTransformersSparseMLP):
            module.experts = DenseExperts(module.experts)
    want = reference(**batch)
    assert torch.equal(want.loss, dense)  # the dense sums are the model's own
    want.loss.backward()
    pipe = autopipe.compile(model, devices=2, chunks=3, example_kwargs=batch)
    assert pipe.plan.route == "export" and pipe.plan.n_stages == 2
    got = pipe(**batch)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-12)
    got.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    loss = pipe.step(**batch)  # the model's own loss over its labels, per micro-batch
    torch.testing.assert_close(loss, want.loss.detach(), rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (q.grad is None) == (p.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(grads[name], q.grad, rtol=1e-10, atol=1e-14, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=lambda m: f"{name}: {m}")
    assert all(p.dtype == torch.float64 for p in model.parameters())


def test_a_switch_router_casting_a_float64_classifier_to_float32_is_refused_naming_it():
    """The plain model's first call casts each router's classifier to float32 for good, where fx would have done it
    for real while tracing and export failed on torch's swap."""
    model, batch = tiny_switch(router_dtype=torch.float32)
    with pytest.raises(autopipe.errors.ModuleCastRefused) as refused:
        autopipe.compile(model, devices=2, chunks=3, example_kwargs=batch)
    message = str(refused.value)
    assert message.startswith("the forward casts 'encoder.block.0.layer.1.mlp.router.classifier' (")
    assert "modeling_switch_transformers.py:" in message and "self.classifier = self.classifier.to(self.dtype)" in message
    assert "weight's dtype torch.float64 to torch.float32" in message and "docs/faithfulness.md" in message
    assert all(p.dtype == torch.float64 for p in model.parameters())
