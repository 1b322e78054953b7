
# ---- graph adapter: CostedGraph -> CutProblem -> Plan ----------------------

import operator as _operator
from typing import Any as _Any, Sequence as _Seq

import torch as _torch
import torch.fx as _fx

from autopipe.plan import Plan, StagePlan, TensorInfo
from .cost import CostedGraph

try:
    from .partition import CutProblem, solve_cuts
except ImportError:  # stand-in until the exact solver lands
    from dataclasses import dataclass as _dc

    @_dc
    class CutProblem:
        weights: list; out_bytes: list; consumers: list; n_stages: int; tolerance: float = 0.03
        comm_cost_per_byte: float = 0.0; replicable: list = None; node_memory: list = None
        shared_memory: list = None; activation_multiplier: float = 0.0; memory_cap: float = None

    @_dc
    class _Sol:
        starts: tuple; optimum: float

    def solve_cuts(problem):
        w = problem.weights; n = len(w); K = problem.n_stages
        pre = [0.0]
        for x in w: pre.append(pre[-1] + x)
        INF = float("inf")
        best = [[INF] * (n + 1) for _ in range(K + 1)]; arg = [[0] * (n + 1) for _ in range(K + 1)]
        best[0][0] = 0.0
        for k in range(1, K + 1):
            for e in range(k, n + 1):
                for s in range(k - 1, e):
                    v = max(best[k - 1][s], pre[e] - pre[s])
                    if v < best[k][e]:
                        best[k][e] = v; arg[k][e] = s
        starts = []; e = n
        for k in range(K, 0, -1):
            s = arg[k][e]; starts.append(s); e = s
        return _Sol(tuple(reversed(starts)), best[K][n])

_RANDOM_TARGETS = {
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "native_dropout", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like",
    "randperm", "bernoulli", "multinomial", "normal", "poisson", "rrelu",
}


def partition(
    costed: CostedGraph,
    n_stages: int,
    *,
    devices: _Seq[_torch.device] | None = None,
    chunks: int = 1,
    balance: "str | _Seq[float]" = "flops",
    tolerance: float = 0.03,
    comm_cost_per_byte: float = 0.0,
    memory_cap: float | None = None,
    optimizer_state_multiple: float = 2.0,
) -> Plan:
    """Cut the traced graph into ``n_stages`` contiguous stages (see module docstring)."""
    gm = costed.traced.graph_module
    graph = gm.graph
    every = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    if n_stages < 1:
        raise ValueError(f"devices must name at least one device (got {n_stages} stages)")
    output_node = next(n for n in graph.nodes if n.op == "output")
    output_args = [a for a in output_node.args[0] if isinstance(a, _fx.Node)]
    every_weight = _weights(costed, every, balance)
    replicable = _replicable(costed, every, set(output_args), every_weight, n_stages)
    free = {n for n, r in zip(every, replicable) if r}
    # Replicated nodes belong to no stage (each consumer recomputes them): the solver sees the rest.
    order = [n for n in every if n not in free]
    weights = [w for n, w in zip(every, every_weight) if n not in free]
    if n_stages > len(order):
        raise ValueError(
            f"{n_stages} stages asked for, but the traced graph has only {len(order)} operations to spread over them; "
            f"use at most {max(len(order), 1)} devices"
        )
    index = {n: i for i, n in enumerate(order)}
    end = len(order)
    consumers: list[list[int]] = []
    for n in order:
        if not _is_tensor_valued(n):  # sizes and other Python values travel for free in-process
            consumers.append([])
            continue
        users = [index[u] for u in n.users if u in index]
        if n in output_args:
            users.append(end)  # model outputs travel to the end of the pipeline
        consumers.append(sorted(set(users)))
    out_bytes = [costed.costs[n.name].out_bytes for n in order]

    param_users: dict[str, set[int]] = {}
    for i, n in enumerate(order):
        for p in costed.costs[n.name].params:
            param_users.setdefault(p, set()).add(i)
    multiple = 1.0
    if memory_cap is not None:
        multiple = 1.0 + 1.0 + optimizer_state_multiple  # weights + grads + optimizer state
    shared_memory = [(costed.tensor_bytes[p] * (multiple if _is_param(gm, p) else 1.0), sorted(users))
                     for p, users in param_users.items()]

    if isinstance(balance, str):
        problem = CutProblem(
            weights=weights,
            out_bytes=out_bytes,
            consumers=[[c for c in cs if c < end] + ([end - 1] if end in cs and i < end - 1 else []) for i, cs in enumerate(consumers)],
            n_stages=n_stages,
            tolerance=tolerance,
            comm_cost_per_byte=comm_cost_per_byte,
            shared_memory=shared_memory,
            activation_multiplier=float(chunks) if memory_cap is not None else 0.0,
            memory_cap=memory_cap,
        )
        solution = solve_cuts(problem)
        starts = list(solution.starts)
        optimum = solution.optimum
    else:
        starts = _split_by_shares(weights, list(balance), n_stages)
        optimum = float("nan")

    stage_of: dict[_fx.Node, int] = {}
    for s in range(n_stages):
        stop = starts[s + 1] if s + 1 < n_stages else end
        for n in order[starts[s]:stop]:
            stage_of[n] = s
    return _build_plan(costed, order, stage_of, free, dict(zip(every, every_weight)), n_stages, devices, chunks,
                       balance, tolerance, optimum, output_args)


