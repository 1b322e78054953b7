"""The pipeline under torchrun: rank r of a replica holds stages r, r+K, ...; data parallel over D replicas of K ranks
and tied weights: docs/architecture.md, "Under torchrun"."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import itertools
import json
import math
import os
import warnings
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from . import microbatch
from .clipping import clip_grad_norm_
from .loss import Loss, scaled
from .p2p import P2PTransport, PipelineError
from .pipeline import Pipeline, check_same_kinds, signature_key
from .step import Program, model_loss
from .schedule import Schedule, device_of_stage
from .task import StageRunner, StepState, accumulate_grads
from .wire import WireSpec

__all__ = ["DistributedPipeline", "PipelineError", "running_under_torchrun"]

_PIPELINE_IDS = itertools.count()  # the same sequence on every rank: distinct store keys per pipeline


def running_under_torchrun() -> bool:
    return dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1


def _rank_device(model: torch.nn.Module) -> torch.device:
    """Where this rank's stages run: where the user put the model (the CPU for a model on meta)."""
    found = {t.device for t in itertools.chain(model.parameters(), model.buffers()) if t.device.type != "meta"}
    if len(found) > 1:
        raise ValueError(f"{type(model).__name__} has tensors on {sorted(map(str, found))}: under torchrun each "
                         f"rank runs its stages on one device; move the model there first (model.to(device))")
    return found.pop() if found else torch.device("cpu")


def _backend(device: torch.device) -> str:
    """NCCL where every local rank can have a GPU of its own (made current first, as NCCL needs); else gloo, which
    carries a CUDA rank's messages through host memory (two processes sharing one GPU). The same on every rank."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if device.type != "cuda" or torch.cuda.device_count() < local_ranks:
        return "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.index != local_rank:
        raise ValueError(f"local rank {local_rank}'s model is on {device}, but with a GPU for every local rank the "
                         f"pipeline runs over NCCL, which needs local rank r on cuda:r: "
                         f"model.to(f'cuda:{{LOCAL_RANK}}'). To share GPUs, call "
                         f"torch.distributed.init_process_group('gloo') before compiling")
    torch.cuda.set_device(device)
    return "nccl"


_REQUIRED = object()


def _tensor(module: torch.nn.Module, name: str, missing: Any = _REQUIRED) -> torch.Tensor:
    """The model's tensor of that qualified name; ``missing`` where it has none (fx's ``_tensor_constant0``, export's
    lifted constants: tensors the trace made, held by the graph, issue 29)."""
    owner_name, _, attr = name.rpartition(".")
    try:
        return getattr(module.get_submodule(owner_name), attr)
    except AttributeError:
        if missing is _REQUIRED:
            raise
        return missing


@dataclasses.dataclass
class _RankProgram:
    """One input signature's program as this rank runs it: its stages, their runners, what travels between ranks."""

    program: Program
    spec: WireSpec
    stages: dict[int, Any]              # this rank's, by stage index
    runners: dict[int, StageRunner]
    arguments: list[tuple[str, str]]    # the call it was compiled for (``_described``)


def _described(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[str, str]]:
    """Each argument leaf by name (``input_ids``, ``past[0]``) and its shape and dtype, or its value."""
    try:
        arguments = dict(inspect.signature(model.forward).bind(*args, **kwargs).arguments)
    except TypeError:
        arguments = {"args": tuple(args), **kwargs}
    described = [("the model's mode", "training" if model.training else "eval")]
    for name, value in arguments.items():
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            what = f"of shape {tuple(leaf.shape)} ({leaf.dtype})" if isinstance(leaf, torch.Tensor) else repr(leaf)
            described.append((f"argument {name}{pytree.keystr(path)}", what[:100]))
    return described


def _same_parameters(first: _RankProgram, plan, arguments: list[tuple[str, str]]) -> None:
    """Note [one cut for every shape]: refused where a new shape's stages would hold other parameters than the first
    shape's (its graph is not the first one's, so its cut could not be kept)."""
    for a, b in zip(first.program.plan.stages, plan.stages):
        if set(a.params) != set(b.params):
            moved = sorted(set(a.params) ^ set(b.params))[0]
            name, now, then = next(((x, y, z) for (x, y), (_, z) in zip(arguments, first.arguments) if y != z),
                                   ("the call", "new", "the first"))
            raise ValueError(f"{name} is {now} where it was {then}, and the model traces to another graph that moves "
                             f"{moved} off stage {a.index}: under torchrun a rank keeps its first stage's parameters; "
                             f"pad inputs to shapes that trace alike (docs/torchrun.md)")


