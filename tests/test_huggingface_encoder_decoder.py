"""transformers' encoder-decoders trained on labels, through autopipe.compile: loss and every gradient equal the plain
model's (float64). Their decoder inputs are the labels shifted right, written in place into a new tensor (T5's
_shift_right, BART's shift_tokens_right, the same in Marian, mBART, ...): partition keeps the writes in the stage that
makes that tensor, which sends it on written, wherever the balanced cut would have fallen."""
import pytest
import torch

import autopipe

transformers = pytest.importorskip("transformers")


def t5(target_length: int):
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                                   num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).double()
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1::2, 5:] = 0  # padding
    labels = torch.randint(1, 64, (4, target_length), generator=g)
    labels[0, -2:] = -100  # ignored targets
    return model, {"input_ids": torch.randint(1, 64, (4, 8), generator=g), "attention_mask": mask, "labels": labels}


# each a length of labels at which the balanced cut into that many stages falls inside _shift_right
@pytest.mark.parametrize("n_stages, target_length", [(2, 4), (3, 8), (4, 4)])
def test_t5_trained_on_labels_is_the_plain_model(n_stages, target_length):
    model, inputs = t5(target_length)
    want = model(**inputs).loss
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    pipe = autopipe.compile(model, devices=n_stages, chunks=2)
    got = pipe(**inputs).loss
    got.backward()
    assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-10, atol=1e-12, msg=lambda m: f"{n}: {m}")
    stage_of = {name: s.index for s in pipe.plan.stages for name in s.nodes}
    writes = [stage_of[n] for n in ("new_zeros", "copy_", "fill_", "masked_fill_")]
    assert len(set(writes)) == 1 and not any("new_zeros" in s.replicated for s in pipe.plan.stages)