def _is_tensor_valued(n: _fx.Node) -> bool:
    val = n.meta.get("val")
    return isinstance(val, _torch.Tensor) or (
        isinstance(val, (list, tuple)) and any(isinstance(v, _torch.Tensor) for v in val))


def _is_param(gm: _fx.GraphModule, name: str) -> bool:
    try:
        gm.get_parameter(name)
        return True
    except AttributeError:
        return False


def _weights(costed: CostedGraph, order: list, balance) -> list[float]:
    if balance == "params":
        seen: set[str] = set()
        weights = []
        for n in order:
            fresh = [p for p in costed.costs[n.name].params if p not in seen]
            seen.update(fresh)
            weights.append(float(sum(costed.tensor_bytes[p] for p in fresh)))
        return weights
    if balance == "time":
        missing = [n.name for n in order if costed.costs[n.name].seconds is None]
        if missing:
            raise ValueError("balance='time' needs measured node times; compile with real example inputs (not meta)")
        return [costed.costs[n.name].seconds for n in order]
    return [float(costed.costs[n.name].flops) for n in order]


def _split_by_shares(weights: list[float], shares: list[float], n_stages: int) -> list[int]:
    """A user-given share of the work per stage: cut where the running cost crosses each share."""
    if len(shares) != n_stages or any(s <= 0 for s in shares):
        raise ValueError(f"balance as a list needs {n_stages} positive per-stage weights, got {shares}")
    total = sum(weights) or 1.0
    targets, acc = [], 0.0
    for s in shares[:-1]:
        acc += s / sum(shares)
        targets.append(acc * total)
    starts, running, t = [0], 0.0, 0
    for i, w in enumerate(weights):
        running += w
        while t < len(targets) and running >= targets[t] and len(starts) < n_stages:
            starts.append(min(i + 1, len(weights) - (n_stages - len(starts))))
            t += 1
    while len(starts) < n_stages:
        starts.append(len(weights) - (n_stages - len(starts)))
    for s in range(1, n_stages):  # keep every stage non-empty
        starts[s] = max(starts[s], starts[s - 1] + 1)
    return starts


def _replicable(costed: CostedGraph, order: list, outputs: set, weights: list[float], n_stages: int) -> list[bool]:
    """Cheap nodes computed from graph inputs and buffers only (masks, position ids):
    every stage that needs one recomputes it instead of receiving it."""
    gm = costed.traced.graph_module
    budget = 0.01 * sum(weights) / n_stages
    free: set = set()
    result = []
    for i, n in enumerate(order):
        ok = (
            weights[i] <= budget
            and n not in outputs
            and not _is_random(n)
            and not _is_inplace(n)
            and n.op != "call_module"
            and all(
                a.op == "placeholder" or a in free or (a.op == "get_attr" and not _is_param(gm, a.target))
                for a in n.all_input_nodes
            )
        )
        if ok:
            free.add(n)
        result.append(ok)
    return result


def _target_name(n: _fx.Node) -> str:
    target = n.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    return name.split(".")[0] if "." in name and not isinstance(target, str) else name


def _is_random(n: _fx.Node) -> bool:
    return _target_name(n).split(".")[-1] in _RANDOM_TARGETS or "dropout" in str(n.target)