class DistributedPipeline(torch.nn.Module):
    """This rank's stages of a pipeline compiled under torchrun. ``pipe.step(...)`` runs a step."""

    def __init__(self, model: torch.nn.Module, options: Any, run_passes: Callable, *, data_parallel: int = 1,
                 timeout: float = 300.0, deferred_batch_norm: bool = False):
        super().__init__()
        object.__setattr__(self, "model", model)
        options = dataclasses.replace(options, devices=(_rank_device(model),) * len(options.devices))
        if not dist.is_initialized():
            dist.init_process_group(backend=_backend(options.devices[0]), timeout=timedelta(seconds=max(timeout, 60)))
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        if data_parallel < 1 or self.world % data_parallel:
            raise ValueError(f"data_parallel={data_parallel} must divide the world size {self.world}")
        self.n_ranks = self.world // data_parallel     # K: ranks per pipeline replica
        if len(options.devices) != self.n_ranks * options.virtual_stages:
            raise ValueError(f"the options plan {len(options.devices)} stages for {self.n_ranks} ranks")
        self.options, self.data_parallel, self.timeout = options, data_parallel, timeout
        self.deferred_batch_norm, self.schedule_name = deferred_batch_norm, options.schedule
        self.replica, self.stage_index = divmod(self.rank, self.n_ranks)  # stage_index: this rank's first stage
        self.rank_of = functools.partial(device_of_stage, options.schedule, self.n_ranks)  # a stage's rank, 0..K-1
        self.stage_indices = [s for s in range(len(options.devices)) if self.rank_of(s) == self.stage_index]
        self._run_passes = run_passes
        self._programs: dict[tuple, _RankProgram] = {}  # by input signature (pipeline.signature_key)
        self._current: _RankProgram | None = None
        self._transport: P2PTransport | None = None
        self._shared: list[tuple[str, dist.ProcessGroup, list[int]]] = []
        self._id = next(_PIPELINE_IDS)
        self._signatures = dist.PrefixStore(f"autopipe/{self._id}/signatures",
                                            dist.distributed_c10d._get_default_store())
        self._schedule = functools.cache(lambda chunks: Schedule.build(self.schedule_name, self.n_ranks, chunks,
                                                                       options.virtual_stages))
        # Every rank creates every group, in the same order (torch.distributed requires it).
        replicas = [list(range(p * self.n_ranks, (p + 1) * self.n_ranks)) for p in range(data_parallel)]
        self.pipeline_groups = [dist.new_group(ranks) for ranks in replicas]
        # NCCL runs a pair's messages in posting order, both directions: messages to a lower rank get groups of their
        # own (architecture.md)
        nccl = "nccl" in str(dist.get_backend())
        self.downward_groups = [dist.new_group(ranks) for ranks in replicas] if nccl else self.pipeline_groups
        self.data_parallel_groups = [dist.new_group(list(range(r, self.world, self.n_ranks)))
                                     for r in range(self.n_ranks)]

    @property
    def plan(self):
        return self._built().plan

    @property
    def stages(self) -> list:
        """This rank's stages (one, or v with the interleaved schedule)."""
        return [self._built().stages[s] for s in self.stage_indices]

    def _built(self):
        if self._current is None:
            raise RuntimeError("the pipeline compiles on its first step: call pipe.step(...) once, or pass "
                               "example_inputs to autopipe.compile")
        return self._current.program

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's parameters under the model's own names."""
        seen = set()
        for stage in self.stages:
            for name, p in stage.named_parameters(prefix, recurse, remove_duplicate=False):
                if not (remove_duplicate and id(p) in seen):
                    seen.add(id(p))
                    yield name, p

    def state_dict(self, *args, **kwargs):
        """This rank's slice of the model's state dict, under the model's own names."""
        return {k: v for stage in self.stages for k, v in stage.state_dict(*args, **kwargs).items()}

    def load_state_dict(self, state_dict, strict: bool = False, assign: bool = False):
        """Load this rank's slice from a full (or partial) state dict of the model."""
        for stage in self.stages:
            stage.load_state_dict({k: state_dict[k] for k in stage.state_dict() if k in state_dict}, strict=strict,
                                  assign=assign)

    train = Pipeline.train  # the model's own mode
    _apply = Pipeline._apply  # pipe.to()/.cuda()/.half(): placement is the plan's, refused as in-process

    def __repr__(self) -> str:
        return (f"DistributedPipeline(rank {self.rank}: stages {self.stage_indices} of {len(self.options.devices)}, "
                f"replica {self.replica} of {self.data_parallel}, chunks={self.options.chunks}, "
                f"checkpoint={self.options.checkpoint!r})")

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """The plain model's ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``: the norm over every stage of
        the pipeline, each tied weight counted once, and every rank scaled by it; returns that norm on every rank
        (Note [clipping over ranks], runtime/clipping.py). Call it on every rank, after the step."""
        elsewhere = {id(_tensor(self.model, name)) for name, _, ranks in self._shared if ranks[0] != self.rank}
        mine = list(self.parameters())
        return clip_grad_norm_(mine, max_norm, norm_type, counted=[p for p in mine if id(p) not in elsewhere],
                               group=self.pipeline_groups[self.replica], device=self.options.devices[0],
                               error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    def compile_for(self, args: Sequence[Any], kwargs: dict[str, Any]) -> _RankProgram:
        """The program of these arguments' signature (``pipeline.signature_key``), compiled on first sight: every rank
        of the replica is called with the same arguments, so each plans the same program at the same step."""
        key = signature_key(self.model, args, kwargs)
        known = self._programs.get(key)
        if known is None:
            known = self._programs[key] = self._compile(args, kwargs)
        if known is not self._current:
            self._transport.use(known.spec, known.stages)
            self._current = known
        return known

    def _compile(self, args: Sequence[Any], kwargs: dict[str, Any]) -> _RankProgram:
        """A new input signature's program. Note [one cut for every shape]: a rank holds its stages' parameters and the
        optimizer the user built over them, so every later program keeps the first program's cut (partition's
        ``cut_of``), and is refused where its stages would hold other parameters."""
        arguments = self._agree_on_arguments(args, kwargs)
        first = next(iter(self._programs.values()), None)
        if first is not None:
            check_same_kinds(first.program.traced, self.options.chunks, args, kwargs)
        compiled = self._run_passes(self.model, args, kwargs, self.options, before_codegen=self._materialize,
                                    cut_of=None if first is None else first.program.plan)
        if len(compiled.programs) > 1:
            raise NotImplementedError("this model specialises on the batch size and the batch does not divide into "
                                      "equal micro-batches; under torchrun use a batch divisible by chunks")
        program = compiled.main
        if first is not None:
            _same_parameters(first, program.plan, arguments)
        stages = {s: program.stages[s] for s in self.stage_indices}
        spec = WireSpec.from_plan(program.plan)
        if self._transport is None:
            self._transport = P2PTransport(spec, stages, timeout=self.timeout, group=self.pipeline_groups[self.replica],
                                           downward=self.downward_groups[self.replica], rank_of=self.rank_of,
                                           name=f"autopipe/{self._id}/{self.replica}")
            self._tie(program.plan)
        return _RankProgram(program, spec, stages, {s: StageRunner(stage) for s, stage in stages.items()}, arguments)

    def _agree_on_arguments(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[str, str]]:
        """Before a new program is planned, every rank of the replica checks that the others were called with the same
        argument shapes: a rank planning another program would send messages of other sizes."""
        mine = _described(self.model, args, kwargs)
        n, store = len(self._programs), self._signatures
        store.set(f"{n}/{self.rank}", json.dumps(mine))
        for q in range(self.replica * self.n_ranks, (self.replica + 1) * self.n_ranks):
            theirs = [tuple(d) for d in json.loads(store.get(f"{n}/{q}").decode())]
            if theirs != mine:
                name, here, there = next(((a, b, c) for (a, b), (_, c) in zip(mine, theirs) if b != c),
                                         ("the arguments", len(mine), len(theirs)))
                raise ValueError(f"rank {self.rank}: {name} is {here} here but {there} on rank {q}: call pipe.step "
                                 f"with the same arguments on every rank of a pipeline (docs/torchrun.md)")
        return mine

    def _tie(self, plan) -> None:
        """A process group per tied parameter held by several ranks of a replica (every rank creates every group, in
        the same order, as torch.distributed requires): its gradients are summed there after each step."""
        self._shared = []  # (name, group, ranks) of each tied parameter this rank holds with other ranks of its replica
        for p in range(self.data_parallel):
            for name, holders in sorted(plan.shared_params.items()):
                ranks = sorted({p * self.n_ranks + self.rank_of(s) for s in holders})
                if len(ranks) > 1:  # all on one rank: summed there
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        self._shared.append((name, group, ranks))

    def _materialize(self, plan) -> None:
        """A model built on meta: create and initialise only this rank's tensors (architecture.md, "Meta models")."""
        fresh: dict[int, torch.Tensor] = {}
        owners: dict[str, None] = {}  # the modules to reset, in order
        for name in (name for s in self.stage_indices for name in plan.stages[s].params):
            t = _tensor(self.model, name, missing=None)
            if t is None or t.device.type != "meta" or id(t) in fresh:  # None: a constant the trace made, in the graph
                continue
            new = torch.empty_like(t, device="cpu")
            fresh[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
            owners[name.rpartition(".")[0]] = None
        for module in self.model.modules():
            for table in (module._parameters, module._buffers):
                for attr, t in table.items():
                    if t is not None and id(t) in fresh:
                        table[attr] = fresh[id(t)]
        unset = [o for o in owners if not hasattr(self.model.get_submodule(o), "reset_parameters")]
        for owner_name in (o for o in owners if o not in unset):
            digest = hashlib.blake2b(owner_name.encode(), digest_size=8).digest()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
                self.model.get_submodule(owner_name).reset_parameters()
        if unset:
            warnings.warn(f"rank {self.rank}: modules {unset[:5]}{'...' if len(unset) > 5 else ''} were on the meta "
                          f"device and have no reset_parameters(): their tensors hold uninitialised memory until you "
                          f"call pipe.load_state_dict(...)", stacklevel=3)

    def step(self, *args, target: Any = None, loss_fn: Callable | None = None, **kwargs):
        """Forward and backward of all micro-batches in schedule order on every rank. Call it with the same arguments on
        every rank (each stage reads only the inputs its nodes use). Returns the mini-batch loss on the last stage's
        ranks, None elsewhere."""
        current = self.compile_for(args, kwargs)
        program, transport, runners = current.program, self._transport, current.runners
        traced = program.traced
        flat = traced.flat_inputs(args, kwargs)
        traced.check_grad_flags(self.model, flat)
        sizes = microbatch.micro_batch_sizes(flat[0].shape[0], self.options.chunks)
        rows = microbatch.split(flat, sizes)
        local = [dict(zip(traced.input_names, row)) for row in rows]
        schedule = self._schedule(len(sizes))
        state = StepState.start(training=True, random=self.model.training, checkpoint=self.options.checkpoint,
                                schedule=schedule, deferred_model=self.model if self.deferred_batch_norm else None,
                                track_memory=False, devices=self.options.devices[:1])
        last, loss = len(self.options.devices) - 1, None
        if last in runners:
            loss = Loss(fn=loss_fn or model_loss, rebuild=traced.rebuild_output,
                        targets=microbatch.split_target(target, sizes), sizes=sizes, plan=program.plan,
                        output_counts=[program.count_targets(row) for row in rows])
        for runner in runners.values():
            runner.start_step(state)
        transport.run(local, sizes, schedule, lambda t: runners[t.stage], state, loss)
        self.timeline = state.timeline  # this rank's tasks
        if state.deferred is not None:
            state.deferred.commit()
        scale = self._grad_scale(loss) if loss_fn is not None else None
        for runner in runners.values():  # in stage order: tied weights on one rank sum in a fixed order
            accumulate_grads(scaled(runner.take_grads(state), scale))
        self._reduce_gradients()
        return loss.total if loss is not None else None

    def _grad_scale(self, loss: Loss | None) -> float | None:
        """A loss_fn returning (sum, count) backpropagates the sums: every rank of the pipeline divides its gradients by
        the whole count, which only the last stage's rank knows (runtime/loss.py)."""
        scale = loss.grad_scale if loss is not None else None
        if self.n_ranks > 1:
            device = self.options.devices[0]
            box = torch.tensor([math.nan if scale is None else scale], dtype=torch.float64, device=device)
            last_rank = self.replica * self.n_ranks + self.rank_of(len(self.options.devices) - 1)
            dist.broadcast(box, src=last_rank, group=self.pipeline_groups[self.replica])
            scale = None if math.isnan(box.item()) else box.item()
        return scale

    def _reduce_gradients(self) -> None:
        for name, group, _ in self._shared:
            p = _tensor(self.model, name)  # by its canonical name; the stage may know it by another
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
        grads = [p.grad for p in self.parameters() if p.grad is not None] if self.data_parallel > 1 else []
        if grads:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.data_parallel_groups[self.stage_index])
            flat /= self.data_parallel
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
