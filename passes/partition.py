"""The partition pass: a costed graph -> a CutProblem for passes/cut_solver.py -> a Plan. Replicated cheap nodes,
getitems kept with their producers, tied weights, in-place writes kept with the reads that must see them:
docs/architecture.md, "Contracts between passes". How each value merges over micro-batches is the micro-batch
analysis's (passes/microbatch_analysis/); the plan carries it per value."""
from __future__ import annotations

import math
import operator
from typing import Sequence

import numpy as np
import torch
import torch.fx as fx

from autopipe.ir.plan import Plan, StagePlan, TensorInfo
from autopipe.random_ops import is_random_target, op_name

from .cost import CostedGraph
from .cut_solver import CutProblem, CutSolution, NoCutKeepsWhole, NoFeasiblePlan, solve_cuts
from .diagnostics import node_where
from .inplace_writes import InPlaceWrites, ReadAfterWrite, find_inplace_writes
from .kept_ranges import KeptRanges
from .priced_cuts import solve_priced_cuts
from .shared_devices import v_holders
from .microbatch_analysis import MicroBatchAnalysis, analyse_micro_batches
from .microbatch_analysis.facts import is_inplace, rows_per_sample

__all__ = ["partition", "NoFeasiblePlan", "CutProblem", "CutSolution", "solve_cuts"]


def partition(costed: CostedGraph, n_stages: int, *, devices: Sequence[torch.device] | None = None, chunks: int = 1,
              balance: str | Sequence[float] = "flops", tolerance: float = 0.03, memory_cap: float | None = None,
              notes: Sequence[str] = (), analysis: MicroBatchAnalysis | None = None,
              cut_of: Plan | None = None, crossing_price: float = 0.0, holders: Sequence[int] | None = None) -> Plan:
    """``n_stages`` contiguous stages of ``costed``'s graph. ``analysis``: the micro-batch analysis of its graph (run
    here where not given). Raises NoFeasiblePlan naming an in-place write where no cut within ``tolerance`` keeps it
    in one stage with the reads that must see it. ``cut_of``: a plan of the same model traced at other input shapes:
    its cut is kept where this graph has the same nodes (each node in the stage it had there), else solved anew.
    ``balance``: "flops" (forward FLOPs), "train_flops" (forward and backward: CostedGraph.training_flops), "params",
    "time" (measured forward seconds), "train_time" (measured seconds of a training step: ``costed.train_seconds``)
    or per-stage shares.
    ``crossing_price``: what a byte live across a cut costs each of its two stages, in the balance's units
    (passes/step_time.py's ``crossing_price`` from a link); 0: bytes only break ties within the tolerance.
    ``holders``: the device of each stage where some hold several; a V's (zbv, DualPipeV) are balanced as each
    device's sum (Note [stages balanced as their device's sum]), others per stage; None: a device a stage."""
    gm = costed.traced.graph_module
    every = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    outputs = [a for a in next(n for n in gm.graph.nodes if n.op == "output").args[0] if isinstance(a, fx.Node)]
    weight_of = dict(zip(every, _weights(costed, every, balance)))
    writes = find_inplace_writes(gm)
    free = _replicable(gm, weight_of, set(outputs), n_stages, _written_or_read_after(writes))
    order, groups = _groups(every, free)
    if n_stages > len(order):
        raise ValueError(f"{n_stages} stages asked for, but the traced graph has only {len(order)} operations to "
                         f"spread over them; use at most {max(len(order), 1)} devices")
    index = {m: i for i, n in enumerate(order) for m in groups[n]}
    consumers, out_bytes = [], []
    for i, n in enumerate(order):
        # only tensors count: sizes and other Python values travel for free in-process
        crossing = [m for m in groups[n]
                    if _is_tensor_valued(m) and (isinstance(m.meta.get("val"), torch.Tensor) or len(groups[n]) == 1)]
        users = {index[u] for m in crossing for u in m.users if u in index}
        if any(m in outputs for m in crossing):
            users.add(len(order) - 1)  # model outputs travel to the last stage
        consumers.append(sorted(users - {i}))
        out_bytes.append(sum(costed.costs[m.name].out_bytes for m in crossing))
    shared = None
    if memory_cap is not None:  # a parameter once per stage that reads it, with its gradient and Adam's two states
        readers: dict[str, set[int]] = {}
        for m, i in index.items():
            for p in costed.costs[m.name].params:
                readers.setdefault(p, set()).add(i)
        shared = [(costed.tensor_bytes[p] * (4.0 if _is_param(gm, p) else 1.0), sorted(r)) for p, r in readers.items()]
    weights = [sum(weight_of[m] for m in groups[n]) for n in order]
    kept = _writes_kept_whole(writes, index, weights)
    pinned = _starts_as(cut_of, order, groups, n_stages) if cut_of is not None else None
    if pinned is not None:  # the cut of a plan of the same graph, which kept the writes already
        starts, optimum = pinned, float("nan")
    elif isinstance(balance, str):
        solution = _solve_keeping_writes(CutProblem(
            weights=weights, out_bytes=out_bytes, consumers=consumers, n_stages=n_stages, tolerance=tolerance,
            shared_memory=shared, memory_cap=memory_cap, activation_multiplier=float(chunks),
            kept_whole=[ranges for ranges, _ in kept], v_devices=_v_devices(holders)), kept, crossing_price)
        starts, optimum = list(solution.starts), solution.optimum
    else:
        starts, optimum = _split_by_shares(weights, list(balance), n_stages), float("nan")
        if (broken := KeptRanges([ranges for ranges, _ in kept], len(order)).broken(starts)) is not None:
            raise NoFeasiblePlan(_write_cut_off(kept[broken][1], f"{n_stages} stages by balance={list(balance)}",
                                                "other shares may"))
    ends = starts[1:] + [len(order)]
    stage_of = {m: s for s in range(n_stages) for n in order[starts[s]:ends[s]] for m in groups[n]}
    analysis = analysis if analysis is not None else analyse_micro_batches(costed.traced)
    plan = _build_plan(costed, stage_of, free, weight_of, n_stages, devices, chunks, balance, tolerance, optimum,
                       outputs, analysis)
    plan.crossing_price = crossing_price
    plan.holders = tuple(holders or ())
    plan.notes.extend(notes)
    if chunks > 1:
        plan.notes.extend(analysis.merge_notes(name for name, info in plan.tensors.items() if info.is_output))
    return plan


