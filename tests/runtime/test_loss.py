"""Losses that average over a count the data sets: cross-entropy's mean over the targets it does not ignore, inside the
model or in ``pipe.step``'s loss_fn (torch's loss itself, or called inside a lambda over targets it transforms), equals
the plain model's in float64 under every schedule; a loss_fn whose mean autopipe cannot weigh is refused, not run
silently wrong."""
import copy
import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from zoo import GPT

TOLERANCE = 1e-10
V = 11


def grads_of(model):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] is None) == (want[name] is None), name
        if want[name] is not None:
            scale = want[name].abs().max().item() or 1.0
            assert (got[name] - want[name]).abs().max().item() / scale < TOLERANCE, name


class Classifier(nn.Module):
    def __init__(self, log_probs: bool = False):
        super().__init__()
        self.a, self.m, self.b, self.log_probs = nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 4), log_probs

    def forward(self, x):
        out = self.b(torch.tanh(self.m(torch.tanh(self.a(x)))))
        return F.log_softmax(out, -1) if self.log_probs else out


def ignored_targets(ignore_index: int = -100):
    """8 rows in 4 micro-batches of 2: the first all ignored, the second half ignored."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 5, dtype=torch.double), torch.randint(2, 4, (8,))
    y[:3] = ignore_index
    return x, y


WEIGHTS = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.double)
TORCH_LOSSES = {
    "F.cross_entropy": (F.cross_entropy, False),
    "CrossEntropyLoss(weight, label_smoothing)": (nn.CrossEntropyLoss(weight=WEIGHTS, label_smoothing=0.1), False),
    "partial(F.cross_entropy, ignore_index=1)": (functools.partial(F.cross_entropy, ignore_index=1, label_smoothing=0.2), False),
    "NLLLoss(weight)": (nn.NLLLoss(weight=WEIGHTS), True),
    "F.nll_loss": (F.nll_loss, True),
}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zbv"])
@pytest.mark.parametrize("name", list(TORCH_LOSSES))
def test_pipe_step_with_torch_cross_entropy_over_ignored_targets_is_the_plain_models(name, schedule):
    """The per-micro-batch means weighted by rows were NaN (a micro-batch of ignored targets only) and 55% off."""
    loss_fn, log_probs = TORCH_LOSSES[name]
    x, y = ignored_targets(getattr(loss_fn, "keywords", {}).get("ignore_index", -100))
    model = Classifier(log_probs).double()
    reference = copy.deepcopy(model)
    pipe = autopipe.compile(model, devices=["cpu"] * 2, chunks=4, schedule=schedule)
    loss = pipe.step(x, target=y, loss_fn=loss_fn)
    want = loss_fn(reference(x), y)
    want.backward()
    assert abs(loss.item() - want.item()) <= TOLERANCE * abs(want.item())
    assert_same_grads(grads_of(model), grads_of(reference))


def token_sum(out, target):
    """A mean over a mask the data sets, written by hand: its sum and its count."""
    valid = target != -100
    return (F.cross_entropy(out, target, reduction="none") * valid).sum() + 0.1 * (out[valid] ** 2).sum(), valid.sum()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zbv"])
def test_a_loss_fn_returning_sum_and_count_is_the_mean_over_the_whole_count(schedule):
    """Any loss made exact: the sum and what it is over; the step divides by the whole count (Megatron's per-token loss)."""
    x, y = ignored_targets()
    model = Classifier().double()
    reference = copy.deepcopy(model)
    pipe = autopipe.compile(model, devices=["cpu"] * 2, chunks=4, schedule=schedule)
    loss = pipe.step(x, target=y, loss_fn=token_sum)
    total, count = token_sum(reference(x), y)
    want = total / count
    want.backward()
    assert abs(loss.item() - want.item()) <= TOLERANCE * abs(want.item())
    assert_same_grads(grads_of(model), grads_of(reference))


def test_a_mean_cross_entropy_over_targets_the_output_sets_is_refused_before_grad_is_touched():
    """Targets computed from the model's output cannot be counted before the step: weighted by rows, their means are
    not the plain model's loss, and a mean over as many targets a row in every micro-batch is."""
    x, y = ignored_targets()
    torch.manual_seed(0)
    model = Classifier().double()
    pipe = autopipe.compile(model, devices=["cpu"] * 2, chunks=4, schedule="1f1b")
    with pytest.raises(ValueError, match=r"cross_entropy means over .* uncounted before the step \(its target comes "
                                         r"from the model's output\).*\(sum, count\)") as refused:
        pipe.step(x, target=y, loss_fn=lambda out, target: F.cross_entropy(
            out, torch.where(out[:, 0] > out[:, 1], target, -100)))
    assert len(str(refused.value)) <= 300 and "docs/faithfulness.md" in str(refused.value)
    assert all(p.grad is None for p in model.parameters())  # nothing half-applied
    reference = copy.deepcopy(model)
    pseudo_labels = lambda out, target: F.cross_entropy(out, out.argmax(-1))  # noqa: E731  one target a row
    loss = pipe.step(x, target=y, loss_fn=pseudo_labels)
    want = pseudo_labels(reference(x), y)
    want.backward()
    assert abs(loss.item() - want.item()) <= TOLERANCE * want.item()
    assert_same_grads(grads_of(model), grads_of(reference))


class FewerTargetsAtTheStep:
    """A loss_fn that is not a pure function of its inputs: from its fifth call on, it ignores one more target."""

    def __init__(self):
        self.calls = 0

    def __call__(self, out, target):
        self.calls += 1
        return F.cross_entropy(out, target.masked_fill(torch.arange(len(target)) == 0, -100) if self.calls > 4 else target)


def test_a_loss_fn_meeting_other_targets_at_the_step_than_before_it_is_refused():
    x, y = ignored_targets()
    model = Classifier().double()
    pipe = autopipe.compile(model, devices=["cpu"] * 2, chunks=4)
    with pytest.raises(ValueError, match=r"loss_fn gave cross_entropy 1 targets in micro-batch 2 at the step, 2 "
                                         r"when autopipe ran it before the step.*pure function") as refused:
        pipe.step(x, target=y, loss_fn=FewerTargetsAtTheStep())
    assert len(str(refused.value)) <= 300
    assert all(p.grad is None for p in model.parameters())


# -- the losses people write for a causal LM, in a loss_fn ---------------------------------------------------------

LM_WEIGHTS = torch.linspace(0.5, 2.0, V, dtype=torch.double)
LM_CROSS_ENTROPY = nn.CrossEntropyLoss(ignore_index=-1, weight=LM_WEIGHTS, label_smoothing=0.1)


def log_softmax_nll(logits, labels):
    log_probs = F.log_softmax(logits, dim=-1)
    return F.nll_loss(log_probs[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), weight=LM_WEIGHTS)


CAUSAL_LM_LOSSES = {
    "F.cross_entropy of shifted labels": lambda logits, y: F.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                                            y[:, 1:].flatten()),
    "a CrossEntropyLoss module": lambda logits, y: LM_CROSS_ENTROPY(logits[:, :-1].flatten(0, 1),
                                                                     y[:, 1:].clamp(min=-1).flatten()),
    "nll_loss of log_softmax": log_softmax_nll,
    "the rows a mask of the labels selects": lambda logits, y: F.cross_entropy(logits[y != -100], y[y != -100]),
}


