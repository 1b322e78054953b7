"""Deferred BatchNorm: running statistics from the whole mini-batch, as the plain model's.

torchgpipe's DeferredBatchNorm (torchgpipe/batchnorm.py), without swapping the user's modules: a thread-local
TorchFunctionMode intercepts ``F.batch_norm`` (fx route) and ``aten.batch_norm`` (export route); see
docs/architecture.md, "Runtime"."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_F_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


@dataclass
class _Stats:
    sum: torch.Tensor | int
    squares: torch.Tensor | int
    count: int
    momentum: float | None
    batches_tracked: torch.Tensor | None  # as after the first micro-batch: the step counts once


class DeferredStatistics:
    """Per-step per-channel sums shared by the stages' workers; committed once after the forward phase."""

    def __init__(self, model: torch.nn.Module):
        self.modules = {id(m.running_mean): m
                        for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                        and m.running_mean is not None}
        self.stats: dict[int, _Stats] = {}
        self.lock = threading.Lock()

    def accumulate(self, running_mean: torch.Tensor, x: torch.Tensor, momentum: float | None) -> None:
        dims = [0] + list(range(2, x.dim()))
        xf = x.detach().float()  # detached: nothing here records a graph
        total, squares = xf.sum(dim=dims), (xf * xf).sum(dim=dims)
        count = x.numel() // x.shape[1]
        with self.lock:
            if id(running_mean) not in self.stats:
                tracked = getattr(self.modules.get(id(running_mean)), "num_batches_tracked", None)
                self.stats[id(running_mean)] = _Stats(0, 0, 0, momentum, None if tracked is None else tracked.clone())
            stats = self.stats[id(running_mean)]
            stats.sum, stats.squares, stats.count = stats.sum + total, stats.squares + squares, stats.count + count

    def commit(self) -> None:
        """running = (1 - momentum) * running + momentum * statistic of the whole mini-batch."""
        with torch.no_grad():
            for key, stats in self.stats.items():
                module = self.modules.get(key)
                if module is None or stats.count < 2:
                    continue
                mean = stats.sum / stats.count
                var = (stats.squares / stats.count - mean * mean) * (stats.count / (stats.count - 1))
                m = 0.1 if stats.momentum is None else stats.momentum
                module.running_mean.mul_(1 - m).add_(mean.to(module.running_mean.dtype), alpha=m)
                module.running_var.mul_(1 - m).add_(var.to(module.running_var.dtype), alpha=m)
                if stats.batches_tracked is not None:
                    module.num_batches_tracked.copy_(stats.batches_tracked)
        self.stats.clear()


class DeferredBatchNorm(TorchFunctionMode):
    """Normalise with the micro-batch's statistics, leave running statistics to :class:`DeferredStatistics`."""

    def __init__(self, statistics: DeferredStatistics, accumulate: bool = True):
        super().__init__()
        # accumulate=False while re-materialising: the forward already counted
        self._count = statistics.accumulate if accumulate else lambda running_mean, x, momentum: None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            bound = {"training": False, "momentum": 0.1, **dict(zip(_F_ARGS, args)), **kwargs}
            if bound["training"] and bound.get("running_mean") is not None:
                self._count(bound["running_mean"], bound["input"], bound["momentum"])
                return func(**{**bound, "running_mean": None, "running_var": None})
        elif func is torch.ops.aten.batch_norm.default and args[5] and args[3] is not None:
            # (input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
            self._count(args[3], args[0], args[6])
            return func(*args[:3], None, None, *args[5:])
        return func(*args, **kwargs)
