"""autopipe.verify: does the pipeline compute the user's model? One training step, on deep copies: structure (float64,
against the plain model on the same micro-batches, tolerance 1e-10) and replay (checkpoint "always" = "never")."""
from __future__ import annotations

import contextlib
import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import autopipe.random_ops as random_ops
from autopipe.compile import compile as compile_pipeline
from autopipe.devices import resolve_devices
from autopipe.global_state import preserved_global_state
from autopipe.ir.batch import batch_rows
from autopipe.options import Options, as_tuple, positive_int
from autopipe.pass_chain import run_passes
from autopipe.passes.traced_model import named_leaves, register_dataclasses
from autopipe.runtime.microbatch import merge, micro_batch_sizes, split_target
from autopipe.runtime.step import model_loss
from autopipe.verify_report import GRAD_FLOOR, Check, Row, VerifyReport, dtype_name

STRUCTURE_TOLERANCE = 1e-10          # float64: a correct pipeline is at ~1e-15
OWN_DTYPE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# Replay, tied weights only: their gradient is summed from several workers in thread-timing order (last bits differ).
SHARED_GRAD_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SEED = 0
DETERMINISTIC, RANDOM, IRREPRODUCIBLE = "deterministic", "random", "irreproducible"


@dataclass
class _Step:  # what one training step computed
    outputs: list[tuple[str, torch.Tensor]]
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    has_model_loss: bool = False
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)  # parameters held by several stages
    unfixed: set[str] = field(default_factory=set)  # under FixedDraws: the random kernels it left drawing


def _step(model: torch.nn.Module, forward: Callable[[], Any], loss_fn: Callable, threads: int, seed: int = SEED,
          mode: TorchDispatchMode | None = None) -> _Step:
    """One training step; ``mode`` (random_ops.FixedDraws, Draws) around the model's forward and backward (a recompute
    draws), not around the loss's random projections."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    around_model = mode if mode is not None else contextlib.nullcontext()
    with around_model:
        output = forward()
    loss = loss_fn(output)
    with around_model:
        loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return _Step(outputs=[(n, t.detach().clone()) for n, t in _leaves(output)], loss=loss.detach().clone(),
                 grads=grads, buffers={n: b.detach().clone() for n, b in model.named_buffers()},
                 has_model_loss=_model_loss(output) is not None)


def _leaves(output: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in a (nested) output, as the pipeline flattens and merges it."""
    return [(name, t) for name, t in named_leaves(output) if isinstance(t, torch.Tensor)]


def _compare(kind: str, name: str, got: torch.Tensor | None, want: torch.Tensor | None) -> Row:
    if got is None and want is None:
        return Row(kind, name, 0.0, 0.0)
    note = ""
    if got is None or want is None:
        note = f"no {'gradient' if kind == 'grad' else 'value'} in the {'run' if got is None else 'reference'}"
        got, want = (torch.zeros_like(want), want) if got is None else (got, torch.zeros_like(got))
    if got.shape != want.shape:
        return Row(kind, name, math.inf, 0.0, note=f"shape {tuple(got.shape)} vs {tuple(want.shape)}")
    exact = torch.complex128 if want.is_complex() else torch.float64
    got, want = got.detach().cpu().to(exact), want.detach().cpu().to(exact)
    diff = torch.where((got == want) | (got.isnan() & want.isnan()), 0.0, (got - want).abs())  # max() keeps a NaN
    finite = want[want.isfinite()].abs()
    return Row(kind, name, diff.max().item() if diff.numel() else 0.0, finite.max().item() if finite.numel() else 0.0,
               note=note)