def _v_devices(holders: Sequence[int] | None) -> int:
    """K where ``holders`` lay 2K stages out in a V (balanced as device sums), else 0: other layouts (interleaved's
    round robin) are balanced per stage."""
    if not holders:
        return 0
    K = max(holders) + 1
    return K if tuple(holders) == v_holders(K) and K > 1 else 0


def _starts_as(cut_of: Plan, order: list[fx.Node], groups: dict[fx.Node, list[fx.Node]],
               n_stages: int) -> list[int] | None:
    """The first position in ``order`` of each stage of ``cut_of``, where each group's nodes are all in one stage there
    and the stages follow the order; None where the graphs differ."""
    stage_of = {name: sp.index for sp in cut_of.stages for name in sp.nodes}
    positions = []
    for n in order:
        stages = {stage_of.get(m.name) for m in groups[n]}
        if len(stages) != 1 or None in stages:
            return None
        positions.append(stages.pop())
    if len(cut_of.stages) != n_stages or positions != sorted(positions) or set(positions) != set(range(n_stages)):
        return None
    return [positions.index(s) for s in range(n_stages)]


def _groups(every: list[fx.Node], free: set[fx.Node]) -> tuple[list[fx.Node], dict[fx.Node, list[fx.Node]]]:
    """The units the solver places, in order: a getitem of a tuple (qkv.split(...)[0]) joins its producer's group, so
    no tuple carrying its autograd graph crosses a cut; and a value of varying size joins its readers'. Replicated
    nodes (``free``) are in no group (Note [replicated nodes own no stage])."""
    group_of: dict[fx.Node, fx.Node] = {}
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in (n for n in every if n not in free):
        source = n.args[0] if n.args else None
        part = (n.op == "call_function" and n.target is operator.getitem and isinstance(source, fx.Node)
                and source in group_of and not isinstance(source.meta.get("val"), torch.Tensor))
        group_of[n] = group_of[source] if part else n
        groups.setdefault(group_of[n], []).append(n)
    return _varying_sizes_kept_whole(list(groups), groups), groups


