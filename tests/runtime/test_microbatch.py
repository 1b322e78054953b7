import pytest
import torch

from autopipe.runtime import microbatch


def test_sizes_cover_the_batch_and_differ_by_at_most_one():
    assert microbatch.micro_batch_sizes(10, 4) == [3, 3, 2, 2]
    assert microbatch.micro_batch_sizes(8, 8) == [1] * 8


def test_split_and_merge_roundtrip_with_scalar_broadcast():
    x, s = torch.randn(10, 3), torch.tensor(2.0)
    parts = microbatch.split([x, s], [4, 3, 3])
    assert [p[0].shape[0] for p in parts] == [4, 3, 3]
    assert all(p[1] is s for p in parts)
    torch.testing.assert_close(microbatch.merge([p[0] for p in parts], [4, 3, 3]), x)


def test_scalar_outputs_merge_as_weighted_mean_and_grads_split_back():
    parts = [torch.tensor(1.0), torch.tensor(4.0)]
    assert microbatch.merge(parts, [3, 1]).item() == pytest.approx(1.75)
    grads = microbatch.split_grad(torch.tensor(1.0), parts, [3, 1])
    assert [g.item() for g in grads] == [0.75, 0.25]


def test_a_tensor_without_the_batch_goes_whole_to_every_micro_batch():
    x, mask = torch.randn(8, 2), torch.randn(5, 2)
    parts = microbatch.split([x, mask], [4, 4])
    assert [p[0].shape[0] for p in parts] == [4, 4] and all(p[1] is mask for p in parts)
    assert microbatch.shape_key(x, 8) == (2,) and microbatch.shape_key(mask, 8) == ("whole", 5, 2)


def test_chunks_must_be_positive():
    with pytest.raises(ValueError, match="chunks"):
        microbatch.micro_batch_sizes(8, 0)


def test_parts_with_rows_a_sample_merge_and_their_gradient_splits_by_rows():
    parts = [torch.randn(3 * 5, 2), torch.randn(2 * 5, 2)]  # (micro-batch * seq, ...) flattened batch-major
    merged = microbatch.merge(parts, [3, 2])
    assert torch.equal(merged, torch.cat(parts))
    assert [g.shape[0] for g in microbatch.split_grad(torch.ones_like(merged), parts, [3, 2])] == [15, 10]


@pytest.mark.parametrize("parts", [[torch.randn(2), torch.randn(2)], [torch.randn(3), torch.randn(3)],
                                   [torch.randn(3, 16), torch.randn(2, 4)]])  # a length set by the data (VITS' waveform)
def test_parts_that_do_not_scale_with_the_micro_batch_are_refused(parts):
    with pytest.raises(ValueError, match="does not carry the batch"):
        microbatch.merge(parts, [3, 2])
