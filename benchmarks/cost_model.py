"""The step-time model against the Timeline: each stage's predicted seconds (passes/step_time.py) beside what its tasks
measured, per term, on the zoo and small transformers models at K=2 and 4, CPU worker threads in one process.

    python benchmarks/cost_model.py            # every model, K=2 and 4 (a few minutes on 2 cores)
    python benchmarks/cost_model.py --quick    # one small model at K=2: a smoke test, not a measurement
    python benchmarks/cost_model.py --models gpt2 --ks 2
    python benchmarks/cost_model.py --transport gloo   # K gloo processes, as torchrun runs them (cost_model_gloo.txt)

Per (model, K, schedule, checkpoint): at K=2 1F1B with checkpoint="except_last" (a recompute for all but the last
micro-batch), zb-h1 (B and W apart) and zbv (two stages a device, summed per device); at K=4 1F1B. autopipe.compile on
K CPU workers (cores // K intra-op threads each, at least one); the node times measured once at one micro-batch on one
worker's threads while K - 1 peer threads run the graph, as the other workers will (``--alone``: with none, and the
tasks stretched by busy workers over cores instead; passes/node_times.py); the prediction
(predict_step_time, with the loss function timed on one micro-batch's outputs and the link of the in-process
transport measured by a ping-pong); then ``--steps`` steps after two warm-up steps, and ``plan.validate`` over
their timelines: the median step per (stage, kind). The table prints predicted / measured per stage and timed term
and the error of the stage's sum; "worst" names the term furthest off where a stage misses by more than 10%. The
loss and the link are predicted and printed, not compared: the Timeline times the stages' tasks only. A gloo
ping-pong is printed too, the link a torchrun pipeline on this machine would pay. Writes
benchmarks/results/cost_model.txt (cost_model-quick.txt with --quick) under a header naming the machine.

``--transport gloo`` runs each row as K gloo processes on 127.0.0.1 with torchrun's environment, one stage (two
under zbv) a rank: workers then share the cores but no GIL. The node times are measured on min(K, cores) ranks at
once, every such rank's rounds pooled (Note [node times measured on ranks at once]), each round followed by an
untimed step (Note [a step to settle the heap after the node times]); each rank's Timeline is gathered to rank 0 for
``plan.validate``; a rank adds each micro-batch's parameter gradients inside its backward tasks, so the prediction
counts those sums in the tasks (``sums_in_tasks``). Writes cost_model_gloo.txt.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import autopipe  # noqa: E402
from autopipe.passes.cost import cost  # noqa: E402
from autopipe.passes.node_times import NodeTimes, loss_gradients, measure_loss, measure_node_times  # noqa: E402
from autopipe.passes.step_time import measure_link, predict_step_time  # noqa: E402
from autopipe.passes.trace import trace  # noqa: E402
from benchmarks import _common  # noqa: E402
from zoo.models import GPT, cnn_like, transformer_like  # noqa: E402

CHUNKS = 8


@dataclass
class Case:
    name: str
    build: Callable[[], tuple[nn.Module, tuple, dict, Callable | None, Any]]  # model, args, kwargs, loss_fn, target


def _zoo_transformer():
    g = torch.Generator().manual_seed(1)
    return transformer_like(d=256, hidden=1024, blocks=8), (torch.randn(256, 256, generator=g),), {}, \
        nn.MSELoss(), torch.randn(256, 256, generator=g)


def _zoo_gpt():
    torch.manual_seed(0)
    ids = torch.randint(0, 2048, (16, 64), generator=torch.Generator().manual_seed(1))
    lm = lambda logits, target: nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    return GPT(vocab=2048, d=128, heads=4, layers=6, block=64, dropout=None), (ids,), {}, lm, ids


def _gpt_32k():
    """benchmarks/cut.py's model: a 32k-token vocabulary on a 256-wide, 8-block GPT, its head untied."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids, target = (torch.randint(0, 32000, (8, 128), generator=g) for _ in range(2))
    lm = lambda logits, target: nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    return GPT(vocab=32000, d=256, heads=4, layers=8, block=128, dropout=None, tied=False), (ids,), {}, lm, target


def _zoo_cnn():
    g = torch.Generator().manual_seed(1)
    return cnn_like(width=16), (torch.randn(32, 3, 32, 32, generator=g),), {}, nn.CrossEntropyLoss(), \
        torch.randint(0, 10, (32,), generator=g)