def small_gpt():
    torch.manual_seed(0)
    return GPT(vocab=V, d=16, heads=2, layers=2, block=8, dropout=None).double()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("name", list(CAUSAL_LM_LOSSES))
def test_the_causal_lm_losses_people_write_in_a_loss_fn_are_the_plain_models(name, schedule):
    """Refused before (the first three: a mean over the labels not ignored, weighted by rows), or silently wrong (the
    mask: the same mean written without -100 targets)."""
    loss_fn = CAUSAL_LM_LOSSES[name]
    ids, labels = labelled_tokens()  # the first micro-batch has no label counted
    model = small_gpt()
    reference = copy.deepcopy(model)
    pipe = autopipe.compile(model, devices=["cpu"] * 2, chunks=4, schedule=schedule)
    loss = pipe.step(ids, target=labels, loss_fn=loss_fn)
    want = loss_fn(reference(ids), labels)
    want.backward()
    assert abs(loss.item() - want.item()) <= TOLERANCE * want.item()
    assert_same_grads(grads_of(model), grads_of(reference))


def two_heads_and_a_z_loss(logits, labels):
    """Two means over different counts of targets and a mean over every position (PaLM's z-loss)."""
    next_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    same_token = F.cross_entropy(logits.flatten(0, 1), labels.masked_fill(labels < 4, -100).flatten())
    return next_token + 0.5 * same_token + 1e-2 * logits.logsumexp(-1).pow(2).mean()


