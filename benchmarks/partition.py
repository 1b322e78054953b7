"""How well autopipe's partitioner balances pipeline stages, against the layer-granular splits
other pipeline libraries use.

    python benchmarks/partition.py          # or: python -m benchmarks.partition; make bench
    python benchmarks/partition.py --results-dir /tmp   # a trial run that leaves benchmarks/results alone

Prints one table (also written to benchmarks/results/partition.txt, under a header naming
the machine) and progress on stderr. Models (zoo/models.py), all built on the meta device (no
memory, no compute; nothing here runs a model):

- gpt-24: GPT-2-medium-like, 24 blocks, d=1024, 16 heads, vocab 50304, sequence 1024,
  batch 8, token + position embedding, LM head tied to the token embedding; K = 2, 4, 8;
- resnet-50: bottleneck ResNet-50 ([3, 4, 6, 3]), batch 32 at 224x224; K = 4, 8;
- unet: 4-level U-Net (64..1024 channels) with its long skips, batch 8 at 256x256; K = 4, 8;
- vit-b/16: 12 blocks, d=768, 12 heads, batch 32 at 224x224; K = 4, 8.

Each model is traced and costed once (passes/trace.py, passes/cost.py: FLOPs per node). The
layer-granular methods see the model as its top-level sequence of "layers": the graph's
nodes grouped by the first module of their ``nn_module_stack`` below the root, looking
through containers (nn.Sequential, nn.ModuleList: "blocks.3", "layer2.1"), a node outside
any module joining the layer before it; a layer's weight is the sum of its nodes' costs.
Methods (benchmarks/_baselines.py cites the sources):

  layer counts   the same number of layers per stage (DeepSpeed/Megatron "uniform")
  megatron       Megatron-LM's rule: the repeated blocks (the most common layer class) split
                 evenly, embedding on the first stage, final norm and head on the last
  torchgpipe     torchgpipe.balance's Bárány-Grinberg block partition on the layer costs
  deepspeed      DeepSpeed partition_method="parameters": parameter counts balanced
  layer DP       the least bottleneck over contiguous groups of layers (exact)
  autopipe       autopipe.plan(model, example_inputs, devices=K, chunks=32): node granularity

Every split is scored by the same node-level model, the one autopipe's Plan uses: each
layer split is mapped back to the nodes (a layer's nodes go to its stage) and turned into a
Plan by the partition pass's own plan builder, so stage costs, the lower bound and the
tensors crossing every cut are counted alike for every method.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn
from tabulate import tabulate

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autopipe  # noqa: E402
from autopipe.ir.step_time import Link  # noqa: E402
from autopipe.passes.cost import CostedGraph, cost  # noqa: E402
from autopipe.passes.node_times import times_from_flops  # noqa: E402
from autopipe.passes.step_time import crossing_price, predict_step_time  # noqa: E402
from autopipe.passes.trace import trace  # noqa: E402
from autopipe.ir.plan import Plan, human_bytes  # noqa: E402
from benchmarks import _baselines  # noqa: E402
from zoo import GPT, ViT, ResNet50, RonnebergerUNet  # noqa: E402

from autopipe.passes import partition as adapter  # noqa: E402  (the pass's graph adapter: node_view mirrors it)

CHUNKS = 32
RESULTS = Path(__file__).resolve().parent / "results" / "partition.txt"
METHODS = ("layer counts", "megatron", "torchgpipe", "deepspeed", "layer DP", "autopipe")
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- models (zoo/models.py) --------------------------------------------------------------------


@dataclass
class Case:
    name: str
    build: Callable[[], tuple[nn.Module, tuple]]  # -> (model on meta, example inputs on meta)
    ks: tuple[int, ...]


def _on_meta(make_model: Callable[[], nn.Module], *inputs: Callable[[], torch.Tensor]):
    def build():
        with torch.device("meta"):
            return make_model(), tuple(make() for make in inputs)
    return build


def gpt_case(n_blocks=24, ks=(2, 4, 8), d=1024, heads=16, vocab=50304, seq=1024, batch=8) -> Case:
    return Case(f"gpt-{n_blocks}", _on_meta(lambda: GPT(vocab, d, heads, n_blocks, seq, dropout=None),
                                           lambda: torch.zeros(batch, seq, dtype=torch.long)), ks)


CASES = [
    gpt_case(),
    Case("resnet-50", _on_meta(ResNet50, lambda: torch.zeros(32, 3, 224, 224)), (4, 8)),
    Case("unet", _on_meta(RonnebergerUNet, lambda: torch.zeros(8, 3, 256, 256)), (4, 8)),
    Case("vit-b/16", _on_meta(ViT, lambda: torch.zeros(32, 3, 224, 224)), (4, 8)),
]


# ---- the node view every method is scored on --------------------------------------------------


@dataclass
class NodeView:
    """What the partition pass sees for K stages: the nodes it orders (``order``), the cheap
    input-only nodes every stage recomputes (``free``), and each node's weight."""

    costed: CostedGraph
    n_stages: int
    order: list
    free: set
    weight_of: dict
    output_args: list


