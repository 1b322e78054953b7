"""passes/target_counts.py: the count program of a loss merged by count runs on a micro-batch's own inputs, wherever
they are (Note [counts on the inputs' device]): a transformers causal LM traced on meta, as under torchrun, counts
the real labels not ignored, as the plain model's loss divides by them."""
import pytest
import torch

import autopipe
from autopipe.options import Options

transformers = pytest.importorskip("transformers")


def test_a_model_traced_on_meta_counts_its_real_labels():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, 3:] = -100
    compiled = autopipe.run_passes(model, (), {"input_ids": ids, "labels": labels},
                                   Options.make([torch.device("cpu")] * 2, chunks=2))
    program = compiled.main
    rows = [program.traced.flat_inputs((), {"input_ids": i, "labels": y}) for i, y in zip(ids.chunk(2),
                                                                                         labels.chunk(2))]
    counts = [program.count_targets(row) for row in rows]
    # the shifted labels the loss reads: each row's last seven, row 0 ignored from position 3 on
    assert [list(c.values()) for c in counts] == [[2.0 + 7.0], [14.0]]