def test_a_sum_of_means_over_different_counts_in_a_loss_fn_is_the_plain_models():
    """Each mean call is made its share of the whole batch's mean; the rest is a mean over rows, weighted by rows."""
    ids, labels = labelled_tokens()
    model = small_gpt()
    reference = copy.deepcopy(model)
    pipe = autopipe.compile(model, devices=["cpu"] * 2, chunks=4, schedule="1f1b")
    loss = pipe.step(ids, target=labels, loss_fn=two_heads_and_a_z_loss)
    want = two_heads_and_a_z_loss(reference(ids), labels)
    want.backward()
    assert abs(loss.item() - want.item()) <= TOLERANCE * want.item()
    assert_same_grads(grads_of(model), grads_of(reference))


# -- a loss the model computes itself ------------------------------------------------------------

class CausalLM(nn.Module):
    """A loss over shifted labels, as Hugging Face's causal LMs compute it: a mean over the labels not -100."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.emb, self.l1, self.l2, self.head = nn.Embedding(V, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, V)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.l2(torch.tanh(self.l1(self.emb(ids))))))
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1)), logits


class SparseMaskedLM(CausalLM):
    """A sparse prediction head (ModernBERT's ``sparse_prediction``): the logits of the masked positions only, rows
    selected by value, and the mean cross-entropy over them."""

    def forward(self, ids, labels):
        h = torch.tanh(self.l2(torch.tanh(self.l1(self.emb(ids)))))
        labels = labels.view(-1)
        h = h.view(labels.shape[0], -1)
        masked = labels != -100
        logits = self.head(h[masked])
        return F.cross_entropy(logits, labels[masked]), logits


def labelled_tokens():
    """Uneven -100 counts per micro-batch of 2 rows: none counted in the first, 3 in the third."""
    torch.manual_seed(1)
    ids = torch.randint(0, V, (8, 6))
    labels = ids.clone()
    labels[:2] = -100
    labels[4, 3:] = -100
    labels[5, :4] = -100
    return ids, labels


@pytest.mark.parametrize("route", ["fx", "export"])
@pytest.mark.parametrize("model_type", [CausalLM, SparseMaskedLM])
def test_a_models_mean_over_labels_not_ignored_merges_by_count(model_type, route):
    ids, labels = labelled_tokens()
    torch.manual_seed(0)
    model = model_type().double()
    reference = copy.deepcopy(model)
    pipe = autopipe.compile(model, devices=["cpu"] * 2, chunks=4, route=route)
    (loss, logits), (want, want_logits) = pipe(ids, labels), reference(ids, labels)
    assert [t.scalar_merge for t in pipe.plan.tensors.values() if t.is_output and not t.shape] == ["count"]
    assert "merged exactly, each micro-batch's mean weighted by its count" in str(pipe.plan)
    assert abs(loss.item() - want.item()) <= TOLERANCE * want.item()
    torch.testing.assert_close(logits, want_logits, rtol=1e-12, atol=0)  # the sparse head's: the rows each micro-batch selected
    loss.backward()
    want.backward()
    assert_same_grads(grads_of(model), grads_of(reference))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zbv"])
def test_pipe_step_weighs_the_models_own_loss_by_its_count_of_labels(schedule):
    """1F1B runs the first micro-batch's backward before the later forwards: the counts come before the step."""
    ids, labels = labelled_tokens()
    torch.manual_seed(0)
    model = CausalLM().double()
    reference = copy.deepcopy(model)
    pipe = autopipe.compile(model, devices=["cpu"] * 2, chunks=4, schedule=schedule)
    loss = pipe.step(ids, labels, loss_fn=lambda out, _: out[0])
    want = reference(ids, labels)[0]
    want.backward()
    assert abs(loss.item() - want.item()) <= TOLERANCE * want.item()
    assert_same_grads(grads_of(model), grads_of(reference))


MODEL_LOSS_IN_A_LOSS_FN = {
    "twice the model's loss": lambda out, labels: 2 * out[0],
    "the model's loss and a loss_fn's own mean": lambda out, labels: out[0] + 0.5 * F.cross_entropy(
        out[1].flatten(0, 1), labels.flatten()),
}


@pytest.mark.parametrize("name", list(MODEL_LOSS_IN_A_LOSS_FN))
def test_the_models_own_loss_inside_a_loss_fns_expression_is_weighed_by_its_count(name):
    """Weighted by rows inside an expression before (silently wrong, NaN here), or refused with a mean beside it."""
    loss_fn = MODEL_LOSS_IN_A_LOSS_FN[name]
    ids, labels = labelled_tokens()
    torch.manual_seed(0)
    model = CausalLM().double()
    reference = copy.deepcopy(model)
    pipe = autopipe.compile(model, devices=["cpu"] * 2, chunks=4, schedule="1f1b")
    loss = pipe.step(ids, labels, target=labels, loss_fn=loss_fn)
    want = loss_fn(reference(ids, labels), labels)
    want.backward()
    assert abs(loss.item() - want.item()) <= TOLERANCE * want.item()
    assert_same_grads(grads_of(model), grads_of(reference))


class SummedLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, y, n_items):
        return F.mse_loss(self.lin(x), y, reduction="sum") / n_items  # Hugging Face's loss under num_items_in_batch


