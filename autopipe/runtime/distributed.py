"""The pipeline over torch.distributed: one stage per rank, under torchrun.

Every rank traces and plans the same model with the same inputs, so every
rank holds the same Plan (checked once by the transport with a hash of the
wire spec, runtime/wire.py); shapes come from the plan, so a step exchanges payload only. The
transport is autopipe.runtime.p2p (point-to-point sends of each cross-cut
tensor straight to the rank that reads it; see notes/distributed.md for why
not torch.distributed.pipelining: it neither sums gradients of tied weights
across stages nor supports a tensor read by two later stages).

With the interleaved schedule a rank holds v stages: stage s runs on rank s % K.

Pipeline x data parallel: with world = K x D ranks, replica p holds ranks
p*K .. p*K+K-1; stage s's gradients are averaged over its D replicas, and a
parameter shared by two stages (tied embeddings) has its gradient summed over
the ranks of one replica that hold it first (Megatron-LM's embedding group).
"""
from __future__ import annotations

import hashlib
import itertools
import os
import warnings
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from . import microbatch
from .executor import Loss, run_tasks
from .p2p import P2PTransport, PipelineError
from .pipeline import model_loss
from .schedule import Schedule
from .task import StageRunner, StepState
from .wire import WireSpec

__all__ = ["DistributedPipeline", "PipelineError", "running_under_torchrun"]


_PIPELINE_IDS = itertools.count()  # the same sequence on every rank: distinct store keys per pipeline


def running_under_torchrun() -> bool:
    return dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1


def _refuse_cuda(named_values) -> None:
    """The distributed runtime moves tensors over gloo between CPU stages; a CUDA tensor would
    otherwise fail deep in the transport, or a GPU user would train on the CPU without knowing."""
    for what, value in named_values:
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            raise NotImplementedError(
                f"{what} is on {value.device}: autopipe's torchrun runtime runs CPU stages over gloo; CUDA stages "
                f"over NCCL are not supported yet. Keep the model and inputs on the CPU (or build the model on "
                f"meta), or use one process with autopipe.compile(model, devices=[...cuda devices...]).")