def _compare_steps(run: _Step, ref: _Step, buffers: bool = True, shared_tolerance: float | None = None) -> list[Row]:
    """Rows for the loss, outputs, gradients (``shared_tolerance``: of tied weights) and (``buffers``) buffers."""
    got, shared = dict(run.outputs), {**ref.shared, **run.shared}  # an output the run lacks compares with zeros
    grads = [_compare("grad", name, run.grads.get(name), t) for name, t in ref.grads.items()]
    floor = GRAD_FLOOR * max((g.max_abs_ref for g in grads), default=0.0)
    for row in grads:
        row.floor = floor
        if shared_tolerance is not None and row.name in shared:
            row.tolerance = shared_tolerance
            row.note = "; ".join(filter(None, [row.note, f"held by stages {', '.join(map(str, shared[row.name]))} "
                                                         f"(tied): bound {shared_tolerance:.0e}"]))
    rows = [_compare("loss", "loss", run.loss, ref.loss)]
    rows += [_compare("output", name, got.get(name), t) for name, t in ref.outputs] + grads
    # as for gradients: a running mean of centred values (~1e-18) is measured against the buffers' scale, not its own
    # rounding
    if buffers:
        kept = [_compare("buffer", n, run.buffers.get(n), t) for n, t in ref.buffers.items()]
        for row in kept:
            row.floor = GRAD_FLOOR * max((b.max_abs_ref for b in kept), default=0.0)
        rows += kept
    return rows


def _model_loss(output: Any) -> torch.Tensor | None:
    with contextlib.suppress(TypeError):  # else None: no scalar loss of the model's own
        return model_loss(output, None)


def default_loss(output: Any) -> torch.Tensor:
    """The model's own loss (a scalar output, ``.loss``, ``["loss"]``), else ``sum(leaf * R_k)`` over the floating
    output leaves with fixed random projections ``R_k`` (unlike a sum of squares, not flattened by a LayerNorm)."""
    if (loss := _model_loss(output)) is not None:
        return loss
    leaves = [t for _, t in _leaves(output) if t.is_floating_point()]
    if not leaves:
        raise TypeError(f"the model's output ({type(output).__name__}) holds no floating tensor: pass loss_fn=")
    return sum((t * torch.randn(t.shape, generator=torch.Generator().manual_seed(1_000_003 + k), dtype=torch.float64)
                .to(t.device, t.dtype)).sum() for k, t in enumerate(leaves))


def _copy(model: torch.nn.Module, inputs: Any, dtype: torch.dtype | None, mode: bool | None = None):
    """A deep copy of the model with no gradients, in ``mode``, and detached inputs; floating tensors in ``dtype``."""
    try:
        twin = copy.deepcopy(model)
    except Exception as e:
        raise TypeError(f"autopipe.verify works on deep copies of the model, and copy.deepcopy({type(model).__name__}) "
                        f"failed: {type(e).__name__}: {e}") from e
    twin.zero_grad()
    twin = twin.to(dtype) if dtype else twin
    cast = lambda t: t.detach().to(dtype) if dtype and t.is_floating_point() else t.detach()
    return twin if mode is None else twin.train(mode), pytree.tree_map_only(torch.Tensor, cast, inputs)


# Note [dropout hidden behind a zero gain]: behind a gain initialised to zero (layer scale, ReZero, Swin V2's
# post-norm) a dropout branch changes no output at first, only the gain's gradient, and two seeds can agree by
# chance (Gumbel routing whose winner is mostly the same). So a model is random when a random kernel draws in
# three steps, gradients included, not when its outputs change with the seed.
def _randomness(model: torch.nn.Module, args, kwargs, loss_fn: Callable, dtype: torch.dtype | None = None,
                mode: bool | None = None):
    """Three steps of a copy on the same input and buffers, seeds 1, 1, 2: DETERMINISTIC all equal; RANDOM (dropout)
    equal under one seed only; IRREPRODUCIBLE not even that (a Python counter, the model's own generator). The gradients
    count with the outputs, and a random kernel that draws makes the model random (Note [dropout hidden behind a zero
    gain])."""
    twin, (args, kwargs) = _copy(model, (args, kwargs), dtype, mode)
    buffers = [(b, b.clone()) for b in twin.buffers()]
    results, kernels = [], random_ops.Draws()
    with preserved_global_state(), torch.enable_grad():  # _step sets the seed and one thread
        for seed in (1, 1, 2):
            with torch.no_grad():
                for buffer, before in buffers:
                    buffer.copy_(before)
            twin.zero_grad(set_to_none=True)
            step = _step(twin, lambda: twin(*args, **kwargs), loss_fn, threads=1, seed=seed, mode=kernels)
            results.append([t for _, t in step.outputs] + list(step.grads.values()))
    same = [all(_compare("", "", x, y).max_abs_diff == 0 for x, y in zip(r, results[0])) for r in results[1:]]
    return IRREPRODUCIBLE if not same[0] else DETERMINISTIC if same[1] and not kernels.seen else RANDOM