def test_pipe_step_does_not_reweigh_a_loss_the_model_sums():
    """pipe(x) summed such a loss over micro-batches; pipe.step weighed it by rows as well (a quarter of it at 4 chunks)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 4, dtype=torch.double), torch.randn(8, 3, dtype=torch.double)
    n_items = torch.tensor(24.0, dtype=torch.double)
    model = SummedLoss().double()
    reference = copy.deepcopy(model)
    pipe = autopipe.compile(model, devices=["cpu"] * 2, chunks=4)
    loss = pipe.step(x, y, n_items)
    want = reference(x, y, n_items)
    want.backward()
    assert abs(loss.item() - want.item()) <= TOLERANCE * want.item()
    assert_same_grads(grads_of(model), grads_of(reference))


class TargetsFromActivations(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        out = self.lin(x)
        pseudo = out.detach().argmax(-1).masked_fill(x[:, 0] > 0, -100)  # pseudo-labels: set by the weights, not the data
        return F.cross_entropy(out, pseudo)


def test_targets_the_weights_set_are_not_counted_ahead_and_the_plan_says_so():
    model = TargetsFromActivations()
    pipe = autopipe.compile(model, devices=["cpu"] * 2, chunks=4, example_inputs=(torch.randn(8, 4),))
    assert [t.scalar_merge for t in pipe.plan.tensors.values() if t.is_output] == ["unknown"]
    assert "cannot read as a mean or a sum over its samples" in str(pipe.plan)


def test_the_token_mean_losses_over_two_torchrun_ranks_are_the_plain_models(tmp_path):
    """Under torchrun only the last stage's rank runs the loss: the counts are its own, and the scale of a (sum, count)
    loss reaches the other rank by a broadcast."""
    import test_distributed
    run = test_distributed.launch("losses", 2, tmp_path, worker=os.path.join(os.path.dirname(__file__), "loss_worker.py"))
    assert run.codes == [0, 0], run.log()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    x, y = ignored_targets()
    ids, labels = labelled_tokens()
    plain = {"F.cross_entropy": (Classifier, lambda m: F.cross_entropy(m(x), y)),
             "(sum, count)": (Classifier, lambda m: (lambda s, c: s / c)(*token_sum(m(x), y))),
             "the model's own": (CausalLM, lambda m: m(ids, labels)[0]),
             "a causal LM's lambda": (small_gpt, lambda m: CAUSAL_LM_LOSSES["F.cross_entropy of shifted labels"](
                 m(ids), labels))}
    for name, (model_type, loss_of) in plain.items():
        torch.manual_seed(0)
        reference = model_type().double()
        want = loss_of(reference)
        want.backward()
        assert ranks[0][name]["loss"] is None
        assert abs(ranks[1][name]["loss"] - want.item()) <= TOLERANCE * want.item(), name
        got = {**ranks[0][name]["grads"], **ranks[1][name]["grads"]}  # a tied weight by each rank's name for it
        tied = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
        assert set(grads_of(reference)) <= set(got) <= set(tied), name
        assert_same_grads(got, {n: tied[n] for n in got})


class SelectedRowsMean(nn.Module):
    """A mean over the rows a mask of the inputs selects (rows selected by value), written four ways."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.a, self.b = how, nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x, y):
        kept = y[:, 0] > 0
        h = self.b(torch.tanh(self.a(x)))
        if self.how == "mean":
            return (h[kept] ** 2).mean()
        if self.how == "mse_loss":
            return F.mse_loss(h[kept], y[kept])
        if self.how == "two means":  # over the same count: one mean
            return F.mse_loss(h[kept], y[kept]) + 0.5 * h[kept].abs().mean()
        if self.how == "plus a batch mean":  # over two counts: no merge of micro-batch values is the plain model's
            return (h[kept] ** 2).mean() + h.pow(2).mean()
        return h[h[:, 0] > 0].mean()  # a mask the weights set: not counted before the step