def node_view(costed: CostedGraph, n_stages: int) -> NodeView:
    """The first half of the partition pass (passes/partition.py ``partition``), kept in
    step with it: the same node set, weights and replicated nodes."""
    graph = costed.traced.graph_module.graph
    every = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    output_node = next(n for n in graph.nodes if n.op == "output")
    output_args = [a for a in output_node.args[0] if isinstance(a, torch.fx.Node)]
    weight_of = dict(zip(every, adapter._weights(costed, every, "flops")))
    free = adapter._replicable(costed.traced.graph_module, weight_of, set(output_args), n_stages)
    order = [n for n in every if n not in free]
    return NodeView(costed, n_stages, order, free, weight_of, output_args)


def score(view: NodeView, stage_of: dict, chunks: int = CHUNKS) -> Plan:
    """The Plan the partition pass would build for this assignment of nodes to stages."""
    return adapter._build_plan(view.costed, stage_of, view.free, view.weight_of, view.n_stages,
                               None, chunks, "flops", 0.0, float("nan"), view.output_args)


# ---- layers ------------------------------------------------------------------------------------


@dataclass
class Layers:
    names: list[str]
    kinds: list[str]              # class name of each layer's module ("" for none)
    nodes: list[list]             # the ordered nodes of each layer
    weights: list[float]          # summed node weights (FLOPs)
    params: list[int]             # trainable parameters each layer's nodes read (DeepSpeed's count)

    @property
    def is_block(self) -> list[bool]:
        """Megatron's transformer layers, generalised: layers of the most common module class."""
        common = Counter(k for k in self.kinds if k).most_common(1)
        return [bool(common) and k == common[0][0] for k in self.kinds]


def _layer_key(node) -> tuple[str, str] | None:
    stack = list(node.meta.get("nn_module_stack", {}).values())
    for i, (path, kind) in enumerate(stack):
        module_type = kind if isinstance(kind, type) else None
        if module_type is not None and issubclass(module_type, _CONTAINERS) and i + 1 < len(stack):
            continue
        return str(path), getattr(module_type, "__name__", str(kind))
    return None


def layers_of(view: NodeView) -> Layers:
    """Group the ordered nodes into top-level layers: maximal runs of nodes from the same
    top-level module; a node from no module joins the layer before it (the first layer if
    it comes first). A module called twice, apart, makes two layers."""
    gm = view.costed.traced.graph_module
    keys = [_layer_key(n) for n in view.order]
    first = next((k for k in keys if k is not None), ("<root>", ""))
    names, kinds, nodes, current = [], [], [], None
    for node, key in zip(view.order, keys):
        key = key or current or first
        if key != current:
            names.append(key[0])
            kinds.append(key[1])
            nodes.append([])
            current = key
        nodes[-1].append(node)
    weights = [sum(view.weight_of[n] for n in group) for group in nodes]
    params = []
    for group in nodes:
        names_read = dict.fromkeys(p for n in group for p in view.costed.costs[n.name].params)
        count = 0
        for p in names_read:
            try:
                parameter = gm.get_parameter(p)
            except AttributeError:
                continue  # a buffer
            count += parameter.numel() if parameter.requires_grad else 0
        params.append(count)
    return Layers(names, kinds, nodes, weights, params)


