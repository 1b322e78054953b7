"""Re-materialisation policy and per-task random streams.

GPipe keeps only stage-boundary activations and recomputes the rest in
backward (Huang et al., 2019, sec. 2.3). Recomputation must draw the same
dropout masks as the forward did. torch.utils.checkpoint replays the global
RNG state, which is not enough here: the default CPU generator is one per
process, and worker threads drawing from it interleave by timing (DESIGN.md,
pitfalls). So each (stage, micro-batch) task gets its own generator, seeded
from the step's seed, and a thread-local TorchFunctionMode routes the random
ops of that task to it. Forward and recompute then see identical masks, and a
seeded run is reproducible whatever the thread timing.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

CHECKPOINT_MODES = ("always", "except_last", "never")


def checkpoints(mode: str, micro_batch: int, chunks: int) -> bool:
    """Whether this micro-batch is recomputed in backward (torchgpipe's modes)."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {mode!r}")
    return mode == "always" or (mode == "except_last" and micro_batch < chunks - 1)


def task_seed(step_seed: int, stage: int, micro_batch: int) -> int:
    digest = hashlib.blake2b(f"{step_seed}:{stage}:{micro_batch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _mask(x: torch.Tensor, keep: float, generator: torch.Generator, shape=None) -> torch.Tensor:
    return torch.empty(shape if shape is not None else x.shape, dtype=x.dtype, device=x.device).bernoulli_(keep, generator=generator)


def _dropout(g, input, p=0.5, training=True, inplace=False):
    if not training or p == 0:
        return input
    if p == 1:
        return input.mul_(0) if inplace else input * 0
    mask = _mask(input, 1 - p, g).div_(1 - p)
    return input.mul_(mask) if inplace else input * mask


def _feature_dropout(batch_dims: int):
    """dropout1d/2d/3d: one mask value per channel."""
    def dropout(g, input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        unbatched = input.dim() == batch_dims + 1
        lead = input.shape[: 1 if unbatched else 2]
        shape = tuple(lead) + (1,) * (input.dim() - len(lead))
        mask = _mask(input, 1 - p, g, shape).div_(1 - p) if p < 1 else torch.zeros(shape, dtype=input.dtype, device=input.device)
        return input.mul_(mask) if inplace else input * mask
    return dropout


def _aten_dropout(g, input, p, train):
    return _dropout(g, input, p, bool(train))


def _aten_native_dropout(g, input, p, train):
    if not train:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    keep = _mask(input, 1 - p, g).bool()
    return input * keep * (1.0 / (1 - p) if p < 1 else 0.0), keep


def _attention(g, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """scaled_dot_product_attention with attention dropout drawn from the task's generator;
    the math reference of torch.nn.functional.scaled_dot_product_attention's documentation."""
    length, source = query.size(-2), key.size(-2)
    scale = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    scores = query @ key.transpose(-2, -1) * scale
    if is_causal:
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    weights = _dropout(g, torch.softmax(scores, dim=-1), dropout_p, True)
    return weights @ value


_ATTENTION = {F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}

_REPLACED: dict[Any, Callable] = {
    F.dropout: _dropout,
    F.dropout1d: _feature_dropout(1),
    F.dropout2d: _feature_dropout(2),
    F.dropout3d: _feature_dropout(3),
    torch.dropout: lambda g, input, p, train: _dropout(g, input, p, train),
    torch.ops.aten.dropout.default: _aten_dropout,
    torch.ops.aten.native_dropout.default: _aten_native_dropout,
}

_TAKES_GENERATOR = {
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli, torch.multinomial,
    torch.normal, torch.poisson,
    torch.Tensor.bernoulli, torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_,
    torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.cauchy_,
    torch.Tensor.log_normal_, torch.Tensor.multinomial,
}


class TaskRandomness(TorchFunctionMode):
    """Routes the random ops run on this thread to one generator (see module docstring)."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.generator = generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ATTENTION:
            dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            return _attention(self.generator, *args, **kwargs) if dropout_p > 0 else func(*args, **kwargs)
        replacement = _REPLACED.get(func)
        if replacement is not None:
            return replacement(self.generator, *args, **kwargs)
        if func in _TAKES_GENERATOR and kwargs.get("generator") is None:
            kwargs = {**kwargs, "generator": self.generator}
        return func(*args, **kwargs)


def generator_for(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device)