def selected_rows_batch():
    torch.manual_seed(0)
    x, y = torch.randn(8, 4, dtype=torch.double), torch.randn(8, 3, dtype=torch.double)
    y[:2, 0], y[4, 0] = -1.0, -1.0  # the first micro-batch selects no row
    return x, y


@pytest.mark.parametrize("how", ["mean", "mse_loss", "two means"])
def test_a_mean_over_rows_a_mask_of_the_inputs_selects_merges_by_count(how):
    x, y = selected_rows_batch()
    model = SelectedRowsMean(how).double()
    reference = copy.deepcopy(model)
    pipe = autopipe.compile(model, devices=["cpu"] * 2, chunks=4, route="fx")
    loss, want = pipe(x, y), reference(x, y)
    assert [t.scalar_merge for t in pipe.plan.tensors.values() if t.is_output] == ["count"]
    assert abs(loss.item() - want.item()) <= TOLERANCE * want.item()
    loss.backward()
    want.backward()
    assert_same_grads(grads_of(model), grads_of(reference))


@pytest.mark.parametrize("how", ["plus a batch mean", "a mask the weights set"])
def test_a_mean_over_selected_rows_with_no_count_known_ahead_stays_refused(how):
    x, y = selected_rows_batch()
    with pytest.raises(ValueError, match="reads rows selected by value"):
        autopipe.compile(SelectedRowsMean(how).double(), devices=["cpu"] * 2, chunks=4, route="fx")(x, y)