class DistributedPipeline(torch.nn.Module):
    """This rank's stage of a pipeline compiled under torchrun. ``pipe.step(...)`` runs a step."""

    def __init__(self, model: torch.nn.Module, options: Any, checkpoint: str, run_passes: Callable,
                 data_parallel: int = 1, timeout: float = 300.0, deferred_batch_norm: bool = False,
                 materialize_seed: int = 0, schedule: str = "gpipe", virtual_stages: int = 1):
        super().__init__()
        object.__setattr__(self, "model", model)
        _refuse_cuda((f"model tensor {n!r}", p) for n, p in itertools.chain(model.named_parameters(), model.named_buffers()))
        if not dist.is_initialized():
            dist.init_process_group(backend="gloo", timeout=timedelta(seconds=max(timeout, 60)))
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        if data_parallel < 1 or self.world % data_parallel:
            raise ValueError(f"data_parallel={data_parallel} must divide the world size {self.world}")
        self.n_ranks = self.world // data_parallel     # K: ranks per pipeline replica
        self.n_stages = self.n_ranks * virtual_stages
        self.virtual_stages = virtual_stages
        self.data_parallel = data_parallel
        self.replica, self.stage_index = divmod(self.rank, self.n_ranks)  # stage_index: this rank's first stage
        self.stage_indices = list(range(self.stage_index, self.n_stages, self.n_ranks))
        self.options = options
        self.chunks = options.chunks
        self.checkpoint = checkpoint
        self.schedule_name = schedule
        self.timeout = timeout
        self.deferred_batch_norm = deferred_batch_norm
        self.materialize_seed = materialize_seed
        self._run_passes = run_passes
        self.device = torch.device("cpu")
        self._built = None
        self._schedules: dict[int, Schedule] = {}
        # Every rank creates every group, in the same order (torch.distributed requires it).
        self.pipeline_groups = [dist.new_group(list(range(p * self.n_ranks, (p + 1) * self.n_ranks)))
                                for p in range(data_parallel)]
        self.data_parallel_groups = [dist.new_group(list(range(r, self.world, self.n_ranks)))
                                     for r in range(self.n_ranks)]

    # -- what a user looks at ---------------------------------------------------
    @property
    def plan(self):
        self._require_built()
        return self._built["plan"]

    @property
    def stages(self) -> list:
        """This rank's stages (one, or v with the interleaved schedule)."""
        self._require_built()
        return self._built["stages"]

    @property
    def stage(self):
        if len(self.stages) != 1:
            raise AttributeError(f"rank {self.rank} holds {len(self.stages)} stages: use pipe.stages")
        return self.stages[0]

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's parameters under the model's own names."""
        seen = set()
        for stage in self.stages:
            for name, p in stage.named_parameters(prefix, recurse, remove_duplicate=False):
                if not (remove_duplicate and id(p) in seen):
                    seen.add(id(p))
                    yield name, p

    def parameters(self, recurse: bool = True):
        return (p for _, p in self.named_parameters(recurse=recurse))

    def state_dict(self, *args, **kwargs):
        """This rank's slice of the model's state dict, under the model's own names."""
        out = {}
        for stage in self.stages:
            out.update(stage.state_dict(*args, **kwargs))
        return out

    def load_state_dict(self, state_dict, strict: bool = False, assign: bool = False):
        """Load this rank's slice from a full (or partial) state dict of the model."""
        for stage in self.stages:
            mine = {k: v for k, v in state_dict.items() if k in stage.state_dict()}
            stage.load_state_dict(mine, strict=strict, assign=assign)
    def train(self, mode: bool = True):
        self.model.train(mode)
        self.training = mode
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        for stage in self.stages:
            stage.zero_grad(set_to_none)

    def __repr__(self) -> str:
        return (f"DistributedPipeline(rank {self.rank}: stages {self.stage_indices} of {self.n_stages}, "
                f"replica {self.replica} of {self.data_parallel}, chunks={self.chunks}, checkpoint={self.checkpoint!r})")

    def _require_built(self):
        if self._built is None:
            raise RuntimeError("the pipeline compiles on its first step: call pipe.step(...) once, "
                               "or pass example_inputs to autopipe.compile")

    def close(self) -> None:
        if self._built is not None:
            self._built["transport"].close()

    # -- building -----------------------------------------------------------------
    def build(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        import torch.utils._pytree as pytree
        _refuse_cuda((f"input {i}", t) for i, t in enumerate(pytree.tree_leaves((args, kwargs))))
        if len(self.options.devices) != self.n_stages:
            raise ValueError(f"the options plan {len(self.options.devices)} stages for {self.n_stages} ranks")
        compiled = self._run_passes(self.model, args, kwargs, self.options, before_codegen=self._materialize)
        if len(compiled.programs) > 1:
            raise NotImplementedError("this model specialises on the batch size and the batch does not divide into "
                                      "equal micro-batches; under torchrun use a batch divisible by chunks")
        program = compiled.main
        stages = {s: program.stages[s] for s in self.stage_indices}
        transport = P2PTransport(WireSpec.from_plan(program.plan), stages, group=self.pipeline_groups[self.replica],
                                 timeout=self.timeout, name=f"autopipe/{next(_PIPELINE_IDS)}/{self.replica}")
        self._built = {"traced": program.traced, "plan": program.plan, "stages": list(stages.values()),
                       "runners": {s: StageRunner(stage) for s, stage in stages.items()}, "transport": transport,
                       "shared": self._shared_groups(program.plan)}

    def _materialize(self, plan) -> None:
        """A model built on meta: create and initialise only this rank's parameters and buffers.

        Tensors are swapped by identity in every module that holds them, so tied weights stay
        tied. Only the module of a tensor's first (canonical) name is reset, with a generator
        seeded by that name, so a tied weight initialises identically on every rank."""
        mine = [name for s in self.stage_indices for name in plan.stages[s].params]
        fresh: dict[int, torch.Tensor] = {}
        owners: list[str] = []
        for name in mine:
            t = _tensor(self.model, name)
            if t.device.type != "meta" or id(t) in fresh:
                continue
            new = torch.empty_like(t, device=self.device)
            fresh[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
            owners.append(name.rpartition(".")[0])
        if not fresh:
            return
        for module in self.model.modules():
            for table in (module._parameters, module._buffers):
                for attr, t in table.items():
                    if t is not None and id(t) in fresh:
                        table[attr] = fresh[id(t)]
        unset = []
        for owner_name in dict.fromkeys(owners):
            owner = self.model.get_submodule(owner_name)
            if not hasattr(owner, "reset_parameters"):
                unset.append(owner_name)
                continue
            seed = int.from_bytes(hashlib.blake2b(f"{self.materialize_seed}:{owner_name}".encode(),
                                                  digest_size=8).digest(), "little") & ((1 << 63) - 1)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                owner.reset_parameters()
        if unset:
            warnings.warn(f"rank {self.rank}: modules {unset[:5]}{'...' if len(unset) > 5 else ''} were on the meta device "
                          f"and have no reset_parameters(): their tensors hold uninitialised memory until you call "
                          f"pipe.load_state_dict(...)", stacklevel=3)

    def _shared_groups(self, plan) -> list[tuple[str, Any]]:
        """Process groups of the ranks (of one replica) that hold the same tied parameter."""
        groups = []
        for p in range(self.data_parallel):
            for name, stages in sorted(plan.shared_params.items()):
                ranks = sorted({p * self.n_ranks + s % self.n_ranks for s in stages})
                if len(ranks) < 2:
                    continue  # the stages that share it are all on one rank: summed there
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    groups.append((name, group))
        return groups

    # -- running --------------------------------------------------------------------
    def step(self, *args, target: Any = None, loss_fn: Callable | None = None, **kwargs):
        """Forward and backward of all micro-batches in schedule order on every rank.

        Call it with the same arguments on every rank (each stage reads only the inputs its
        nodes use). Returns the mini-batch loss on the last stage's ranks, None elsewhere."""
        if self._built is None:
            self.build(args, kwargs)
        built = self._built
        traced, transport, runners = built["traced"], built["transport"], built["runners"]
        flat = traced.flat_inputs(args, kwargs)
        sizes = microbatch.micro_batch_sizes(flat[0].shape[0], self.chunks)
        rows = microbatch.split(flat, traced.input_names, sizes)
        local = [dict(zip(traced.input_names, row)) for row in rows]
        schedule = self._schedules.get(len(sizes))
        if schedule is None:
            schedule = self._schedules[len(sizes)] = Schedule.build(self.schedule_name, self.n_ranks, len(sizes),
                                                                    self.virtual_stages)
        state = StepState.start(training=True, random=self.model.training, checkpoint=self.checkpoint,
                                schedule=schedule, deferred_model=self.model if self.deferred_batch_norm else None,
                                track_memory=False)
        loss = None
        if self.n_stages - 1 in runners:
            loss = Loss(fn=loss_fn or model_loss, rebuild=traced.rebuild_output,
                        targets=microbatch.split_target(target, sizes), weights=[s / sum(sizes) for s in sizes],
                        last_stage=self.n_stages - 1)

        def run():
            for runner in runners.values():
                runner.start_step()
            order = schedule.device_order(self.stage_index)
            transport.start_step(local, sizes, order)
            run_tasks(order, lambda task: runners[task.stage], transport, state, loss)
            transport.finish_step()

        transport.run(run)
        self.timeline = state.timeline  # this rank's tasks
        if state.deferred is not None:
            state.deferred.commit()
        with torch.no_grad():
            for runner in runners.values():  # in stage order: tied weights on one rank sum in a fixed order
                for p, g in zip(runner.params, runner.param_grads):
                    if g is not None:
                        p.grad = g if p.grad is None else p.grad.add_(g)
        self._reduce_gradients()
        return loss.total if loss is not None else None

    def _reduce_gradients(self) -> None:
        for name, group in self._built["shared"]:
            p = _tensor(self.model, name)  # by its canonical name; the stage may know it by another
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
        if self.data_parallel > 1:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            if grads:
                flat = torch._utils._flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=self.data_parallel_groups[self.stage_index])
                flat /= self.data_parallel
                for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    g.copy_(reduced)


def _tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    owner_name, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(owner_name) if owner_name else module, attr)
