"""What a stage writes in place: the stage inputs it writes (cloned first, ``inputs_written``; a write another stage
must see is refused) and the buffers it writes (``running_buffers``: BatchNorm's running statistics and the rest)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

import autopipe.random_ops as random_ops
from autopipe.ir.plan import Plan, StagePlan

from .diagnostics import node_where
from .inplace_writes import InPlaceWrites, find_inplace_writes, is_batch_norm


def inputs_written(facts: InPlaceWrites, plan: Plan, sp: StagePlan, inputs: list[fx.Node],
                  body: list[fx.Node]) -> list[fx.Node]:
    """The stage inputs the stage writes in place, to clone first. Raises ValueError for a write another stage (or the
    model's output) would have to see: each stage gets its own copy of what it receives. A safety net: partition keeps
    each write with the reads that must see it (InPlaceWrites.reads), so no plan of its own should meet it."""
    input_set, body_set, own = set(inputs), set(body), {facts.nodes[n] for n in sp.nodes}
    recomputed_elsewhere = {facts.nodes[n] for s in plan.stages if s.index != sp.index for n in s.replicated}

    def local_root(a: fx.Node) -> fx.Node:  # follow views back to a stage input or a tensor made here
        while a not in input_set and facts.alias[a] is not None:
            a = facts.alias[a]
        return a

    for w in body:
        for a in facts.writes[w]:
            root = local_root(a)
            if facts.base[a].op == "get_attr":  # a buffer: every stage holds the same object
                continue
            for m in facts.sharing(a):
                same = (m in body_set or m in input_set) and local_root(m) is root
                if m not in body_set and m not in input_set and any(v in own for v in facts.views_back(m)):
                    continue  # a later stage's view of what this stage sent once it had run, the write included
                for u in m.users:
                    # a reader here sees the write; one elsewhere (a recomputed node's copy too) gets what this stage
                    # sends, which is the write's result only for a tensor made here
                    elsewhere = u not in body_set or u in recomputed_elsewhere
                    if facts.order[u] > facts.order[w] and not (same and (m in own or not elsewhere)):
                        reader = "the model's output" if u.op == "output" else f"{u.name} ({node_where(u)})"
                        raise ValueError(
                            f"stage {sp.index}: {w.name} ({node_where(w)}) writes in place to {a.name}, whose value "
                            f"{reader} reads afterwards through {m.name}, on a copy that does not see the write. Write "
                            f"out of place there (x = x + y, not x += y); see docs/faithfulness.md")
    return list(dict.fromkeys(root
                              for root in (local_root(a) for w in body for a in facts.writes[w]) if root in input_set))


# Note [buffers a module run whole writes]: a module called whole may write its buffers where the in-place
# analysis cannot see (spectral norm's u and v, by a forward pre-hook or a parametrization): every micro-batch
# would share them and a recompute iterate again. So every buffer of a module called whole that has forward
# hooks, a parametrization, or is not torch's own as written counts as written: each task runs on its own copy
# (Note [buffers written in place per task]).
def running_buffers(stage: fx.GraphModule) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(every buffer the stage writes: training BatchNorms' statistics, also in modules run whole, and buffers written
    by in-place ops; those of them no BatchNorm writes: Note [buffers a module run whole writes])."""
    norms = [m for m in stage.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.training]
    buffers = [b for m in norms if m.track_running_stats for b in m.buffers(recurse=False)]
    facts, written = find_inplace_writes(stage), []
    # code the graph does not show may write its buffers (Note [buffers a module run whole writes])
    for node in stage.graph.find_nodes(op="call_module"):
        module = stage.get_submodule(node.target)
        if any(m._forward_hooks or m._forward_pre_hooks or torch.nn.utils.parametrize.is_parametrized(m)
               or not random_ops.from_torch(type(m)) for m in module.modules()):
            written += [b for m in module.modules() if not isinstance(m, torch.nn.modules.batchnorm._NormBase)
                        for b in m.buffers(recurse=False)]
    for node, args in facts.writes.items():
        by_norm = is_batch_norm(node)
        for base in (facts.base[a] for a in args):
            value = operator.attrgetter(base.target)(stage) if base.op == "get_attr" else None
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                (buffers if by_norm else written).append(value)
    return list({id(b): b for b in [*buffers, *written]}.values()), list({id(b): b for b in written}.values())