def stage_of_layers(layers: Layers, starts: Sequence[int]) -> dict:
    stage_of, bounds = {}, list(starts) + [len(layers.nodes)]
    for s in range(len(starts)):
        for group in layers.nodes[bounds[s]:bounds[s + 1]]:
            for n in group:
                stage_of[n] = s
    return stage_of


LAYER_METHODS: dict[str, Callable[[Layers, int], list[int]]] = {
    "layer counts": lambda layers, k: _baselines.uniform(layers.weights, k),
    "megatron": lambda layers, k: _baselines.megatron(layers.is_block, k),
    "torchgpipe": lambda layers, k: _baselines.block_partition(layers.weights, k),
    "deepspeed": lambda layers, k: _baselines.parameters(layers.params, k),
    "layer DP": lambda layers, k: _baselines.exact(layers.weights, k),
}


# ---- measuring --------------------------------------------------------------------------------


@dataclass
class Row:
    model: str
    k: int
    method: str
    plan: Plan | None = None
    split_s: float = float("nan")         # the split method alone
    plan_call_s: float | None = None       # the whole autopipe.plan call (ours only)
    error: str | None = None
    layers_per_stage: list[int] = field(default_factory=list)

    @property
    def imbalance(self) -> float:
        return self.plan.imbalance if self.plan else float("nan")

    @property
    def over_bound(self) -> float:
        return self.plan.bottleneck / self.plan.lower_bound if self.plan else float("nan")

    @property
    def cut_tensors(self) -> list[int]:
        return [len(self.plan.cut_tensors(c)) for c in range(self.k - 1)] if self.plan else []

    @property
    def cut_bytes(self) -> int:
        return sum(t.nbytes for c in range(self.k - 1) for t in self.plan.cut_tensors(c)) if self.plan else 0

    @property
    def step(self) -> float:
        """GPipe step time over the single-device time: bottleneck * (M + K - 1) / M / total."""
        if not self.plan:
            return float("nan")
        m = self.plan.chunks
        return self.plan.bottleneck * (m + self.k - 1) / m / self.plan.total_cost


def measure_model(name: str, model: nn.Module, inputs: tuple, ks: Sequence[int], chunks: int = CHUNKS,
                  methods: Sequence[str] = METHODS) -> list[Row]:
    """Every method at every K on one model (on any device; meta is enough)."""
    log(f"[{name}] trace + cost")
    start = time.perf_counter()
    costed = cost(trace(model, inputs))
    log(f"[{name}]   {len(costed.costs)} nodes, {costed.total_flops / 1e12:.2f} TFLOP forward, "
        f"{time.perf_counter() - start:.1f} s")
    rows = []
    for k in ks:
        view = node_view(costed, k)
        layers = layers_of(view)
        log(f"[{name} K={k}] {len(layers.names)} layers: {_layer_summary(layers)}")
        for method in methods:
            log(f"[{name} K={k}] {method}")
            if method == "autopipe":
                rows.append(_ours(name, model, inputs, k, chunks, costed))
                continue
            row = Row(name, k, method)
            try:
                start = time.perf_counter()
                starts = LAYER_METHODS[method](layers, k)
                row.split_s = time.perf_counter() - start
                row.layers_per_stage = [b - a for a, b in zip(starts, list(starts[1:]) + [len(layers.names)])]
                row.plan = score(view, stage_of_layers(layers, starts), chunks)
            except Exception as e:  # a method that cannot split this model is a result too
                row.error = f"{type(e).__name__}: {e}"
                log(f"[{name} K={k}]   {method} failed: {row.error}")
            rows.append(row)
    return rows


def _ours(name, model, inputs, k, chunks, costed) -> Row:
    """autopipe.plan as a user calls it (timed whole), and the partition pass alone (timed on
    the benchmark's costed graph; the same cut, checked)."""
    start = time.perf_counter()
    plan = autopipe.plan(model, inputs, devices=k, chunks=chunks)
    whole = time.perf_counter() - start
    start = time.perf_counter()
    again = adapter.partition(costed, k, chunks=chunks)
    pass_s = time.perf_counter() - start
    if [s.nodes for s in again.stages] != [s.nodes for s in plan.stages]:
        log(f"[{name} K={k}]   note: the partition pass on the benchmark's own trace cut differently "
            f"from autopipe.plan; the table shows autopipe.plan's plan")
    return Row(name, k, "autopipe", plan=plan, split_s=pass_s, plan_call_s=whole)