def _error_text(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()] or [""]
    text = [f"{type(e).__name__}: {lines[0]}", *lines[1:6]] + (["..."] if len(lines) > 6 else [])
    return "\n".join(text + [n for n in getattr(e, "__notes__", []) if n.startswith("autopipe")])


def _check(check: Check, run: Callable[[], _Step], ref: Callable[[], _Step], **compare) -> Check:
    try:  # the rows of run() against ref(), or the error they raised: that is the finding
        check.rows = _compare_steps(run(), ref(), **compare)
    except Exception as e:
        check.error = _error_text(e)
    return check


def verify(model: torch.nn.Module, example_inputs: Any, example_kwargs: dict[str, Any] | None = None, *,
           devices: int | Sequence[str | torch.device] = 2, chunks: int = 4, checkpoint: str = "except_last",
           loss_fn: Callable[[Any], torch.Tensor] | None = None, **compile_kwargs: Any) -> VerifyReport:
    """Check that ``autopipe.compile(model, ...)`` computes ``model``: one training step through the pipeline against
    the plain model. ``devices=N``: N CPU workers. ``loss_fn(output)``: the scalar to differentiate (default:
    :func:`default_loss`). ``compile_kwargs`` go to ``autopipe.compile``."""
    devices = [str(d) for d in resolve_devices(["cpu"] * devices if positive_int(devices) else devices)]
    Options.make(devices, chunks=chunks, checkpoint=checkpoint)  # a bad chunks or checkpoint, named now
    with preserved_global_state(), torch.enable_grad():  # the caller's RNG, grad mode and thread count stay
        return _verify(model, as_tuple(example_inputs), dict(example_kwargs or {}), devices, chunks, checkpoint,
                       loss_fn, compile_kwargs)


def _output_facts(model, args, kwargs, devices, chunks) -> dict[int, Any]:
    """Output leaf -> the plan's facts of it (a 0-dim loss: a mean or a sum over samples; rows a sample, the shape), so
    that the loop by hand merges and refuses as the pipeline does; {} where the model does not plan (the checks say
    why)."""
    try:
        program = run_passes(model, args, kwargs, Options.make(devices, chunks=chunks), generate=False).main
    except Exception:  # noqa: BLE001
        return {}
    infos = zip(program.traced.output_positions, map(program.plan.tensors.get, program.plan.graph_outputs))
    return {position: info for position, info in infos if info is not None and info.kind == "tensor" and info.merges}


