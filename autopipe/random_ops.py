"""Which graph operations draw random numbers.

Shared by the partitioner (a random op is never replicated into several
stages: each copy would draw its own numbers) and the runtime (a stage that
holds one gets its task's own generator, autopipe/runtime/checkpoint.py), so
the two cannot disagree. Passes import this module, never the runtime.
"""
from __future__ import annotations

from typing import Any

import torch

RANDOM_OPS = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "native_dropout", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
    "bernoulli", "multinomial", "normal", "poisson", "rrelu", "uniform", "random", "exponential",
    "geometric", "cauchy", "log_normal",
    "scaled_dot_product_attention",  # its dropout_p
})


def op_name(target: Any) -> str:
    """``torch.ops.aten.dropout.default`` -> "dropout"; ``F.dropout`` -> "dropout"; "bernoulli_" stays."""
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0] if "." in name else name


def is_random_target(target: Any) -> bool:
    """A call_function / call_method target that may draw random numbers."""
    name = op_name(target)
    return name.rstrip("_") in RANDOM_OPS or "dropout" in name


def is_random_module(module: torch.nn.Module) -> bool:
    """A module that may draw random numbers; a module fx kept whole whose code we cannot see counts."""
    return any(isinstance(m, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU, torch.nn.MultiheadAttention))
               or not type(m).__module__.startswith("torch.nn") for m in module.modules())