def _layer_summary(layers: Layers) -> str:
    names = layers.names
    return ", ".join(names) if len(names) <= 8 else ", ".join(names[:4]) + ", ..., " + ", ".join(names[-3:])


def synthetic(n: int = 100_000, k: int = 8, seed: int = 0, repeats: int = 3) -> dict[str, Any]:
    """solve_cuts on a chain of n nodes with random skips: every node feeds the next, about one
    in ten also a node up to 200 ahead; random weights and sizes. Median of ``repeats`` runs."""
    import numpy as np

    from autopipe.passes.partition import CutProblem, solve_cuts

    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.5, 1.5, n)
    out_bytes = rng.integers(1 << 10, 1 << 20, n)
    skip = rng.random(n) < 0.1
    reach = rng.integers(2, 201, n)
    consumers = [[i + 1, i + int(reach[i])] if skip[i] and i + int(reach[i]) < n else [i + 1] if i + 1 < n else []
                 for i in range(n)]
    problem = CutProblem(weights=weights.tolist(), out_bytes=out_bytes.tolist(), consumers=consumers, n_stages=k)
    times, solution = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        solution = solve_cuts(problem)
        times.append(time.perf_counter() - start)
    total = float(weights.sum())
    bound = max(total / k, float(weights.max()))
    return {"n": n, "edges": sum(map(len, consumers)), "k": k, "seconds": sorted(times)[len(times) // 2],
            "over_bound": solution.bottleneck / bound, "optimum_over_bound": solution.optimum / bound,
            "cut_tensors": sum(solution.cut_tensors)}


def plan_timing(case: Case, k: int = 8, chunks: int = CHUNKS) -> dict[str, Any]:
    """autopipe.plan's wall time on a model, and its passes' (trace, cost, partition) one by one."""
    model, inputs = case.build()
    start = time.perf_counter()
    plan = autopipe.plan(model, inputs, devices=k, chunks=chunks)
    whole = time.perf_counter() - start
    start = time.perf_counter()
    traced = trace(model, inputs)
    trace_s = time.perf_counter() - start
    costed = cost(traced)
    cost_s = time.perf_counter() - start - trace_s
    start = time.perf_counter()
    adapter.partition(costed, k, chunks=chunks)
    return {"nodes": len(costed.costs), "plan_s": whole, "trace_s": trace_s, "cost_s": cost_s,
            "partition_s": time.perf_counter() - start, "imbalance": plan.imbalance}


# ---- Llama-3-70B on meta: the cut at real scale ---------------------------------------------------

# Stated, not measured (no such device here): an H100's dense bf16 peak (989 TFLOP/s) at 40% of it, and two links.
DEVICE_FLOPS = 400e12
LINKS = {"IB 400G": Link(50e9, 5e-6, "stated: 400 Gb/s InfiniBand, a port a GPU"),
         "100GbE": Link(12.5e9, 10e-6, "stated: 100 Gb/s Ethernet")}


def greedy_least_bottleneck(weights: Sequence[float], k: int) -> float:
    """The least bottleneck of k contiguous stages of ``weights``, by bisection over a greedy fill: independent of
    passes/cut_solver.py, on the nodes before partition groups them (a finer order, so never above the solver's)."""
    import numpy as np
    prefix = np.concatenate(([0.0], np.cumsum(weights)))

    def fits(bound: float) -> bool:
        a = 0
        for _ in range(k):
            a = int(np.searchsorted(prefix, prefix[a] + bound, side="right")) - 1
            if a >= len(weights):
                return True
        return False

    low, high = max(weights), float(prefix[-1])
    while high - low > 1e-9 * high:
        middle = (low + high) / 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def llama_70b(ks: Sequence[int] = (8, 16), chunks: int = 16, seq: int = 4096, batch: int = 16) -> str:
    """Llama-3-70B's shape (transformers' LlamaForCausalLM, built on meta, float32) planned at K stages: unpriced at
    the default tolerance and at 0, and with the crossing bytes priced at each stated link; each plan's predicted
    1F1B step time (passes/step_time.py on FLOPs at DEVICE_FLOPS) at each link."""
    import transformers
    config = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                      num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=8192, rope_theta=500000.0)
    with torch.device("meta"):
        model, ids = transformers.LlamaForCausalLM(config), torch.zeros(batch, seq, dtype=torch.long)
    log("[llama-3-70b] trace + cost (meta)")
    start = time.perf_counter()
    costed = cost(trace(model, (), {"input_ids": ids}))
    planned_s = time.perf_counter() - start
    times = times_from_flops(costed, DEVICE_FLOPS)
    rows, checks = [], []
    for k in ks:
        view = node_view(costed, k)
        greedy = greedy_least_bottleneck([view.weight_of[n] for n in view.order], k)
        variants = [("flops", {}), ("flops, tolerance 0", {"tolerance": 0.0}), ("train_flops", {"balance": "train_flops"})]
        variants += [(f"train_flops priced at {name}", {"balance": "train_flops",
                                                        "crossing_price": crossing_price(link, DEVICE_FLOPS)})
                     for name, link in LINKS.items()]
        for label, options in variants:
            log(f"[llama-3-70b] K={k} {label}")
            start = time.perf_counter()
            plan = adapter.partition(costed, k, chunks=chunks, **options)
            seconds = time.perf_counter() - start
            crossing = [sum(t.nbytes for t in plan.cut_tensors(c)) for c in range(k - 1)]
            cuts = [len(plan.cut_tensors(c)) for c in range(k - 1)]
            steps = [predict_step_time(costed, plan, times, "1f1b", "never", chunks, link=link).step
                     for link in LINKS.values()]
            rows.append([k, label, f"{plan.bottleneck / plan.lower_bound:.4f}", f"{plan.imbalance:.4f}",
                         f"{sum(cuts)} (most {max(cuts)})", human_bytes(max(crossing)), human_bytes(sum(crossing)),
                         *(f"{s:.3f}" for s in steps), f"{seconds:.1f}"])
            if label == "flops, tolerance 0":
                checks.append(f"K={k}: least bottleneck / lower bound {plan.optimum / plan.lower_bound:.4f} (the "
                              f"solver); {greedy / plan.lower_bound:.4f} by a greedy fill over the ungrouped nodes")
    table = tabulate(rows, headers=["K", "plan", "max/LB", "max/mean", "cut tensors", "widest cut", "bytes crossing",
                                    *(f"1F1B step s, {n}" for n in LINKS), "partition s"], tablefmt="simple",
                     disable_numparse=True)
    return "\n".join([
        f"llama-3-70b (80 blocks, d=8192, MLP 28672, vocab 128256; meta, float32), batch {batch} x seq {seq}, "
        f"M={chunks}: trace + cost {planned_s:.1f} s ({len(costed.costs)} nodes)", table,
        f"step: the busiest device's forward, B, W and link time over 1 - the 1F1B bubble, node times from FLOPs at "
        f"{DEVICE_FLOPS / 1e12:.0f} TFLOP/s (stated); links: " + "; ".join(f"{n} = {link}" for n, link in LINKS.items()),
        "bytes at the whole mini-batch, one way; a priced plan pays 2 x bytes / bandwidth per cut each side "
        "(value and gradient)", *checks])


