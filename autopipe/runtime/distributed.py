"""The pipeline under torchrun: rank r of a replica holds stages r, r+K, ...; data parallel over D replicas of K ranks
and tied weights: docs/architecture.md, "Under torchrun"."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import os
import warnings
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from . import microbatch
from .loss import Loss, scaled
from .p2p import P2PTransport, PipelineError
from .pipeline import Pipeline
from .step import model_loss
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
        self._program = None
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
        if self._program is None:
            raise RuntimeError("the pipeline compiles on its first step: call pipe.step(...) once, or pass "
                               "example_inputs to autopipe.compile")
        return self._program

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
        if self._program is not None:
            self._transport.close()

    def compile_for(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        compiled = self._run_passes(self.model, args, kwargs, self.options, before_codegen=self._materialize)
        if len(compiled.programs) > 1:
            raise NotImplementedError("this model specialises on the batch size and the batch does not divide into "
                                      "equal micro-batches; under torchrun use a batch divisible by chunks")
        program = compiled.main
        stages = {s: program.stages[s] for s in self.stage_indices}
        self._transport = P2PTransport(WireSpec.from_plan(program.plan), stages, timeout=self.timeout,
                                       group=self.pipeline_groups[self.replica],
                                       downward=self.downward_groups[self.replica], rank_of=self.rank_of,
                                       name=f"autopipe/{next(_PIPELINE_IDS)}/{self.replica}")
        self._runners = {s: StageRunner(stage) for s, stage in stages.items()}
        self._shared = []  # (name, group) of each tied parameter this rank holds with other ranks of its replica
        for p in range(self.data_parallel):  # every rank creates every group, in the same order
            for name, holders in sorted(program.plan.shared_params.items()):
                ranks = sorted({p * self.n_ranks + self.rank_of(s) for s in holders})
                if len(ranks) > 1:  # all on one rank: summed there
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        self._shared.append((name, group))
        self._program = program

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
        if self._program is None:
            self.compile_for(args, kwargs)
        traced, transport, runners = self._program.traced, self._transport, self._runners
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
                        targets=microbatch.split_target(target, sizes), sizes=sizes, plan=self._program.plan,
                        output_counts=[self._program.count_targets(row) for row in rows])
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
            device = next(iter(self._runners.values())).stage.device
            box = torch.tensor([math.nan if scale is None else scale], dtype=torch.float64, device=device)
            last_rank = self.replica * self.n_ranks + self.rank_of(len(self.options.devices) - 1)
            dist.broadcast(box, src=last_rank, group=self.pipeline_groups[self.replica])
            scale = None if math.isnan(box.item()) else box.item()
        return scale

    def _reduce_gradients(self) -> None:
        for name, group in self._shared:
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
