"""Deferred BatchNorm: running statistics over the whole mini-batch, as the plain model's.

Micro-batches change BatchNorm: each normalises with its own statistics (that
is inherent to GPipe, sec. 2.2) and, by default, updates the running
statistics once per micro-batch. torchgpipe's DeferredBatchNorm
(torchgpipe/batchnorm.py) instead accumulates per-channel sums over the
micro-batches and updates the running statistics once, from the whole
mini-batch, so they equal the plain model's. torchgpipe swaps the user's
modules for its own class; here a thread-local TorchFunctionMode intercepts
``F.batch_norm`` (fx route) and ``aten.batch_norm`` (export route) instead, so
the user's model stays as it is.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class _Stats:
    __slots__ = ("sum", "sum_squares", "count", "momentum", "batches_tracked")

    def __init__(self):
        self.sum = self.sum_squares = None
        self.count = 0
        self.momentum = None
        self.batches_tracked = None


class DeferredStatistics:
    """Per-step accumulator shared by the stages' workers; committed once after the forward phase."""

    def __init__(self, model: torch.nn.Module):
        self.modules = {id(m.running_mean): m for m in model.modules()
                        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None}
        self.stats: dict[int, _Stats] = {}
        self.lock = threading.Lock()

    def accumulate(self, running_mean: torch.Tensor, x: torch.Tensor, momentum: float | None) -> None:
        dims = [0] + list(range(2, x.dim()))
        with torch.no_grad():
            xf = x.detach().float()
            total = xf.sum(dim=dims)
            squares = (xf * xf).sum(dim=dims)
        count = x.numel() // x.shape[1]
        with self.lock:
            stats = self.stats.setdefault(id(running_mean), _Stats())
            if stats.sum is None:
                module = self.modules.get(id(running_mean))
                stats.momentum = momentum
                if module is not None and module.num_batches_tracked is not None:
                    stats.batches_tracked = module.num_batches_tracked.clone()  # already counted this step once
                stats.sum, stats.sum_squares = total, squares
            else:
                stats.sum, stats.sum_squares = stats.sum + total, stats.sum_squares + squares
            stats.count += count

    def commit(self) -> None:
        """running = (1 - momentum) * running + momentum * statistic of the whole mini-batch."""
        with torch.no_grad():
            for key, stats in self.stats.items():
                module = self.modules.get(key)
                if module is None or stats.count < 2:
                    continue
                mean = stats.sum / stats.count
                var = (stats.sum_squares / stats.count - mean * mean) * (stats.count / (stats.count - 1))
                m = stats.momentum if stats.momentum is not None else 0.1
                module.running_mean.mul_(1 - m).add_(mean.to(module.running_mean.dtype), alpha=m)
                module.running_var.mul_(1 - m).add_(var.to(module.running_var.dtype), alpha=m)
                if stats.batches_tracked is not None:
                    module.num_batches_tracked.copy_(stats.batches_tracked)
        self.stats.clear()


class DeferredBatchNorm(TorchFunctionMode):
    """Normalise with the micro-batch's statistics, leave running statistics to :class:`DeferredStatistics`."""

    def __init__(self, statistics: DeferredStatistics, accumulate: bool = True):
        super().__init__()
        self.statistics = statistics
        self.accumulate = accumulate  # False while re-materialising: the forward already counted

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.batch_norm:
            names = ["input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"]
            bound = dict(zip(names, args), **kwargs)
            if bound.get("training") and bound.get("running_mean") is not None:
                if self.accumulate:
                    self.statistics.accumulate(bound["running_mean"], bound["input"], bound.get("momentum", 0.1))
                bound["running_mean"] = bound["running_var"] = None
                return func(**bound)
        elif func is torch.ops.aten.batch_norm.default:
            x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn = args
            if training and running_mean is not None:
                if self.accumulate:
                    self.statistics.accumulate(running_mean, x, momentum)
                return func(x, weight, bias, None, None, training, momentum, eps, cudnn)
        return func(*args, **kwargs)