def _varying_sizes_kept_whole(order: list[fx.Node], groups: dict[fx.Node, list[fx.Node]]) -> list[fx.Node]:
    """The groups from a value whose size depends on values (trace's "data_dependent": x[mask]) to its last reader
    become one: no cut carries it, as no receiver could size it ahead (its size differs between micro-batches and
    steps; Note [sizes set by values]). So do those from a tuple of tensors read whole (``torch.cat(h.unbind(0))``),
    which would cross without gradients. ``groups`` is updated."""
    index = {m: i for i, n in enumerate(order) for m in groups[n]}
    kept: list[fx.Node] = []
    end = -1
    for i, n in enumerate(order):
        members = groups[n]
        if i > end:
            kept.append(n)
        else:
            groups[kept[-1]] += groups.pop(n)
        end = max([end, *(index.get(u, i) for m in members if m.meta.get("data_dependent") or _tensors_in_tuple(m)
                          for u in m.users)])
    return kept


def _written_or_read_after(writes: InPlaceWrites) -> set[fx.Node]:
    """The nodes no stage may recompute for itself: each write in place, and each node a read after a write needs in
    the writing stage (a recomputed copy would not hold the write)."""
    needed = {n for n, written in writes.writes.items() if written}
    for read in writes.reads:
        needed.update(*read.ways)
    return needed


def _writes_kept_whole(writes: InPlaceWrites, index: dict[fx.Node, int],
                       weights: list[float]) -> list[tuple[list[tuple[int, int]], ReadAfterWrite]]:
    """Per in-place write that a cut could hide from a later read: the ranges of solver units of which one stage must
    hold one whole (CutProblem.kept_whole), and the read that reaches furthest in the lightest. Each read sees the
    write in a few ways (InPlaceWrites.reads), each a range around the write; the write is seen by all its reads when
    one stage holds, for some first unit, the union of each read's range that starts there or later and ends first.
    A read with no way at all is refused."""
    prefix = np.concatenate(([0.0], np.cumsum(weights)))
    ways: dict[fx.Node, list[tuple[ReadAfterWrite, list[tuple[int, int]]]]] = {}
    for read in writes.reads:
        ranges = [(min(at), max(at)) for nodes in read.ways
                  if all(n in index for n in nodes) for at in [[index[n] for n in nodes]]]
        if not ranges:  # the model returns an input it wrote in place
            raise NoFeasiblePlan(
                f"{op_name(read.write.target)} ({node_where(read.write)}) writes in place to the model input "
                f"{read.through.name}, which the model returns: each stage gets its own copy of its inputs, so no "
                f"stage returns the write. Return the write's result (y = x.add_(1); return y) or write out of place; "
                f"see docs/faithfulness.md")
        ways.setdefault(read.write, []).append((read, ranges))
    kept = []
    for options in ways.values():
        unions = []
        for low in sorted({first for _, ranges in options for first, _ in ranges}):
            chosen = [min((r for r in ranges if r[0] >= low), key=lambda r: r[1], default=None)
                      for _, ranges in options]
            if None not in chosen:
                first, last = min(r[0] for r in chosen), max(r[1] for r in chosen)
                furthest = next(read for (read, _), r in zip(options, chosen) if r[1] == last)
                unions.append((prefix[last + 1] - prefix[first], (first, last), furthest))
        kept.append(([span for _, span, _ in unions], min(unions, key=lambda u: u[0])[2]))
    return kept


def _solve_keeping_writes(problem: CutProblem, kept: list[tuple[list[tuple[int, int]], ReadAfterWrite]],
                          crossing_price: float = 0.0) -> CutSolution:
    """solve_cuts (solve_priced_cuts with a crossing price), refusing by name a write no plan within the tolerance
    keeps with its reads."""
    try:
        return solve_priced_cuts(problem, crossing_price) if crossing_price else solve_cuts(problem)
    except NoCutKeepsWhole as e:
        need = e.least_bottleneck / e.optimum - 1 if e.optimum else math.inf
        asked = f"{problem.n_stages} stages within tolerance={problem.tolerance:g}"
        instead = f"tolerance={math.ceil(need * 100) / 100:g} does" if need < math.inf else "nor at any tolerance"
        raise NoFeasiblePlan(_write_cut_off(kept[e.entry][1], asked, instead)) from None


def _write_cut_off(read: ReadAfterWrite, asked: str, instead: str) -> str:
    w, reader = read.write, "the model's output" if read.reader.op == "output" else read.reader.name
    through = "" if read.through is read.written else f" through {read.through.name}"
    return (f"{op_name(w.target)} ({node_where(w)}) writes in place to {read.written.name}, which {reader} reads "
            f"afterwards{through}: no cut into {asked} keeps them in one stage ({instead}). Write out of place "
            f"(x = x + y, not x += y) or use fewer stages; see docs/faithfulness.md")