def _hf(config_of: Callable[[Any], Any], model_of: str):
    def build():
        import transformers
        torch.manual_seed(0)
        model = getattr(transformers, model_of)(config_of(transformers))
        ids = torch.randint(0, 1024, (16, 64), generator=torch.Generator().manual_seed(1))
        return model, (), {"input_ids": ids, "labels": ids.clone()}, None, None  # the model's own loss
    return build


CASES = {
    "transformer_like": Case("transformer_like", _zoo_transformer),
    "gpt": Case("gpt", _zoo_gpt),
    "gpt_32k": Case("gpt_32k", _gpt_32k),
    "cnn": Case("cnn", _zoo_cnn),
    "gpt2": Case("gpt2", _hf(lambda t: t.GPT2Config(n_layer=6, n_embd=128, n_head=4, vocab_size=1024, n_positions=64,
                                                    bos_token_id=0, eos_token_id=0), "GPT2LMHeadModel")),
    "llama": Case("llama", _hf(lambda t: t.LlamaConfig(num_hidden_layers=6, hidden_size=128, num_attention_heads=4,
                                                       num_key_value_heads=2, intermediate_size=352, vocab_size=1024,
                                                       max_position_embeddings=64), "LlamaForCausalLM")),
}


# (schedule, checkpoint) rows per K: 1F1B re-materialising all but the last micro-batch (compile's default), zb-h1
# with B and W apart, zbv with two stages a device
ROWS = {2: [("1f1b", "except_last"), ("zb-h1", "never"), ("zbv", "never")], 4: [("1f1b", "except_last")]}