# ---- the table ---------------------------------------------------------------------------------


HEADERS = ["model", "K", "method", "max/mean", "max/LB", "tensors", "bytes", "step/T1", "split s", "plan() s"]


def table_rows(rows: Sequence[Row]) -> list[list]:
    out = []
    for r in rows:
        if r.plan is None:
            out.append([r.model, r.k, r.method, "-", "-", "-", "-", "-", "-", (r.error or "")[:60]])
            continue
        cuts = r.cut_tensors
        out.append([
            r.model, r.k, r.method, f"{r.imbalance:.3f}", f"{r.over_bound:.3f}",
            f"{sum(cuts)} ({'/'.join(map(str, cuts))})" if len(cuts) <= 7 else str(sum(cuts)),
            human_bytes(r.cut_bytes), f"{r.step:.3f}", f"{r.split_s:.2g}",
            "-" if r.plan_call_s is None else f"{r.plan_call_s:.2f}",
        ])
    return out


def format_table(rows: Sequence[Row]) -> str:
    return tabulate(table_rows(rows), headers=HEADERS, tablefmt="simple", disable_numparse=True)


def definitions(chunks: int = CHUNKS) -> str:
    return "\n".join([
        "max/mean  the slowest stage's cost over the mean stage cost (cost = forward FLOPs of the stage's",
        "          nodes, the cost pass's model; 1.000 is perfect balance)",
        "max/LB    the slowest stage over the lower bound max(total/K, largest single node): what no split",
        "          of this graph can beat",
        "tensors   tensors crossing cuts, summed over the K-1 cuts (a tensor counted once per cut it",
        "          crosses; per cut in brackets); bytes: their size at the whole mini-batch",
        f"step/T1   predicted GPipe step time at M={chunks} micro-batches over the time of one device",
        "          running everything: bottleneck * (M+K-1)/M / total (communication not counted);",
        "          perfect balance gives (M+K-1)/(M*K): " + ", ".join(
            f"K={k}: {(chunks + k - 1) / (chunks * k):.3f}" for k in (2, 4, 8)),
        "split s   seconds of the split method itself (for layer methods: on the per-layer costs;",
        "          for autopipe: the partition pass on the costed graph)",
        "plan() s  autopipe only: the whole autopipe.plan call (trace + cost + partition) on the meta model",
        "methods   layer counts = same number of top-level layers per stage; megatron = repeated blocks",
        "          split evenly, embedding/stem on stage 0, head on the last; torchgpipe = Bárány-Grinberg",
        "          block partition on layer costs; deepspeed = partition_method='parameters'; layer DP =",
        "          exact least bottleneck over contiguous layers; autopipe = node granularity, exact least",
        "          bottleneck then fewest crossing tensors within 3%",
    ])