def _weights(costed: CostedGraph, nodes: list, balance) -> list[float]:
    if balance == "params":  # each parameter weighs at its first reader
        seen: set[str] = set()
        weights = []
        for n in nodes:
            fresh = set(costed.costs[n.name].params) - seen
            seen |= fresh
            weights.append(float(sum(costed.tensor_bytes[p] for p in fresh)))
        return weights
    if balance == "time":  # measured by compile, which refuses a meta model first
        return [costed.costs[n.name].seconds for n in nodes]
    if balance == "train_time":  # measured forward and backward seconds (the pass chain's)
        return [costed.train_seconds[n.name] for n in nodes]
    if balance == "train_flops":  # forward and backward: what the step-time model counts on FLOPs
        train = costed.training_flops()
        return [train[n.name] for n in nodes]
    return [float(costed.costs[n.name].flops) for n in nodes]


def _split_by_shares(weights: list[float], shares: list[float], n_stages: int) -> list[int]:
    """A user-given share of the work per stage: cut where the running cost crosses each share."""
    if len(shares) != n_stages or any(s <= 0 for s in shares):
        raise ValueError(f"balance as a list needs {n_stages} positive per-stage weights, got {shares}")
    targets = np.cumsum(np.array(shares) / sum(shares))[:-1] * (sum(weights) or 1.0)
    starts = [0] + [int(i) + 1 for i in np.searchsorted(np.cumsum(weights), targets)]
    for s in range(1, n_stages):  # every stage non-empty
        starts[s] = min(max(starts[s], starts[s - 1] + 1), len(weights) - n_stages + s)
    return starts


# Note [replicated nodes own no stage]: cheap nodes computed from the inputs alone (masks, position ids) are
# recomputed by each stage that reads them rather than sent, and the solver sees only owned nodes: a run of
# replicated nodes given to the solver once became an empty stage. A getitem of a tuple stays with its producer,
# so only tensors cross cuts.
def _replicable(gm: fx.GraphModule, weight_of: dict[fx.Node, float], outputs: set, n_stages: int,
                kept: frozenset[fx.Node] | set[fx.Node] = frozenset()) -> set[fx.Node]:
    """Cheap nodes of graph inputs and buffers only (masks, position ids), but none of ``kept``: each reading stage
    recomputes them (Note [replicated nodes own no stage])."""
    budget = 0.01 * sum(weight_of.values()) / n_stages
    free: set[fx.Node] = set()

    def constant(a: fx.Node) -> bool:
        return a.op == "placeholder" or a in free or (a.op == "get_attr" and not _is_param(gm, a.target))

    for n, weight in weight_of.items():
        if (weight <= budget and n not in outputs and n.op != "call_module" and not is_random_target(n.target)
                and not is_inplace(n) and n not in kept and op_name(n.target) != "_assert_scalar"  # read by no stage
                and all(map(constant, n.all_input_nodes))):
            free.add(n)
    return free


def _is_param(gm: fx.GraphModule, name: str) -> bool:
    module, _, leaf = name.rpartition(".")
    return isinstance(getattr(gm.get_submodule(module), leaf, None), torch.nn.Parameter)


def _tensors_in_tuple(n: fx.Node) -> bool:
    """A tuple or list of tensors (fx's ``h.unbind(0)`` read whole by ``torch.cat``): crossing a cut as a Python value,
    its tensors would carry no gradient back."""
    return not isinstance(n.meta.get("val"), torch.Tensor) and _is_tensor_valued(n)


def _is_tensor_valued(n: fx.Node) -> bool:
    val = n.meta.get("val")
    return any(isinstance(v, torch.Tensor) for v in (val if isinstance(val, (list, tuple)) else [val]))


