"""autopipe/random_ops.py: the one list of random ops, and versions of them that draw from a generator."""
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopipe import random_ops
from autopipe.random_ops import UnroutedRandomOp, is_random_target, module_draws

aten = torch.ops.aten


@pytest.mark.parametrize("target", [
    F.dropout, F.dropout2d, F.alpha_dropout, torch.dropout, torch.ops.aten.native_dropout.default,
    torch.randn, torch.rand_like, torch.randint, torch.bernoulli, "bernoulli_", "uniform_", "normal_",
    F.rrelu, F.scaled_dot_product_attention, aten.lstm.input, aten.randperm, F.gumbel_softmax,
])
def test_random_targets(target):
    assert is_random_target(target)


@pytest.mark.parametrize("target", [torch.add, "add_", F.relu, operator.add, torch.ops.aten.mm.default,
                                    "transpose", F.layer_norm, "operand"])  # not "rand"
def test_deterministic_targets(target):
    assert not is_random_target(target)


def test_random_modules():
    assert module_draws(nn.Sequential(nn.Linear(2, 2), nn.Dropout()))
    assert module_draws(nn.MultiheadAttention(4, 2, dropout=0.1))
    assert not module_draws(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))

    class Opaque(nn.Module):  # code fx did not look into: it may draw
        def forward(self, x):
            return x
    assert module_draws(Opaque())


def test_module_draws_follows_mode_and_probability():
    block = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.1)
    assert module_draws(block.train()) and not module_draws(block.eval())
    assert not module_draws(nn.Dropout(0.0).train())
    assert not module_draws(nn.LSTM(4, 4, num_layers=1, dropout=0.0).train())
    assert module_draws(nn.LSTM(4, 4, num_layers=2, dropout=0.5).train())


x = torch.randn(4, 6, 5, 3)
SAME_AS_TORCH = {  # (torch's own op drawing from the default generator, ours drawing from ``g``)
    "dropout": (lambda: F.dropout(x, 0.3), lambda g: random_ops.dropout(x, 0.3, generator=g)),
    "dropout-inplace": (lambda: F.dropout(x.clone(), 0.3, inplace=True),
                        lambda g: random_ops.dropout(x.clone(), 0.3, inplace=True, generator=g)),
    "dropout1d-unbatched": (lambda: F.dropout1d(x[0], 0.3), lambda g: random_ops.dropout1d(x[0], 0.3, generator=g)),
    "dropout2d": (lambda: F.dropout2d(x, 0.3), lambda g: random_ops.dropout2d(x, 0.3, generator=g)),
    "dropout3d-unbatched": (lambda: F.dropout3d(x, 0.3), lambda g: random_ops.dropout3d(x, 0.3, generator=g)),
    "feature_dropout": (lambda: torch.feature_dropout(x, 0.3, True),
                        lambda g: random_ops.feature_dropout(x, 0.3, True, generator=g)),
    "alpha_dropout": (lambda: F.alpha_dropout(x, 0.3, True),
                      lambda g: random_ops.alpha_dropout(x, 0.3, True, generator=g)),
    "feature_alpha_dropout": (lambda: F.feature_alpha_dropout(x, 0.3, True),
                              lambda g: random_ops.feature_alpha_dropout(x, 0.3, True, generator=g)),
    "native_dropout": (lambda: aten.native_dropout(x, 0.3, True),
                       lambda g: random_ops.native_dropout(x, 0.3, True, generator=g)),
    "rrelu": (lambda: F.rrelu(x, training=True), lambda g: random_ops.rrelu(x, training=True, generator=g)),
    "rand_like": (lambda: torch.rand_like(x), lambda g: random_ops.rand_like(x, generator=g)),
    "randn_like": (lambda: torch.randn_like(x, dtype=torch.float64),
                   lambda g: random_ops.randn_like(x, dtype=torch.float64, generator=g)),
    "randint_like": (lambda: torch.randint_like(x, 9), lambda g: random_ops.randint_like(x, 9, generator=g)),
    "randint_like-low": (lambda: torch.randint_like(x, 3, 9), lambda g: random_ops.randint_like(x, 3, 9, generator=g)),
}


@pytest.mark.parametrize("name", list(SAME_AS_TORCH))
def test_draws_what_torch_draws_from_a_generator_in_that_state(name):
    theirs, ours = SAME_AS_TORCH[name]
    torch.manual_seed(3)
    want = theirs()
    got = ours(torch.Generator().manual_seed(3))
    for a, b in zip(*(w if isinstance(w, tuple) else (w,) for w in (want, got))):
        assert torch.equal(a, b)


def test_attention_dropout_matches_torch_and_masks_like_it():
    q = torch.randn(2, 2, 5, 4)
    torch.manual_seed(0)
    want = F.scaled_dot_product_attention(q, q, q, dropout_p=0.4, is_causal=True)
    got = random_ops.scaled_dot_product_attention(q, q, q, dropout_p=0.4, is_causal=True,
                                                  generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got, want)
    mask = torch.zeros(5, 5, dtype=torch.bool)  # every key masked: torch gives 0, not NaN
    torch.testing.assert_close(random_ops.scaled_dot_product_attention(q, q, q, mask),
                               F.scaled_dot_product_attention(q, q, q, mask))