def machine_header() -> str:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    u = platform.uname()
    return (f"# benchmarks/partition.py  {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}\n"
            f"# machine: {cpu or u.machine}; {u.system} {u.release} {u.machine}; {os.cpu_count()} CPUs\n"
            f"# python {platform.python_version()}, torch {torch.__version__}")


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results-dir", type=Path, default=RESULTS.parent,
                    help=f"where to write partition.txt (default {RESULTS.parent})")
    ap.add_argument("--skip-llama", action="store_true", help="leave out the Llama-3-70B case (about a minute)")
    ap.add_argument("--only-llama", action="store_true", help="the Llama-3-70B case alone, printed, nothing written")
    args = ap.parse_args(argv)
    if args.only_llama:
        print(llama_70b())
        return 0
    results = args.results_dir / RESULTS.name
    started = time.perf_counter()
    rows: list[Row] = []
    for case in CASES:
        model, inputs = case.build()
        rows.extend(measure_model(case.name, model, inputs, case.ks))
    log("[synthetic] solve_cuts on 10^5 nodes")
    synth = synthetic()
    log("[gpt-48] autopipe.plan, K=8")
    big = plan_timing(gpt_case(48, ks=(8,)))
    llama = "" if args.skip_llama else llama_70b()
    elapsed = time.perf_counter() - started
    lines = [
        machine_header(),
        "",
        format_table(rows),
        "",
        definitions(),
        "",
        f"synthetic chain, {synth['n']:,} nodes, {synth['edges']:,} edges (random skips), K={synth['k']}: "
        f"solve_cuts {synth['seconds']:.3f} s (median of 3); max/LB {synth['over_bound']:.4f} (least bottleneck/LB "
        f"{synth['optimum_over_bound']:.4f}; within 3% of it, the fewest crossings: {synth['cut_tensors']} tensors)",
        f"gpt-48 (d=1024, seq 1024, batch 8, meta), K=8: autopipe.plan {big['plan_s']:.2f} s; run apart: trace "
        f"{big['trace_s']:.2f} s, cost {big['cost_s']:.2f} s, partition pass {big['partition_s']:.3f} s "
        f"({big['nodes']} nodes); max/mean {big['imbalance']:.3f}",
        "",
        llama,
        f"whole benchmark: {elapsed:.0f} s",
    ]
    text = "\n".join(lines)
    print(text)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(text + "\n")
    log(f"wrote {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
