"""transformers' LLaVA (its own code, a tiny config, random weights) through autopipe.compile with micro-batches of one
row: its image features, a list of one tensor a sample, and every other output, and the gradients through them, are
the plain model's."""
import copy

import pytest
import torch

import autopipe
from zoo import tensor_leaves

transformers = pytest.importorskip("transformers")


def tiny_llava():
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=16, patch_size=4, projection_dim=32)
    text = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=64, vocab_size=96, max_position_embeddings=64)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=95,
                                      image_seq_length=16, vision_feature_layer=-2,
                                      vision_feature_select_strategy="default")
    return transformers.LlavaForConditionalGeneration(config).double()


@pytest.mark.parametrize("batch, chunks", [(2, 2), (5, 4)])
def test_llavas_per_image_features_and_logits_are_the_plain_models_with_one_row_micro_batches(batch, chunks):
    """LLaVA's Python fixes the batch size (it unbinds its image features into a list), so it is exported once per
    micro-batch size; at a micro-batch of one row the list of one image's features was not read as a list of one tensor
    a sample, and compile refused the output ("dim 0 does not hold the batch as whole samples"). Micro-batches of 2 and
    1 rows (batch 3, chunks 2), and of 1 row each (batch 4, chunks 4): image features (a list as long as the batch),
    logits, hidden states, and the gradients of a loss over the image features and logits, by pipe(x) + backward."""
    torch.manual_seed(0)
    model = tiny_llava()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 90, (batch, 24))
    ids[:, 2:18] = 95
    inputs = {"input_ids": ids, "pixel_values": torch.randn(batch, 3, 16, 16, dtype=torch.double)}
    pipe = autopipe.compile(model, devices=2, chunks=chunks)
    out, want = pipe(**inputs), reference(**inputs)
    features, expected = out.image_outputs.pooler_output, want.image_outputs.pooler_output
    assert isinstance(features, list) and len(features) == len(expected) == batch
    got_leaves, want_leaves = tensor_leaves(out), [t for k, v in want.items() if k != "cache" for t in tensor_leaves(v)]
    assert len(got_leaves) == len(want_leaves)
    for got, wanted in zip(got_leaves, want_leaves):
        torch.testing.assert_close(got, wanted, rtol=1e-12, atol=1e-12)
    weights = torch.randn(batch, 16, 32, dtype=torch.double)
    loss = lambda o: (torch.stack(o.image_outputs.pooler_output) * weights).sum() + o.logits.square().mean()  # noqa: E731
    loss(out).backward()
    loss(want).backward()
    after = model(**inputs)
    torch.testing.assert_close(after.logits, want.logits, rtol=0, atol=0)
    assert len(after.image_outputs.hidden_states) == len(want.image_outputs.hidden_states)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