def test_eval_and_zero_probability_return_the_input():
    assert random_ops.dropout(x, 0.5, training=False) is x
    assert random_ops.dropout(x, 0.0) is x
    assert torch.equal(random_ops.dropout(x, 1.0), torch.zeros_like(x))


class UserBlock(nn.Module):
    """Draws in several ways, some inside torch's own Python (gumbel_softmax, MultiheadAttention)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True)
        self.lstm = nn.LSTM(4, 4, num_layers=2, dropout=0.5, batch_first=True)

    def forward(self, h):
        a = self.attn(h, h, h)[0] + self.attn(h, h, h, need_weights=False)[0]
        a = a + self.lstm(h)[0] + F.gumbel_softmax(h, tau=0.5) + torch.rand_like(h)
        q = h[:, None]
        return a + F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)[:, 0] + F.rrelu(h, training=True)


def test_call_with_generator_routes_everything_the_code_draws():
    torch.manual_seed(0)
    block, h = UserBlock().train(), torch.randn(2, 5, 4)
    torch.manual_seed(9)
    first = random_ops.call_with_generator(block, torch.Generator().manual_seed(1), h)
    marker = torch.rand(3)
    again = random_ops.call_with_generator(block, torch.Generator().manual_seed(1), h)
    other = random_ops.call_with_generator(block, torch.Generator().manual_seed(2), h)
    torch.manual_seed(9)
    assert torch.equal(torch.rand(3), marker), "a random op drew from the global generator"
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_call_with_generator_refuses_a_kernel_it_cannot_route():
    def fused(q):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.5)[0]

    with pytest.raises(UnroutedRandomOp, match="_scaled_dot_product_flash_attention_for_cpu"):
        random_ops.call_with_generator(fused, torch.Generator(), torch.randn(1, 1, 3, 2))
    # with no dropout it draws nothing, and runs as without a generator
    q = torch.randn(1, 1, 3, 2)
    got = random_ops.call_with_generator(lambda q: aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0)[0],
                                         torch.Generator(), q)
    assert torch.equal(got, aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0)[0])


def test_aten_routes():
    assert random_ops.aten_route(aten.dropout.default) == ("function", random_ops.dropout)
    assert random_ops.aten_route(aten.bernoulli.p) == ("kwarg", aten.bernoulli.p)
    assert random_ops.aten_route(aten.rand.default) == ("kwarg", aten.rand.generator)
    assert random_ops.aten_route(aten.randint.low) == ("kwarg", aten.randint.low_generator)
    assert random_ops.aten_route(aten.lstm.input) == ("wrap", aten.lstm.input)
    assert random_ops.aten_route(aten._scaled_dot_product_flash_attention_for_cpu.default) == ("unrouted", None)


def test_a_kernel_that_takes_no_generator_draws_from_the_given_one_on_the_default_generators_place():
    """on_default_generator (fused attention on a GPU; tested here with a CPU kernel): the same generator
    state gives the same numbers, the generator moves on, and the default generator is left as it was."""
    q = torch.randn(64, 16)

    def fused(q):  # a kernel with no generator argument (the CPU's flash attention refuses dropout)
        return aten.native_dropout(q, 0.5, True)[0]

    torch.manual_seed(3)
    marker = torch.rand(3)
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(1)
    first = random_ops.on_default_generator(g, fused, q)
    second = random_ops.on_default_generator(g, fused, q)
    replay = random_ops.on_default_generator(torch.Generator().manual_seed(1), fused, q)
    assert torch.equal(first, replay) and not torch.equal(first, second)
    assert torch.equal(torch.rand(3), marker), "the default generator moved"


def test_fixed_draws_fix_every_random_kernel_a_model_runs_the_same_way_wherever_it_draws():
    """verify's train-mode check: the plain model draws from the global generator, the pipeline from its tasks'; under FixedDraws both
    compute the same numbers (dropout keeps everything and scales; means and midpoints elsewhere), in place, out of place and into out=."""
    x, out = torch.randn(4, 5), torch.empty(4)
    with random_ops.FixedDraws() as fixed:
        assert torch.equal(F.dropout(x, 0.5, True), x * 2)
        assert torch.equal(random_ops.dropout(x, 0.5, True, generator=torch.Generator().manual_seed(1)), x * 2)  # the pipeline's own
        assert torch.equal(torch.rand(3), torch.full((3,), 0.5)) and torch.equal(torch.randn_like(x), torch.zeros_like(x))
        assert torch.equal(torch.empty(3).uniform_(2, 4), torch.full((3,), 3.0)) and torch.equal(torch.randint(2, 9, (3,)), torch.full((3,), 2))
        assert torch.equal(torch.empty(3).normal_(5.0, 1.0), torch.full((3,), 5.0))
        assert torch.allclose(F.rrelu(x, training=True), torch.where(x >= 0, x, x * (1 / 8 + 1 / 3) / 2))
        torch.rand(4, out=out)
        assert torch.equal(out, torch.full((4,), 0.5))
        torch.bernoulli(torch.full((4,), 0.3), out=out)
        assert torch.equal(out, torch.ones(4))
    assert not fixed.unfixed
    with random_ops.FixedDraws() as fixed:
        torch.poisson(torch.ones(3))  # a kernel it does not know draws as it does, and is named
    assert fixed.unfixed == {"aten.poisson.default"}
