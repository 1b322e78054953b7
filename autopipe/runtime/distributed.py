"""The pipeline under torchrun: rank r holds its stages alone (stage r of its pipeline, r+K, ... interleaved), over a
DeviceMesh whose "pp" dim is the pipeline and whose "dp_shard" / "dp_replicate" dims run FSDP2 over each stage; tied
weights, DCP checkpoints and pretrained loads: docs/architecture.md, "Under torchrun"; docs/torchrun.md."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import json
import math
import os
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from autopipe.ir.schedule import Schedule, device_of_stage

from . import checkpoint, materialize, microbatch
from .clipping import clip_grad_norm_
from .loss import Loss, scaled
from .mesh import describe, pipeline_size, rank_layout, tie_groups
from .p2p import P2PTransport, PipelineError
from .pipeline import check_same_kinds, signature_key
from .sharding import ShardedStages, grads_before, refuse_fsdp_on_top, sharded_by_the_user, sum_tied
from .step import Program, model_loss
from .gradients import accumulate_grads
from .step_state import StepState
from .task import StageRunner
from .wire import WireSpec

__all__ = ["DistributedPipeline", "PipelineError", "running_under_torchrun"]

_PIPELINE_IDS = itertools.count()  # the same sequence on every rank: distinct store keys per pipeline


def running_under_torchrun() -> bool:
    return dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1


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
    lifted constants: tensors the trace made, held by the graph)."""
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
    """Refused where a new shape's stages would hold other parameters than the first shape's (its graph is not the
    first one's, so its cut could not be kept: Note [one cut for every shape])."""
    for a, b in zip(first.program.plan.stages, plan.stages):
        if set(a.params) != set(b.params):
            moved = sorted(set(a.params) ^ set(b.params))[0]
            name, now, then = next(((x, y, z) for (x, y), (_, z) in zip(arguments, first.arguments) if y != z),
                                   ("the call", "new", "the first"))
            raise ValueError(f"{name} is {now} where it was {then}, and the model traces to another graph that moves "
                             f"{moved} off stage {a.index}: under torchrun a rank keeps its first stage's parameters; "
                             f"pad inputs to shapes that trace alike (docs/torchrun.md)")