def _is_inplace(n: _fx.Node) -> bool:
    name = _target_name(n)
    return (n.op == "call_method" and name.endswith("_")) or n.target in (_operator.setitem,) or (
        isinstance(n.target, _torch._ops.OpOverload) and n.target._schema.is_mutable)


def _build_plan(costed, order, stage_of, free, weight_of, n_stages, devices, chunks,
                balance, tolerance, optimum, output_args) -> Plan:
    gm = costed.traced.graph_module
    every = [n for n in gm.graph.nodes if n in stage_of or n in free]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    devices = list(devices) if devices is not None else [_torch.device("cpu")] * n_stages

    # Which stages need each value: a replicated node is needed wherever its users are.
    needed_in: dict[_fx.Node, set[int]] = {}
    for n in reversed(every):
        if n in free:
            needed_in[n] = set()
            for u in n.users:
                if u in stage_of and u not in free:
                    needed_in[n].add(stage_of[u])
                elif u in needed_in and u in free:
                    needed_in[n] |= needed_in[u]
    tensors: dict[str, TensorInfo] = {}
    stage_inputs: list[list[str]] = [[] for _ in range(n_stages)]
    stage_outputs: list[list[str]] = [[] for _ in range(n_stages)]
    replicated: list[list[str]] = [[] for _ in range(n_stages)]

    def users_stages(n: _fx.Node) -> set[int]:
        stages = set()
        for u in n.users:
            if u in free:
                stages |= needed_in[u]
            elif u in stage_of:
                stages.add(stage_of[u])
        return stages

    for p in placeholders:
        consumers = sorted(users_stages(p))
        val = p.meta.get("val")
        tensors[p.name] = _info(p, -1, consumers, p in output_args)
        for s in consumers:
            stage_inputs[s].append(p.name)
    for n in every:
        if n in free:
            for s in sorted(needed_in[n]):
                replicated[s].append(n.name)
            continue
        s = stage_of[n]
        later = sorted(c for c in users_stages(n) if c != s)
        if any(c < s for c in later):
            raise AssertionError(f"node {n.name} feeds an earlier stage: the order is not topological")
        if later or n in output_args:
            tensors[n.name] = _info(n, s, later, n in output_args)
            stage_outputs[s].append(n.name)
            for c in later:
                stage_inputs[c].append(n.name)

    param_stages: dict[str, set[int]] = {}
    for n in every:
        stages = needed_in[n] if n in free else {stage_of[n]}
        for p in costed.costs[n.name].params:
            param_stages.setdefault(p, set()).update(stages)
    stages = []
    for s in range(n_stages):
        own = [n for n in order if n not in free and stage_of[n] == s]
        params = sorted(p for p, st in param_stages.items() if s in st)
        stages.append(StagePlan(
            index=s,
            device=_torch.device(devices[s]),
            nodes=tuple(n.name for n in own),
            replicated=tuple(replicated[s]),
            inputs=tuple(stage_inputs[s]),
            outputs=tuple(stage_outputs[s]),
            params=tuple(params),
            param_bytes=sum(costed.tensor_bytes[p] for p in params),
            flops=sum(costed.costs[n.name].flops for n in own),
            cost=sum(weight_of[n] for n in own),
        ))
    weights = [weight_of[n] for n in order]
    total = sum(weights)
    lower_bound = max(total / n_stages, max(weights, default=0.0))
    shared = {p: tuple(sorted(st)) for p, st in param_stages.items() if len(st) > 1 and _is_param(gm, p)}
    return Plan(
        stages=stages,
        tensors=tensors,
        graph_inputs=[p.name for p in placeholders],
        graph_outputs=[a.name for a in output_args],
        chunks=chunks,
        balance=balance if isinstance(balance, str) else f"shares {list(balance)}",
        route=costed.traced.route,
        lower_bound=lower_bound,
        optimum=optimum,
        tolerance=tolerance,
        shared_params=shared,
    )


def _info(n: _fx.Node, producer: int, consumers, is_output: bool) -> TensorInfo:
    val = n.meta.get("val")
    if isinstance(val, _torch.Tensor):
        shape, dtype, nbytes = tuple(int(d) for d in val.shape), val.dtype, val.numel() * val.element_size()
    else:
        shape, dtype, nbytes = (), _torch.float32, 0
    return TensorInfo(name=n.name, shape=shape, dtype=dtype, nbytes=nbytes, producer=producer,
                      consumers=tuple(consumers), is_output=is_output)