def measure(case: Case, k: int, schedule: str, checkpoint: str, steps: int, repeats: int, link,
            alone: bool = False) -> tuple[str, list]:
    """One (model, K, schedule): the validation table and its summary row."""
    model, args, kwargs, loss_fn, target = case.build()
    pipe = autopipe.compile(model, k, CHUNKS, example_inputs=args, example_kwargs=kwargs, schedule=schedule,
                            checkpoint=checkpoint)
    step = lambda: pipe.step(*args, target=target, loss_fn=loss_fn, **kwargs)
    step()  # compiles
    traced = trace(model, args, kwargs)
    threads = pipe.intra_op_threads
    micro, start, time_loss = one_micro_batch(traced, model, args, kwargs, loss_fn, target, threads)
    loss = time_loss(repeats)
    times = measure_node_times(traced.graph_module, micro, repeats=repeats, threads=threads, peers=0 if alone else k - 1,
                               output_grads=start, split_backward=True)
    prediction = predict_step_time(cost(traced), pipe.plan, times, schedule, checkpoint, CHUNKS, link=link,
                                   loss_seconds=loss, cores=_common.cores() if alone else None)
    step()
    timelines = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        step()
        timelines.append(pipe.timeline)
    report = pipe.plan.validate(timelines)
    makespan = sorted(t.makespan for t in timelines)[len(timelines) // 2]
    return _rows(case.name, k, schedule, checkpoint, threads, pipe.plan.n_stages, prediction, report, makespan,
                 f"{k} CPU worker threads")


def one_micro_batch(traced, model, args, kwargs, loss_fn, target, threads: int) -> tuple:
    """The traced graph's flat inputs cut to one micro-batch, the gradient its timed backwards start from (the loss's,
    where a loss function is given), and ``time_loss(repeats)``: the loss function's seconds on one micro-batch's
    outputs (0 without one)."""
    batch, rows = traced.batch_size, traced.batch_size // CHUNKS
    micro = [t[:rows] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t
             for t in traced.flat_inputs(args, kwargs)]
    if loss_fn is None:
        return micro, None, lambda repeats: 0.0
    start = loss_gradients(loss_fn, target[:rows], traced.rebuild_output)
    with torch.no_grad():
        out = model(*(a[:rows] for a in args))
    return micro, start, lambda repeats: measure_loss(loss_fn, out, target[:rows], repeats=repeats, threads=threads)


def _rows(name, k, schedule, checkpoint, threads, n_stages, prediction, report, makespan, workers) -> tuple:
    """The validation block and its summary row."""
    worst = max(report.checks, key=lambda c: abs(c.error))
    summary = [name, k, f"{schedule} ({checkpoint})", n_stages, f"{100 * worst.error:+.1f}% (stage {worst.stage})",
               worst.worst if worst.missed else "-", f"{1e3 * prediction.step:.1f}", f"{1e3 * makespan:.1f}",
               f"{sum(not c.missed for c in report.checks)}/{len(report.checks)}"]
    title = (f"== {name}, K={k}, {schedule}, checkpoint={checkpoint!r}, M={CHUNKS}, {workers}, {threads} thread(s) "
             f"a worker")
    return "\n".join([title, str(prediction), str(report)]), summary


# -- one gloo process per device, as torchrun runs them ------------------------------------------------------------

def rank_main(rank: int, k: int, port: int, name: str, schedule: str, checkpoint: str, steps: int, repeats: int,
              link, queue) -> None:
    """One rank of a K-process pipeline: the pipeline's timed steps, each after a round of node times (measured on
    the first min(K, cores) ranks at once, each the others' peer), and on rank 0 the prediction from its rounds and
    its check against every rank's Timeline."""
    try:
        cores = _common.cores()
        threads = max(1, cores // k)
        torch.set_num_threads(threads)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(k), LOCAL_WORLD_SIZE=str(k),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=k, timeout=timedelta(seconds=600))
        case = CASES[name]
        model, args, kwargs, loss_fn, target = case.build()
        traced = trace(copy.deepcopy(model), args, kwargs)  # timed between steps: compile leaves a rank its stages
        micro, start, time_loss = one_micro_batch(traced, model, args, kwargs, loss_fn, target, threads)
        pipe = autopipe.compile(model, chunks=CHUNKS, example_inputs=args, example_kwargs=kwargs, schedule=schedule,
                                checkpoint=checkpoint, timeout=600)
        step = lambda: pipe.step(*args, target=target, loss_fn=loss_fn, **kwargs)
        step()
        step()
        events, makespans, measured, losses = [], [], [], []
        for _ in range(steps):  # Note [node times measured on ranks at once]
            dist.barrier()
            if rank < min(k, cores):
                measured.append(measure_node_times(traced.graph_module, micro, repeats=max(1, repeats // steps),
                                                   threads=threads,
                                                   peers=0, output_grads=start, split_backward=True))
                losses.append(time_loss(1))
            dist.barrier()
            step()  # Note [a step to settle the heap after the node times]
            model.zero_grad(set_to_none=True)
            step()
            events.append(list(pipe.timeline.events))
            makespans.append(pipe.timeline.makespan)
        gathered = [None] * k if rank == 0 else None
        dist.gather_object((events, makespans, measured, losses), gathered, dst=0)
        if rank == 0:
            timelines = [SimpleNamespace(events=[e for got in gathered for e in got[0][i]], schedule=None)
                         for i in range(steps)]
            rounds = [times for got in gathered for times in got[2]]  # every measuring rank's rounds
            loss = statistics.median(seconds for got in gathered for seconds in got[3])
            prediction = predict_step_time(cost(traced), pipe.plan, median_times(rounds), schedule, checkpoint,
                                           CHUNKS, link=link,
                                           loss_seconds=loss, cores=cores, sums_in_tasks=True)
            report = pipe.plan.validate(timelines)
            makespan = sorted(max(got[1][i] for got in gathered) for i in range(steps))[steps // 2]
            queue.put((rank, _rows(name, k, schedule, checkpoint, threads, pipe.plan.n_stages, prediction, report,
                                   makespan, f"{k} gloo processes")))
        else:
            queue.put((rank, None))
        pipe.close()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, traceback.format_exc()))
        raise


# Note [node times measured on ranks at once]: under K processes each rank has its own interpreter, so workers share
# the cores and the memory system but no GIL. The node times are measured on min(K, cores) ranks at the same time,
# each being the others' peer (the rest wait in a barrier, asleep), between the timed steps, so that a drift of the
# machine's speed reaches the prediction and the measurement alike (the loss function is timed in each round too);
# the medians over every measuring rank's rounds predict. One round on this 2-core VM moved a stage's prediction by
# 10-20% (two ranks' rounds measured at the same moment differed by as much), so the more rounds the better. Past one rank a core, ``cores`` stretches the tasks by
# the busy ranks over the cores (Note [workers sharing cores]).

# Note [a step to settle the heap after the node times]: timing the nodes allocates and frees the whole graph's
# activations and gradients in patterns a step does not, and glibc returns what the timing freed to the OS; the step
# after it then writes fresh pages. On transformer_like at K=2 (1F1B) the backward tasks took 54-62 ms a step right
# after the node times and 39-40 ms in steps that followed steps; one untimed step between them puts the heap back in
# the state a training loop's steps run in.


def median_times(rounds: list) -> NodeTimes:
    """One NodeTimes from several measured rounds: each figure the median over the rounds."""
    first = rounds[0]
    tables = [f.name for f in dataclasses.fields(NodeTimes) if isinstance(getattr(first, f.name), dict)]
    merged = {name: {key: statistics.median(getattr(r, name)[key] for r in rounds if key in getattr(r, name))
                     for key in dict.fromkeys(k for r in rounds for k in getattr(r, name))}
              for name in tables}
    return dataclasses.replace(first, **merged, repeats=sum(r.repeats for r in rounds),
                               forward_scale=statistics.median(r.forward_scale for r in rounds))
def measure_ranks(name: str, k: int, schedule: str, checkpoint: str, steps: int, repeats: int, link) -> tuple:
    """One (model, K, schedule) over K gloo processes: the validation table and its summary row, from rank 0."""
    return _common.run_ranks(rank_main, k, name, schedule, checkpoint, steps, repeats, link)[0]


def main(argv=None) -> int:
    p = _common.parser(__doc__)
    p.add_argument("--models", nargs="+", choices=list(CASES), default=None)
    p.add_argument("--ks", nargs="+", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (default 9 over gloo, 5 "
                   "with threads; --quick 2)")
    p.add_argument("--alone", action="store_true", help="node times measured with no peer workers running; tasks "
                   "stretched by busy workers over cores instead (Note [workers sharing cores])")
    p.add_argument("--schedules", nargs="+", default=None, help="only these rows' schedules (default: every row)")
    p.add_argument("--transport", choices=("threads", "gloo"), default="threads",
                   help="threads: K CPU worker threads in one process; gloo: K processes, as torchrun runs them")
    a = p.parse_args(argv)
    models = a.models or (["transformer_like"] if a.quick else list(CASES))
    ks = a.ks or ([2] if a.quick else [2, 4])
    steps = a.steps or (2 if a.quick else 5 if a.transport == "threads" else 9)
    repeats = a.repeats or (2 if a.quick else 5)
    link = measure_link("threads")
    gloo = measure_link("gloo")
    blocks, rows = [], []
    for name in models:
        for k in ks:
            for schedule, checkpoint in ROWS.get(k, ROWS[4]):
                if a.schedules and schedule not in a.schedules:
                    continue
                _common.progress(f"{name} K={k} {schedule} checkpoint={checkpoint}")
                text, summary = measure(CASES[name], k, schedule, checkpoint, steps, repeats, link, a.alone) \
                    if a.transport == "threads" else measure_ranks(name, k, schedule, checkpoint, steps, repeats, gloo)
                blocks.append(text)
                rows.append(summary)
    summary = _common.table(rows, ["model", "K", "schedule", "stages", "worst stage error", "worst term",
                                   "predicted step (ms)", "measured makespan (ms)", "stages within 10%"])
    within: dict[int, list[int]] = {}  # K -> [stages within 10%, stages]
    for r in rows:
        ok, n = map(int, r[-1].split("/"))
        counts = within.setdefault(r[1], [0, 0])
        counts[0], counts[1] = counts[0] + ok, counts[1] + n
    summary += "\nstages within 10%: " + ", ".join(f"K={k}: {ok} of {n}" for k, (ok, n) in within.items())
    if a.transport == "threads":
        how = [f"in-process {link}", f"torchrun's link here: {gloo}",
               f"M={CHUNKS}, {steps} timed steps after 2 warm-up; node times measured "
               f"{'alone, stretched by busy workers over cores' if a.alone else 'with K - 1 peer threads running the graph'}"]
    else:
        how = [f"K gloo processes on 127.0.0.1 (torchrun's environment), {gloo}",
               f"M={CHUNKS}, {steps} timed steps after 2 warm-up; node times measured on min(K, cores) ranks at once "
               f"before each (one untimed step between), every rank's rounds pooled, tasks stretched by busy ranks "
               f"over cores past one rank a core; measured: every rank's Timeline"]
    name = "cost_model" if a.transport == "threads" else "cost_model_gloo"
    head = _common.header(name, [*how, "a stage misses where predicted and measured differ by more than 10%"],
                          quick=a.quick)
    _common.write(name, "\n\n".join([head, summary, *blocks]), quick=a.quick, results_dir=a.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