def _build_plan(costed, stage_of, free, weight_of, n_stages, devices, chunks, balance, tolerance, optimum, output_args,
                analysis: MicroBatchAnalysis | None = None) -> Plan:
    """The Plan of an assignment of nodes to stages (benchmarks/partition.py scores other methods' cuts with it)."""
    gm = costed.traced.graph_module
    analysis = analysis if analysis is not None else analyse_micro_batches(costed.traced)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = [n for n in gm.graph.nodes if n in stage_of or n in free]
    devices = list(devices) if devices is not None else [torch.device("cpu")] * n_stages
    readers: dict[fx.Node, set[int]] = {}  # the stages that read each value; a replicated node's are its readers'
    for n in reversed(placeholders + nodes):
        readers[n] = set().union(*(readers[u] if u in free else {stage_of[u]}
                                   for u in n.users if u in free or u in stage_of))
    tensors: dict[str, TensorInfo] = {}
    inputs, sent, replicated = ([[] for _ in range(n_stages)] for _ in range(3))
    for n in placeholders + nodes:
        if n in free:
            for s in sorted(readers[n]):
                replicated[s].append(n.name)
            continue
        s = stage_of.get(n, -1)
        later = sorted(readers[n] - {s})
        assert not later or later[0] > s, f"node {n.name} feeds an earlier stage: the order is not topological"
        if later or n in output_args or s < 0:
            tensors[n.name] = _info(n, s, later, n in output_args, analysis)
            if s >= 0:
                sent[s].append(n.name)
            for c in later:
                inputs[c].append(n.name)
    param_stages: dict[str, set[int]] = {}
    for n in nodes:
        for p in costed.costs[n.name].params:
            param_stages.setdefault(p, set()).update(readers[n] if n in free else {stage_of[n]})
    stages = []
    for s in range(n_stages):
        own = [n for n in nodes if stage_of.get(n) == s]
        params = sorted(p for p, st in param_stages.items() if s in st)
        stages.append(StagePlan(
            index=s, device=torch.device(devices[s]), nodes=tuple(n.name for n in own), replicated=tuple(replicated[s]),
            inputs=tuple(inputs[s]), outputs=tuple(sent[s]), params=tuple(params),
            param_bytes=sum(costed.tensor_bytes[p] for p in params), flops=sum(costed.costs[n.name].flops for n in own),
            cost=sum(weight_of[n] for n in own)))
    weights = [weight_of[n] for n in stage_of]  # every owned node (a group: its node and its getitems)
    return Plan(
        stages=stages, tensors=tensors, graph_inputs=[p.name for p in placeholders],
        graph_outputs=[a.name for a in output_args], chunks=chunks,
        balance=balance if isinstance(balance, str) else f"shares {list(balance)}", route=costed.traced.route,
        lower_bound=max(sum(weights) / n_stages, max(weights, default=0.0)), optimum=optimum, tolerance=tolerance,
        shared_params={p: tuple(sorted(st)) for p, st in param_stages.items() if len(st) > 1 and _is_param(gm, p)},
        across_micro_batches=list(analysis.across_micro_batches) if chunks > 1 else [])


def _info(n: fx.Node, producer: int, consumers, is_output: bool, analysis: MicroBatchAnalysis) -> TensorInfo:
    """What crosses a cut, as the wire needs it: shapes at the whole batch, Python values by kind, and how it merges
    over micro-batches (the analysis's). An output of k rows a sample (k > 1) whose rows the analysis cannot show stay
    together, or one computed from a value that mixes samples, does not merge: refused at codegen."""
    val = n.meta.get("val")
    kind, shape, dtype, nbytes, rows = "other", (), torch.int64, 0, 0
    if isinstance(val, torch.Tensor):
        kind, shape, dtype, nbytes = "tensor", tuple(int(d) for d in val.shape), val.dtype, val.nbytes
        rows = rows_per_sample(n)
    elif isinstance(val, (int, torch.SymInt)):
        kind = "int"
    elif isinstance(val, (tuple, list, torch.Size)) and all(isinstance(v, (int, torch.SymInt)) for v in val):
        kind, shape = "size", (len(val),)
    merge, mixed = analysis.scalar_merges.get(n.name, "mean"), analysis.mixed.get(n.name, ())
    together, selected = n.name in analysis.together, n.name in analysis.selected
    batch_free = is_output and n.name in analysis.batch_free
    return TensorInfo(name=n.name, shape=shape, dtype=dtype, nbytes=nbytes, producer=producer,
                      consumers=tuple(consumers), is_output=is_output, kind=kind, rows_per_sample=rows,
                      merges=(not shape or rows == 1 or rows > 1 and together or selected or batch_free) and not mixed,
                      mixes_samples=mixed, scalar_merge=merge,
                      count=analysis.counts.get(n.name) if merge == "count" else None, selected_rows=selected,
                      batch_free=batch_free)

