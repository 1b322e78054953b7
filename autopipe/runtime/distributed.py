"""The pipeline over torch.distributed: one stage per rank, under torchrun.

Every rank traces and plans the same model with the same inputs, so every
rank holds the same Plan (checked once by the transport with a hash of the
PipeSpec); shapes come from the plan, so a step exchanges payload only. The
transport is autopipe.runtime.p2p (point-to-point sends of each cross-cut
tensor straight to the rank that reads it; see notes/distributed.md for why
not torch.distributed.pipelining: it neither sums gradients of tied weights
across stages nor supports a tensor read by two later stages).

Pipeline x data parallel: with world = K x D ranks, replica p holds ranks
p*K .. p*K+K-1; stage s's gradients are averaged over its D replicas, and a
parameter shared by two stages (tied embeddings) has its gradient summed over
the ranks of one replica that hold it first (Megatron-LM's embedding group).
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import warnings
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .batchnorm import DeferredBatchNorm, DeferredStatistics
from .checkpoint import TaskRandomness, checkpoints, generator_for, task_seed
from .p2p import Edge, P2PGPipe, PipelineError, PipeSpec
from .pipeline import _running_buffers, _uses_rng

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


def _pass_through(name: str) -> str:
    return f"{name}__to_loss"


class _StageRunner:
    """What the transport calls per micro-batch: the stage with checkpointing, the task's own
    random stream (the same seeds as in-process), deferred BatchNorm, Python values as tensors."""

    def __init__(self, pipe: "DistributedPipeline", stage, spec_inputs, spec_outputs, sizes_out: dict):
        self.pipe = pipe
        self.stage = stage
        self.inputs = spec_inputs           # names the transport passes, in order
        self.outputs = spec_outputs         # names it expects back, in order
        self.python_values = sizes_out      # name -> "int" | "size": values sent as int64 tensors
        self.micro_batch = 0
        self.calls: dict[int, int] = {}
        self.generator = generator_for(stage.device)
        self.running = _running_buffers(stage)

    def start_step(self) -> None:
        self.micro_batch = 0
        self.calls.clear()

    def __call__(self, *args):
        i = self.micro_batch
        self.micro_batch += 1
        named = dict(zip(self.inputs, args))
        stage_args = [self._from_wire(n, named[n]) for n in self.stage.input_names]
        pipe = self.pipe
        if pipe.training and checkpoints(pipe.checkpoint, i, pipe.chunks):
            import torch.utils.checkpoint as cp
            outputs = cp.checkpoint(self._run, i, *stage_args, use_reentrant=False, preserve_rng_state=False)
        else:
            outputs = self._run(i, *stage_args)
        produced = dict(zip(self.stage.output_names, outputs))
        result = []
        for name in self.outputs:
            if name in produced:
                result.append(self._to_wire(name, produced[name]))
            else:  # an earlier stage's model output passing through to the loss
                result.append(named[name.removesuffix("__to_loss")])
        return tuple(result)

    def _run(self, i: int, *stage_args):
        first = self.calls.get(i, 0) == 0
        self.calls[i] = self.calls.get(i, 0) + 1
        pipe = self.pipe
        snapshot = [] if first else [(b, b.clone()) for b in self.running]  # recompute: stats move once
        with contextlib.ExitStack() as modes:
            if pipe.model.training and pipe.uses_rng:
                self.generator.manual_seed(task_seed(pipe.step_seed, pipe.stage_index, i))
                modes.enter_context(TaskRandomness(self.generator))
            if pipe.deferred is not None and self.running:
                modes.enter_context(DeferredBatchNorm(pipe.deferred, accumulate=first))
            outputs = self.stage(*stage_args)
        with torch.no_grad():
            for buffer, before in snapshot:
                buffer.copy_(before)
        return outputs

    def _to_wire(self, name, value):
        kind = self.python_values.get(name)
        if kind is None:
            return value
        return torch.tensor(value if kind == "int" else list(value), dtype=torch.int64)

    def _from_wire(self, name, value):
        kind = self.python_values.get(name)
        if kind is None:
            return value
        return int(value.item()) if kind == "int" else torch.Size(value.tolist())


class DistributedPipeline(torch.nn.Module):
    """This rank's stage of a pipeline compiled under torchrun. ``pipe.step(...)`` runs a step."""

    def __init__(self, model: torch.nn.Module, chunks: int, checkpoint: str,
                 plan_fn: Callable[[Sequence[Any], dict[str, Any], list[torch.device]], Any],
                 codegen_fn: Callable, data_parallel: int = 1, timeout: float = 300.0,
                 deferred_batch_norm: bool = False, materialize_seed: int = 0):
        super().__init__()
        object.__setattr__(self, "model", model)
        _refuse_cuda((f"model tensor {n!r}", p) for n, p in itertools.chain(model.named_parameters(), model.named_buffers()))
        if not dist.is_initialized():
            dist.init_process_group(backend="gloo", timeout=timedelta(seconds=max(timeout, 60)))
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        if data_parallel < 1 or self.world % data_parallel:
            raise ValueError(f"data_parallel={data_parallel} must divide the world size {self.world}")
        self.n_stages = self.world // data_parallel
        self.data_parallel = data_parallel
        self.replica, self.stage_index = divmod(self.rank, self.n_stages)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.timeout = timeout
        self.deferred_batch_norm = deferred_batch_norm
        self.materialize_seed = materialize_seed
        self._plan_fn = plan_fn
        self._codegen_fn = codegen_fn
        self.device = torch.device("cpu")
        self._built = None
        self.step_seed = 0
        self.deferred = None
        # Every rank creates every group, in the same order (torch.distributed requires it).
        self.pipeline_groups = [dist.new_group(list(range(p * self.n_stages, (p + 1) * self.n_stages)))
                                for p in range(data_parallel)]
        self.data_parallel_groups = [dist.new_group(list(range(s, self.world, self.n_stages)))
                                     for s in range(self.n_stages)]

    # -- what a user looks at ---------------------------------------------------
    @property
    def plan(self):
        self._require_built()
        return self._built["plan"]

    @property
    def stage(self):
        self._require_built()
        return self._built["stage"]

    @property
    def stages(self):
        return [self.stage]

    def parameters(self, recurse: bool = True):
        self._require_built()
        return self.stage.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        self._require_built()
        return self.stage.named_parameters(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        """This rank's slice of the model's state dict, under the model's own names."""
        self._require_built()
        return self.stage.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = False, assign: bool = False):
        """Load this rank's slice from a full (or partial) state dict of the model."""
        self._require_built()
        mine = {k: v for k, v in state_dict.items() if k in self.stage.state_dict()}
        return self.stage.load_state_dict(mine, strict=strict, assign=assign)

    def train(self, mode: bool = True):
        self.model.train(mode)
        self.training = mode
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._require_built()
        self.stage.zero_grad(set_to_none)

    def __repr__(self) -> str:
        return (f"DistributedPipeline(rank {self.rank}: stage {self.stage_index} of {self.n_stages}, "
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
        devices = [self.device] * self.n_stages
        traced, plan = self._plan_fn(args, kwargs, devices)
        self._materialize(plan)
        stages = self._codegen_fn(traced.graph_module, plan)
        stage = stages[self.stage_index]
        spec, python_values = self._spec(traced, plan)
        runner = _StageRunner(self, stage, spec.stage_inputs[self.stage_index],
                              spec.stage_outputs[self.stage_index], python_values)
        transport = P2PGPipe(runner, spec, group=self.pipeline_groups[self.replica], timeout=self.timeout,
                             name=f"autopipe/{next(_PIPELINE_IDS)}/{self.replica}")
        shared_groups = self._shared_groups(plan)
        self.uses_rng = _uses_rng(stage)
        self._built = {"traced": traced, "plan": plan, "stage": stage, "spec": spec, "runner": runner,
                       "transport": transport, "shared": shared_groups}

    def _spec(self, traced, plan) -> tuple[PipeSpec, dict[str, str]]:
        K = self.n_stages
        batch = traced.batch_size
        edges, python_values = [], {}
        inputs = [list(s.inputs) for s in plan.stages]
        outputs = [[n for n in s.outputs if plan.tensors[n].consumers] for s in plan.stages]
        finals = []
        for name in plan.graph_outputs:
            info = plan.tensors[name]
            if info.producer == K - 1:
                finals.append(name)
                if name not in outputs[K - 1]:
                    outputs[K - 1].append(name)
            else:  # sent to the last rank, which hands it to the loss
                finals.append(_pass_through(name))
        for name, info in plan.tensors.items():
            if info.producer < 0:
                continue
            dsts = set(info.consumers) - {info.producer}
            if info.is_output and info.producer != K - 1:
                dsts.add(K - 1)
            if not dsts:
                continue
            shape, dtype, batch_dim, kind = self._wire_format(traced, name, info, batch)
            if kind:
                python_values[name] = kind
            edges.append(Edge(name, src=info.producer, dsts=tuple(sorted(dsts)), shape=shape, dtype=dtype,
                              batch_dim=batch_dim, requires_grad=(dtype.is_floating_point and not kind)))
            for d in dsts:
                if name not in inputs[d]:
                    inputs[d].append(name)
            if name not in outputs[info.producer]:
                outputs[info.producer].append(name)
        for name in finals:
            if name.endswith("__to_loss"):
                outputs[K - 1].append(name)
        # the last stage returns: its edges (none go further), then the finals in model-output order
        outputs[K - 1] = [n for n in outputs[K - 1] if n not in finals] + finals
        spec = PipeSpec(edges=edges, stage_inputs=inputs, stage_outputs=outputs, batch_size=batch,
                        chunks=min(self.chunks, batch))
        return spec, python_values

    @staticmethod
    def _wire_format(traced, name, info, batch):
        node = next(n for n in traced.graph_module.graph.nodes if n.name == name)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = tuple(int(d) for d in val.shape)
            return shape, val.dtype, 0 if shape and shape[0] == batch else None, None
        if isinstance(val, (int, torch.SymInt)):
            return (), torch.int64, None, "int"
        if isinstance(val, (tuple, list, torch.Size)) and all(isinstance(v, (int, torch.SymInt)) for v in val):
            return (len(val),), torch.int64, None, "size"
        raise TypeError(f"{name!r} crosses a cut on rank boundaries but is a {type(val).__name__}; "
                        f"only tensors, ints and sizes can travel between ranks")

    def _materialize(self, plan) -> None:
        """A model built on meta: create and initialise only this rank's parameters and buffers.

        Tensors are swapped by identity in every module that holds them, so tied weights stay
        tied. Only the module of a tensor's first (canonical) name is reset, with a generator
        seeded by that name, so a tied weight initialises identically on every rank."""
        mine = plan.stages[self.stage_index].params
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
                ranks = [p * self.n_stages + s for s in stages]
                group = dist.new_group(ranks)
                if self.replica == p and self.stage_index in stages:
                    groups.append((name, group))
        return groups

    # -- running --------------------------------------------------------------------
    def step(self, *args, target: Any = None, loss_fn: Callable | None = None, **kwargs):
        """Forward and backward of all micro-batches in GPipe order on every rank.

        Call it with the same arguments on every rank (each stage reads only the inputs its
        nodes use). Returns the mini-batch loss on the last stage's ranks, None elsewhere."""
        if self._built is None:
            self.build(args, kwargs)
        built = self._built
        traced, transport, runner = built["traced"], built["transport"], built["runner"]
        flat = traced.flat_inputs(args, kwargs)
        named = dict(zip(traced.input_names, flat))
        spec = built["spec"]
        local = {n: named[n] for n in spec.locals(self.stage_index)}
        self.step_seed = int(torch.randint(0, 2**62, ()).item()) if self.model.training else 0
        self.deferred = DeferredStatistics(self.model) if self.deferred_batch_norm and self.model.training else None
        runner.start_step()
        is_last = self.stage_index == self.n_stages - 1
        wire_loss = None
        if is_last:
            wire_loss = self._loss(traced, spec, loss_fn)
            if target is None:
                target = torch.zeros(traced.batch_size)  # the model computes its own loss
        loss = transport.step(local, target=target if is_last else None, loss_fn=wire_loss)
        if self.deferred is not None:
            self.deferred.commit()
        self._reduce_gradients()
        return loss if is_last else None

    def _loss(self, traced, spec, loss_fn):
        n_finals = len(spec.finals())

        def loss(*values):
            finals, target = values[:n_finals], values[n_finals:]
            output = traced.rebuild_output(list(finals))
            if loss_fn is not None:
                return loss_fn(output, target[0] if len(target) == 1 else target)
            value = getattr(output, "loss", None)
            if value is None and isinstance(output, dict):
                value = output.get("loss")
            if value is None:
                value = output if isinstance(output, torch.Tensor) else None
            if not isinstance(value, torch.Tensor) or value.dim() != 0:
                raise TypeError("pipe.step needs a scalar loss: pass loss_fn=..., or return a loss from the model")
            return value
        return loss

    def _reduce_gradients(self) -> None:
        stage = self._built["stage"]
        for name, group in self._built["shared"]:
            p = _tensor(self.model, name)  # by its canonical name; the stage may know it by another
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
        if self.data_parallel > 1:
            grads = [p.grad for p in stage.parameters() if p.grad is not None]
            if grads:
                flat = torch._utils._flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=self.data_parallel_groups[self.stage_index])
                flat /= self.data_parallel
                for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    g.copy_(reduced)


def _tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    owner_name, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(owner_name) if owner_name else module, attr)