class DistributedPipeline(torch.nn.Module):
    """This rank's stages of a pipeline compiled under torchrun. ``pipe.step(...)`` runs a step. Its module tree is the
    model's, restricted to this rank's stages (``state_dict``, ``get_state_dict(pipe, optimizer)``)."""

    def __init__(self, model: torch.nn.Module, options: Any, run_passes: Callable, *, mesh: Any = None,
                 data_parallel: int = 1, device: Any = None, timeout: float = 300.0, deferred_batch_norm: bool = False):
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a child: the module tree is the rank's stages' (checkpoint.py)
        if (user_fsdp := sharded_by_the_user(model, type(model).__name__)) is not None:
            raise ValueError(f"{user_fsdp}: autopipe shards each stage itself over the mesh's 'dp_shard' dim; compile "
                             f"the unsharded model (docs/torchrun.md)")
        device = materialize.rank_device(device, model)
        options = dataclasses.replace(options, devices=(device,) * len(options.devices))
        if not dist.is_initialized():
            dist.init_process_group(backend=_backend(device), timeout=timedelta(seconds=max(timeout, 60)))
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.n_ranks = pipeline_size(mesh, self.world, data_parallel, options.balance, options.virtual_stages)
        if len(options.devices) != self.n_ranks * options.virtual_stages:
            raise ValueError(f"the options plan {len(options.devices)} stages for {self.n_ranks} ranks")
        self.layout = rank_layout(mesh, data_parallel, device.type)
        self.options, self.data_parallel, self.timeout = options, self.layout.data_parallel, timeout
        self.deferred_batch_norm, self.schedule_name = deferred_batch_norm, options.schedule
        self.replica, self.stage_index = self.layout.index, self.layout.position  # stage_index: this rank's first
        self.rank_of = functools.partial(device_of_stage, options.schedule, self.n_ranks)  # a stage's rank, 0..K-1
        self.stage_indices = [s for s in range(len(options.devices)) if self.rank_of(s) == self.stage_index]
        self._run_passes = run_passes
        self._programs: dict[tuple, _RankProgram] = {}  # by input signature (pipeline.signature_key)
        self._current: _RankProgram | None = None
        self._transport: P2PTransport | None = None
        self._sharded: ShardedStages | None = None
        self._tied: list[tuple[str, dist.ProcessGroup, list[int]]] = []
        self._moved: dict = {}
        self._id = next(_PIPELINE_IDS)
        self._signatures = dist.PrefixStore(f"autopipe/{self._id}/signatures",
                                            dist.distributed_c10d._get_default_store())
        self._schedule = functools.cache(lambda chunks: Schedule.build(self.schedule_name, self.n_ranks, chunks,
                                                                       options.virtual_stages))
        # Every rank creates every group, in the same order (torch.distributed requires it).
        self.pipeline_groups = [dist.new_group(ranks) for ranks in self.layout.pipelines]
        # Note [one direction per NCCL group]: NCCL runs a pair's messages in posting order on one stream, in both
        # directions, so a receive posted ahead would block the sends it waits for. Messages to a lower rank travel
        # in process groups of their own, and each (pair, group) carries one direction, its receives posted in the
        # sender's order.
        nccl = "nccl" in str(dist.get_backend())
        self.downward_groups = [dist.new_group(r) for r in self.layout.pipelines] if nccl else self.pipeline_groups

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
        """This rank's parameters under the model's own names, in stage order (under FSDP2, its shards)."""
        seen = set()
        for stage in self.stages:
            for name, p in stage.named_parameters(prefix, recurse, remove_duplicate=False):
                if not (remove_duplicate and id(p) in seen):
                    seen.add(id(p))
                    yield name, p

    def load_state_dict(self, state_dict, strict: bool = False, assign: bool = False):
        """Load this rank's slice from a full (or partial) state dict of the model, in place."""
        if assign:
            raise ValueError("pipe.load_state_dict(..., assign=True) would give the stages new tensors, which neither "
                             "the optimizer nor FSDP2 holds; load in place (assign=False)")
        own = self.state_dict(keep_vars=True)
        return super().load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=strict)

    def load_pretrained(self, path: str | os.PathLike) -> None:
        """This rank's tensors from a Hugging Face safetensors checkpoint (``save_pretrained``, sharded or not), each
        rank reading only its own: ``dcp.load`` with ``HuggingFaceStorageReader`` (runtime/checkpoint.py). A tied
        weight's other name is read from the name the checkpoint holds. Call it on every rank."""
        checkpoint.load_pretrained(self, self._model, path)

    def train(self, mode: bool = True):
        self._model.train(mode)  # the model's own mode, which the stages' programs read
        self.training = mode
        return self

    def _apply(self, fn, recurse=True):
        raise RuntimeError("a compiled pipeline's placement is its plan's: pipe.to()/.cuda()/.half() would move this "
                           "rank's stages only; compile with device= (or cast the model first)")

    def __repr__(self) -> str:
        return (f"DistributedPipeline(rank {self.rank}: stages {self.stage_indices} of {len(self.options.devices)}, "
                f"pipeline {self.replica} of {self.data_parallel}, {describe(self.layout)}, "
                f"chunks={self.options.chunks}, checkpoint={self.options.checkpoint!r})")

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """The plain model's ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``: the norm over every stage and
        shard of the pipeline, each tied weight counted once, and every rank scaled by it; returns that norm on every
        rank (Note [clipping over ranks], runtime/clipping.py). Call it on every rank, after the step."""
        elsewhere = {id(_tensor(self._model, name)) for name, _, ranks in self._tied if ranks[0] != self.rank}
        mine = list(self.parameters())
        return clip_grad_norm_(mine, max_norm, norm_type, counted=[p for p in mine if id(p) not in elsewhere],
                               group=self.pipeline_groups[self.replica], device=self.options.devices[0],
                               error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    def compile_for(self, args: Sequence[Any], kwargs: dict[str, Any]) -> _RankProgram:
        """The program of these arguments' signature (``pipeline.signature_key``), compiled on first sight: every rank
        is called with arguments of the same shapes, so each plans the same program at the same step."""
        if self._current is not None:
            refuse_fsdp_on_top(self, self.stages)
        key = signature_key(self._model, args, kwargs)
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
        with materialize.on_meta_for_tracing(self._model) as twins:
            compiled = self._run_passes(self._model, args, kwargs, self.options,
                                        after_codegen=functools.partial(self._hold, twins),
                                        cut_of=None if first is None else first.program.plan)
        if len(compiled.programs) > 1:
            raise NotImplementedError("this model specialises on the batch size and the batch does not divide into "
                                      "equal micro-batches; under torchrun use a batch divisible by chunks")
        program = compiled.main
        graph_modules = list(program.traced.graph_module.modules())
        materialize.rebind(graph_modules, self._moved)  # the traced graph's containers (export's hold every tensor)
        self._moved, program.runners = {}, []  # (the in-process runners: this rank's tensors as compiled)
        if first is not None:
            _same_parameters(first, program.plan, arguments)
        stages = {s: program.stages[s] for s in self.stage_indices}
        spec = WireSpec.from_plan(program.plan)
        if first is None:
            if self.layout.dp_mesh is not None:
                self._sharded = ShardedStages(list(stages.values()), self.layout.dp_mesh,
                                              [*self._model.modules(), *graph_modules])
            checkpoint.adopt_module_tree(self, list(stages.values()), self._model)
            self._transport = P2PTransport(spec, stages, timeout=self.timeout, group=self.pipeline_groups[self.replica],
                                           downward=self.downward_groups[self.replica], rank_of=self.rank_of,
                                           name=f"autopipe/{self._id}/{self.replica}")
            self._tied = tie_groups(self.layout, program.plan.shared_params, self.rank_of)
        runners = {s: StageRunner(stage) for s, stage in stages.items()}
        # one thread drives a rank's stages: Note [no hook on a tensor two threads differentiate]
        for runner in runners.values():
            runner.sum_as_made = True
        return _RankProgram(program, spec, stages, runners, arguments)

    def _hold(self, twins: dict, stages: list) -> None:
        """Right after codegen, before any runner looks at the stages: this rank's tensors on its device, the rest of
        the model on meta (runtime/materialize.py); a later program's stages, traced on meta twins, given the
        tensors the rank holds."""
        if twins:
            materialize.adopt(self._model, stages, self.stage_indices, twins)
        else:
            self._moved = materialize.hold_only(self._model, stages, self.stage_indices, self.options.devices[0],
                                                self.rank)

    def _agree_on_arguments(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[str, str]]:
        """Before a new program is planned, every rank of the pipeline checks that the others were called with the same
        argument shapes: a rank planning another program would send messages of other sizes. Data-parallel pipelines
        may differ (each its own batch, as under DDP: their gradients are averaged)."""
        mine = _described(self._model, args, kwargs)
        n, store = len(self._programs), self._signatures
        store.set(f"{self.replica}/{n}/{self.rank}", json.dumps(mine))
        for q in self.layout.pipelines[self.replica]:
            theirs = [tuple(d) for d in json.loads(store.get(f"{self.replica}/{n}/{q}").decode())]
            if theirs != mine:
                name, here, there = next(((a, b, c) for (a, b), (_, c) in zip(mine, theirs) if b != c),
                                         ("the arguments", len(mine), len(theirs)))
                raise ValueError(f"rank {self.rank}: {name} is {here} here but {there} on rank {q}: call pipe.step "
                                 f"with arguments of the same shapes on every rank of a pipeline (docs/torchrun.md)")
        return mine

    def step(self, *args, target: Any = None, loss_fn: Callable | None = None, **kwargs):
        """Forward and backward of all micro-batches in schedule order on every rank. Call it with arguments of the
        same shapes on every rank of a pipeline (each stage reads only the inputs its nodes use; a data-parallel
        pipeline, its own batch). Returns the mini-batch loss on the last stage's ranks, None elsewhere."""
        current = self.compile_for(args, kwargs)
        program, transport, runners, sharded = current.program, self._transport, current.runners, self._sharded
        traced = program.traced
        flat = traced.flat_inputs(args, kwargs)
        traced.check_grad_flags(self._model, flat)
        sizes = microbatch.micro_batch_sizes(flat[0].shape[0], self.options.chunks)
        rows = microbatch.split(flat, sizes)
        local = [dict(zip(traced.input_names, row)) for row in rows]
        schedule = self._schedule(len(sizes))
        state = StepState.start(training=True, random=self._model.training, checkpoint=self.options.checkpoint,
                                schedule=schedule, deferred_model=self._model if self.deferred_batch_norm else None,
                                track_memory=False, devices=self.options.devices[:1])
        last, loss = len(self.options.devices) - 1, None
        if last in runners:
            loss = Loss(fn=loss_fn or model_loss, rebuild=traced.rebuild_output,
                        targets=microbatch.split_target(target, sizes), sizes=sizes, plan=program.plan,
                        output_counts=[program.count_targets(row) for row in rows])
        # a later program's stages follow the first's under FSDP2 (Note [programs after the first under FSDP2])
        later = [] if current is next(iter(self._programs.values())) else list(current.stages.values())
        if sharded is not None:
            sharded.unshard(later)
        for runner in runners.values():
            if sharded is not None:
                runner.take_parameters()  # the unsharded parameters, which the tasks differentiate
            runner.start_step(state)
        transport.run(local, sizes, schedule, lambda t: runners[t.stage], state, loss)
        self.timeline = state.timeline  # this rank's tasks
        if state.deferred is not None:
            state.deferred.commit()
        scale = self._grad_scale(loss) if loss_fn is not None else None
        lookup = lambda name: _tensor(self._model, name)  # by its canonical name: a stage may say another
        before = grads_before(self._tied, lookup)
        if sharded is not None:
            sharded.reduce([pair for runner in runners.values() for pair in scaled(runner.take_grads(state), scale)],
                           later)
        for runner in runners.values() if sharded is None else ():  # in stage order: a tie on one rank sums alike
            accumulate_grads(scaled(runner.take_grads(state), scale))
        sum_tied(self._tied, lookup, before)
        return loss.total if loss is not None else None

    def _grad_scale(self, loss: Loss | None) -> float | None:
        """A loss_fn returning (sum, count) backpropagates the sums: every rank of the pipeline divides its gradients by
        the whole count, which only the last stage's rank knows (runtime/loss.py)."""
        scale = loss.grad_scale if loss is not None else None
        if self.n_ranks > 1:
            device = self.options.devices[0]
            box = torch.tensor([math.nan if scale is None else scale], dtype=torch.float64, device=device)
            last_rank = self.layout.ranks[self.rank_of(len(self.options.devices) - 1)]
            dist.broadcast(box, src=last_rank, group=self.pipeline_groups[self.replica])
            scale = None if math.isnan(box.item()) else box.item()
        return scale