def _verify(model, args, kwargs, devices, chunks, checkpoint, loss_fn, compile_kwargs) -> VerifyReport:
    own = next((t.dtype for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()),
               torch.get_default_dtype())
    training, caller_threads, mode_name = model.training, torch.get_num_threads(), "train" if model.training else "eval"
    batch = batch_rows(model, args, kwargs) or 0
    sizes = micro_batch_sizes(batch, chunks)
    facts = _output_facts(model, args, kwargs, devices, chunks)

    def merged(outputs: list[Any]) -> Any:  # as the pipeline merges: as its plan says
        if len(outputs) == 1:
            return outputs[0]
        flat = [pytree.tree_flatten(register_dataclasses(o)) for o in outputs]
        columns = enumerate(zip(*(leaves for leaves, _ in flat)))
        return pytree.tree_unflatten([merge(c, sizes, facts.get(i)) if isinstance(c[0], torch.Tensor) else c[0]
                                      for i, c in columns], flat[0][1])

    @functools.cache
    def run(dtype, how: str, mode: bool | None = None, threads: int | None = None, fixed: bool = False) -> _Step:
        """One step of a copy: ``how`` is "whole" (the plain model), "loop" (by micro-batch) or a checkpoint mode;
        ``fixed``: every random draw takes a fixed value (random_ops.FixedDraws)."""
        (twin, (a, k)), loss = _copy(model, (args, kwargs), dtype, mode), loss_fn or default_loss
        draws = random_ops.FixedDraws() if fixed else None
        if how in ("whole", "loop"):
            pieces = [(a, k)] if how == "whole" else split_target((a, k), sizes)
            # each micro-batch's graph keeps the buffers as it saw them, as with a backward per micro-batch
            buffers = {b.untyped_storage().data_ptr() for b in twin.buffers()}
            pack = lambda t: t.clone() if t.untyped_storage().data_ptr() in buffers else t  # noqa: E731
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                step = _step(twin, lambda: merged([twin(*x, **y) for x, y in pieces]), loss, threads or caller_threads,
                             mode=draws)
            step.unfixed = draws.unfixed if draws is not None else set()
            return step
        options = {**compile_kwargs, **({"intra_op_threads": threads} if threads else {})}
        pipe = compile_pipeline(twin, devices=devices, chunks=chunks, checkpoint=how, example_inputs=a,
                                example_kwargs=k, **options)
        with contextlib.closing(pipe):
            step = _step(twin, lambda: pipe(*a, **k), loss, caller_threads, mode=draws)
            canonical = {id(p): n for n, p in twin.named_parameters()}  # tied weights under these names
            every = dict(twin.named_parameters(remove_duplicate=False))
            step.shared = {canonical[id(every[n])]: tuple(s) for n, s in pipe.plan.shared_params.items() if n in every}
        return step

    reference_own = run(own, "loop", threads=1)  # the plain model must run: if not, the caller's error is raised
    report = VerifyReport(type(model).__name__, devices, chunks, checkpoint, mode_name, own, (
        f"loss_fn={getattr(loss_fn, '__qualname__', repr(loss_fn))}" if loss_fn is not None else
        "the model's own loss (its scalar output or .loss)" if reference_own.has_model_loss else
        "sum(output * fixed random projection) over the floating output tensors"))
    loop = f"the plain model by hand on the same {len(sizes)} micro-batches {tuple(sizes)}"

    # structure: the pipeline against the plain model, in float64 or else in the model's own dtype
    for dtype, tolerance, threads in ((torch.float64, STRUCTURE_TOLERANCE, None),
                                      (own, OWN_DTYPE_TOLERANCE.get(own, 1e-4), 1)):
        try:
            randomness = _randomness(model, args, kwargs, loss_fn or default_loss, dtype)
            eval_deterministic = randomness == RANDOM and training and _randomness(
                model, args, kwargs, loss_fn or default_loss, dtype, False) == DETERMINISTIC
            # the mode to compare in; None: none
            compare = training if randomness != RANDOM else False if eval_deterministic else None
            reference = None if compare is None else run(dtype, "loop", compare, threads=1)
            break
        except Exception as e:
            if dtype == own:
                raise
            report.notes.append(f"the model does not run in float64 ({_error_text(e).splitlines()[0]}): the structure "
                                f"part runs in {dtype_name(own)}, at one intra-op thread, with a float tolerance")
    if randomness == IRREPRODUCIBLE:
        report.notes.append(f"the forward is not reproducible in {mode_name} mode (same input and seed, other outputs):"
                            f" it reads state a pipeline cannot follow (a Python counter, its own torch.Generator)")
    if randomness == RANDOM:
        part = "is skipped (random in eval mode too)" if compare is None else "compares in eval mode (dropout off)"
        report.notes.append(f"the model draws random numbers in {mode_name} mode, the pipeline its own per stage and "
                            f"micro-batch: the structure part {part}; replay compares the pipeline with itself")
    # deferred: BatchNorm statistics of the mini-batch
    name, deferred = dtype_name(dtype), bool(compile_kwargs.get("deferred_batch_norm"))
    skipped = ["deferred_batch_norm=True: buffers not compared"] if deferred else []
    if compare is None:
        report.structure.append(Check("structure", "-", "-", None, notes=["skipped: random in eval mode too"]))
    else:
        where = f"{'train' if compare else 'eval'} mode{' (dropout off)' if randomness == RANDOM else ''}, {name}"
        structure = Check("structure", f"pipeline checkpoint={checkpoint!r}, "
                                       f"{where}{', 1 thread per worker' if threads else ''}",
                          f"{loop}, {where}, 1 thread", tolerance, notes=list(skipped))
        report.structure.append(_check(structure, lambda: run(dtype, checkpoint, compare, threads), lambda: reference,
                                       buffers=not deferred))
    if randomness == RANDOM and training:
        report.structure.append(_draws_fixed(run, dtype, checkpoint, threads, loop, tolerance, skipped, deferred))
    if randomness == DETERMINISTIC:
        report.structure.append(_micro_batching(run, reference, dtype, loop, batch, tolerance))
    report.replay.append(_replay(run, own, mode_name))
    return report


# Note [training steps with draws fixed]: a random model compared in eval mode only never compares a training
# step's own code (a reentrant checkpoint, a Function used only in training). So verify also runs the plain loop
# and the pipeline in train mode with every random kernel's draws fixed (bernoulli keeps, uniform its midpoint,
# normal its mean; out= arguments filled as the schema marks them written), in float64. A kernel it does not
# know (an LSTM's fused dropout) makes that check informational.
def _draws_fixed(run: Callable[..., _Step], dtype, checkpoint: str, threads, loop: str, tolerance: float,
                 skipped: list[str], deferred: bool) -> Check:
    """The train-mode code eval mode skips (a checkpoint, a Function used in training only), every draw fixed (Note
    [training steps with draws fixed])."""
    fixed = Check("structure, draws fixed", f"pipeline checkpoint={checkpoint!r}, train mode, every random draw "
                  f"fixed (dropout keeps all), {dtype_name(dtype)}", f"{loop}, the same", tolerance,
                  notes=list(skipped))
    checked = _check(fixed, lambda: run(dtype, checkpoint, True, threads, fixed=True),
                     lambda: run(dtype, "loop", True, 1, fixed=True), buffers=not deferred)
    if unfixed := run(dtype, "loop", True, 1, fixed=True).unfixed if fixed.error is None else ():
        fixed.tolerance = None
        fixed.notes.append(f"for information: {', '.join(sorted(unfixed))} drew at random all the same")
    return checked


def _micro_batching(run: Callable[..., _Step], reference: _Step, dtype, loop: str, batch: int,
                    tolerance: float) -> Check:
    """For information: GPipe's micro-batches against the whole batch."""
    name = dtype_name(dtype)
    info = _check(Check("micro-batching", f"{loop}, {name}", f"the plain model on the whole batch of {batch}, "
                        f"{name}", None), lambda: reference, lambda: run(dtype, "whole", threads=1))
    if any(r.worst() > tolerance for r in info.rows):
        info.notes.append("this model mixes the rows of a batch (BatchNorm in training mode, a mean loss over "
                          "tokens, ...): the structure part compares with GPipe's micro-batch loop")
    return info


def _replay(run: Callable[..., _Step], own, mode_name: str) -> Check:
    """Every micro-batch re-materialised against none, in the model's own dtype, bit for bit."""
    one = f"{dtype_name(own)}, 1 thread per worker, seed {SEED}"
    replay = Check("replay", f"pipeline checkpoint='always' (every micro-batch re-materialised), {mode_name} mode, "
                   f"{one}", f"pipeline checkpoint='never' (nothing re-materialised), {one}", 0.0)
    return _check(replay, lambda: run(own, "always", threads=1), lambda: run(own, "never", threads=1),
                  shared_tolerance=SHARED_GRAD_TOLERANCE.get(own, 1e-5))
