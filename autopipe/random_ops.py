"""Which graph operations draw random numbers, and versions of them that draw from a given generator.

Shared by the partitioner (a random op is never replicated into several
stages: each copy would draw its own numbers) and codegen (passes/codegen.py),
which emits every random op of a stage so that it draws from the stage's
``generator`` argument. Re-materialisation must draw the same masks as the
forward did, and the default generator is one per process, shared by every
worker thread (docs/architecture.md, pitfalls); a generator per (stage, micro-batch)
task, passed in as an argument, makes each task's stream its own and costs
nothing per op. Passes import this module, never the runtime.

The functions below take ``generator=`` where torch's own take none. Each
follows torch's implementation step by step, drawing through the same
generator-taking kernels, so it draws exactly what torch draws from a
generator in the same state (the dropouts: aten/src/ATen/native/Dropout.cpp;
the ``*_like`` factories: aten/src/ATen/native/TensorFactories.cpp).

Code that codegen cannot see into (a user's leaf module, a torch function
whose Python draws internally) runs under ``call_with_generator``: two
thread-local modes route its random kernels to the generator, at the cost of
a Python call per op inside that code only.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class UnroutedRandomOp(ValueError):
    """A random op of a stage that codegen cannot route to the stage's generator."""


RANDOM_OPS = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "native_dropout", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
    "bernoulli", "multinomial", "normal", "poisson", "rrelu", "uniform", "random", "exponential",
    "geometric", "cauchy", "log_normal", "gumbel_softmax", "fractional_max_pool2d", "fractional_max_pool3d",
    "fractional_max_pool2d_with_indices", "fractional_max_pool3d_with_indices",
    "scaled_dot_product_attention",  # its dropout_p
})


def op_name(target: Any) -> str:
    """``torch.ops.aten.dropout.default`` -> "dropout"; ``F.dropout`` -> "dropout"; "bernoulli_" stays."""
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0] if "." in name else name


def is_random_target(target: Any) -> bool:
    """A call_function / call_method target that may draw random numbers. An aten op says so itself
    (its ``nondeterministic_seeded`` tag; aten.fractional_max_pool2d, given its samples, does not)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(is_random_target(getattr(target, o)) for o in target.overloads())
    name = op_name(target)
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags or target in FUNCTIONS or "dropout" in name
    return name.strip("_") in RANDOM_OPS or "dropout" in name


def is_random_module(module: torch.nn.Module) -> bool:
    """A module that may draw random numbers; a module fx kept whole whose code we cannot see counts."""
    return any(isinstance(m, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU, torch.nn.MultiheadAttention,
                              torch.nn.RNNBase, torch.nn.FractionalMaxPool2d, torch.nn.FractionalMaxPool3d))
               or not type(m).__module__.startswith("torch.nn") for m in module.modules())


def module_draws(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` now draws random numbers: ``is_random_module`` with its current
    train/eval mode and probabilities taken into account (code we cannot see always may)."""
    for m in module.modules():
        if not type(m).__module__.startswith("torch.nn"):
            return True
        if isinstance(m, (torch.nn.FractionalMaxPool2d, torch.nn.FractionalMaxPool3d)) and m._random_samples is None:
            return True  # draws its pooling regions in eval too
        if not m.training:
            continue
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if isinstance(m, torch.nn.RReLU):
            return True
        if isinstance(m, torch.nn.MultiheadAttention) and m.dropout > 0:
            return True
        if isinstance(m, torch.nn.RNNBase) and m.dropout > 0 and m.num_layers > 1:
            return True
    return False


# -- dropout: aten/src/ATen/native/Dropout.cpp, drawing from a generator -----------

_ALPHA = 1.7580993408473766  # SELU saturates at -_ALPHA for very negative inputs (Dropout.cpp, alpha_dropout)


def _dropout_impl(input, p, train, inplace, generator, *, feature: bool, alpha: bool):
    """``_dropout_impl<feature_dropout, alpha_dropout, inplace>`` of Dropout.cpp, noise from ``generator``."""
    if p < 0 or p > 1:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 0 or not train or input.numel() == 0:
        return input
    if p == 1:
        zero = torch.zeros((), dtype=input.dtype, device=input.device)
        return input.mul_(zero) if inplace else input.mul(zero)
    if feature:  # make_feature_noise: one draw per (sample, channel)
        if input.dim() < 2:
            raise RuntimeError("Feature dropout requires at least 2 dimensions in the input")
        noise = input.new_empty((input.shape[0], input.shape[1]) + (1,) * (input.dim() - 2))
    else:
        noise = torch.empty_like(input)
    noise.bernoulli_(1 - p, generator=generator)
    if alpha:
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
        b = noise.add(-1).mul_(_ALPHA * a).add_(_ALPHA * a * p)
        noise.mul_(a)
        return (input.mul_(noise) if inplace else input.mul(noise)).add_(b)
    noise.div_(1 - p)
    return input.mul_(noise) if inplace else input.mul(noise)


def dropout(input, p=0.5, training=True, inplace=False, *, generator=None):
    """``F.dropout`` (and ``torch.dropout``, ``aten.dropout``) drawing its mask from ``generator``."""
    return _dropout_impl(input, p, training, inplace, generator, feature=False, alpha=False)


def feature_dropout(input, p=0.5, training=True, inplace=False, *, generator=None):
    """``torch.feature_dropout``: one mask value per (sample, channel), from ``generator``."""
    return _dropout_impl(input, p, training, inplace, generator, feature=True, alpha=False)


def alpha_dropout(input, p=0.5, training=False, inplace=False, *, generator=None):
    """``F.alpha_dropout`` drawing from ``generator``."""
    return _dropout_impl(input, p, training, inplace, generator, feature=False, alpha=True)


def feature_alpha_dropout(input, p=0.5, training=False, inplace=False, *, generator=None):
    """``F.feature_alpha_dropout`` drawing from ``generator``."""
    return _dropout_impl(input, p, training, inplace, generator, feature=True, alpha=True)


def _channel_dropout(input, p, training, inplace, generator, batched_dim: int | None):
    """F.dropout1d / dropout3d: an unbatched input gets a batch dimension of one (torch/nn/functional.py)."""
    unbatched = batched_dim is not None and input.dim() != batched_dim
    if unbatched:
        input = input.unsqueeze_(0) if inplace else input.unsqueeze(0)
    result = feature_dropout(input, p, training, inplace, generator=generator)
    if unbatched:
        result = result.squeeze_(0) if inplace else result.squeeze(0)
    return result


def dropout1d(input, p=0.5, training=True, inplace=False, *, generator=None):
    """``F.dropout1d`` drawing from ``generator``."""
    return _channel_dropout(input, p, training, inplace, generator, batched_dim=3)


def dropout2d(input, p=0.5, training=True, inplace=False, *, generator=None):
    """``F.dropout2d`` drawing from ``generator`` (like torch, a 3-D input is taken as batched)."""
    return _channel_dropout(input, p, training, inplace, generator, batched_dim=None)


def dropout3d(input, p=0.5, training=True, inplace=False, *, generator=None):
    """``F.dropout3d`` drawing from ``generator``."""
    return _channel_dropout(input, p, training, inplace, generator, batched_dim=5)


def native_dropout(input, p, train=True, *, generator=None):
    """``aten.native_dropout`` (output, keep-mask) drawing from ``generator`` (native_dropout_cpu)."""
    if train is not None and not train:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    keep = torch.empty_like(input, dtype=torch.bool).bernoulli_(1 - p, generator=generator)
    scale = 0.0 if p == 1 else 1.0 / (1 - p)
    return input.mul(keep).mul_(scale), keep


def rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False, *, generator=None):
    """``F.rrelu`` drawing its slopes from ``generator`` (aten.rrelu takes one natively)."""
    op = torch.rrelu_ if inplace else torch.rrelu
    return op(input, lower, upper, training, generator=generator)


# -- *_like factories: TensorFactories.cpp, drawing from a generator ---------------

def _empty_like(input, dtype, layout, device, pin_memory, memory_format):
    return torch.empty_like(input, dtype=dtype, layout=layout, device=device, pin_memory=bool(pin_memory),
                            memory_format=torch.preserve_format if memory_format is None else memory_format)


def rand_like(input, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None,
              requires_grad=False, memory_format=None):
    """``torch.rand_like`` drawing from ``generator``."""
    out = _empty_like(input, dtype, layout, device, pin_memory, memory_format).uniform_(0, 1, generator=generator)
    return out.requires_grad_(requires_grad)


def randn_like(input, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None,
               requires_grad=False, memory_format=None):
    """``torch.randn_like`` drawing from ``generator``."""
    out = _empty_like(input, dtype, layout, device, pin_memory, memory_format).normal_(0, 1, generator=generator)
    return out.requires_grad_(requires_grad)


def randint_like(input, low=0, high=None, *, generator=None, dtype=None, layout=None, device=None,
                 pin_memory=None, requires_grad=False, memory_format=None):
    """``torch.randint_like(input, high)`` / ``(input, low, high)`` drawing from ``generator``."""
    if high is None:
        low, high = 0, low
    if isinstance(high, torch.Tensor):  # aten.randint_like.Tensor
        high = int(high.item())
    out = _empty_like(input, dtype, layout, device, pin_memory, memory_format).random_(low, high, generator=generator)
    return out.requires_grad_(requires_grad)


# -- attention ------------------------------------------------------------------------

def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, generator=None):
    """``F.scaled_dot_product_attention`` with its attention dropout drawn from ``generator``: the
    math reference of that function's documentation (torch's fused kernels draw from the default
    generator only), with aten's ``_safe_softmax`` so fully masked rows give 0 as torch's do."""
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
    weights = aten._safe_softmax(scores, -1) if hasattr(aten, "_safe_softmax") else torch.softmax(scores, -1)
    return dropout(weights, dropout_p, True, generator=generator) @ value


# -- how each op gets the generator ---------------------------------------------------

# ops that take no generator -> the function above that replaces them (and keyword arguments it adds)
FUNCTIONS: dict[Any, tuple[Callable, dict[str, Any]]] = {
    F.dropout: (dropout, {}), F.dropout1d: (dropout1d, {}), F.dropout2d: (dropout2d, {}),
    F.dropout3d: (dropout3d, {}), F.alpha_dropout: (alpha_dropout, {}),
    F.feature_alpha_dropout: (feature_alpha_dropout, {}), F.rrelu: (rrelu, {}),
    F.scaled_dot_product_attention: (scaled_dot_product_attention, {}),
    torch.rand_like: (rand_like, {}), torch.randn_like: (randn_like, {}), torch.randint_like: (randint_like, {}),
    torch.dropout: (dropout, {}), torch.feature_dropout: (feature_dropout, {}),
    torch.alpha_dropout: (alpha_dropout, {}), torch.feature_alpha_dropout: (feature_alpha_dropout, {}),
    torch.dropout_: (dropout, {"inplace": True}), torch.feature_dropout_: (feature_dropout, {"inplace": True}),
    torch.alpha_dropout_: (alpha_dropout, {"inplace": True}),
    torch.feature_alpha_dropout_: (feature_alpha_dropout, {"inplace": True}),
    aten.dropout.default: (dropout, {}), aten.feature_dropout.default: (feature_dropout, {}),
    aten.alpha_dropout.default: (alpha_dropout, {}), aten.feature_alpha_dropout.default: (feature_alpha_dropout, {}),
    aten.dropout_.default: (dropout, {"inplace": True}),
    aten.feature_dropout_.default: (feature_dropout, {"inplace": True}),
    aten.alpha_dropout_.default: (alpha_dropout, {"inplace": True}),
    aten.feature_alpha_dropout_.default: (feature_alpha_dropout, {"inplace": True}),
    aten.native_dropout.default: (native_dropout, {}),
    aten.scaled_dot_product_attention.default: (scaled_dot_product_attention, {}),
    **{getattr(aten.rand_like, o): (rand_like, {}) for o in aten.rand_like.overloads() if "out" not in o},
    **{getattr(aten.randn_like, o): (randn_like, {}) for o in aten.randn_like.overloads() if "out" not in o},
    **{getattr(aten.randint_like, o): (randint_like, {}) for o in aten.randint_like.overloads() if "out" not in o},
}

# modules fx keeps whole -> (function, how to call it from the module): each module's own forward
MODULES: dict[type, tuple[Callable, Callable[[torch.nn.Module], dict[str, Any]]]] = {
    torch.nn.Dropout: (dropout, lambda m: dict(p=m.p, training=m.training, inplace=m.inplace)),
    torch.nn.Dropout1d: (dropout1d, lambda m: dict(p=m.p, training=m.training, inplace=m.inplace)),
    torch.nn.Dropout2d: (dropout2d, lambda m: dict(p=m.p, training=m.training, inplace=m.inplace)),
    torch.nn.Dropout3d: (dropout3d, lambda m: dict(p=m.p, training=m.training, inplace=m.inplace)),
    torch.nn.AlphaDropout: (alpha_dropout, lambda m: dict(p=m.p, training=m.training)),
    torch.nn.FeatureAlphaDropout: (feature_alpha_dropout, lambda m: dict(p=m.p, training=m.training)),
    torch.nn.RReLU: (rrelu, lambda m: dict(lower=m.lower, upper=m.upper, training=m.training, inplace=m.inplace)),
}

@functools.lru_cache(maxsize=None)
def aten_route(op: torch._ops.OpOverload) -> tuple[str, Any]:
    """How a random aten op draws from a generator: ("function", f) -> call ``f`` (FUNCTIONS);
    ("kwarg", op2) -> call ``op2`` with ``generator=`` (op itself, or its ``.generator`` overload);
    ("wrap", op) -> its decomposition reaches generator-taking kernels, so ``call_with_generator``;
    ("unrouted", None) -> nothing can route it."""
    if op in FUNCTIONS:
        return "function", FUNCTIONS[op][0]
    if any(a.name == "generator" for a in op._schema.arguments):
        return "kwarg", op
    names = {a.name for a in op._schema.arguments} | {"generator"}
    for overload in op.overloadpacket.overloads():
        other = getattr(op.overloadpacket, overload)
        if "out" not in overload and {a.name for a in other._schema.arguments} == names:
            return "kwarg", other
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return "wrap", op
    return "unrouted", None


def draws(arguments: dict[str, Any]) -> bool:
    """Whether a random op called with these (bound, by name) arguments draws: not with a dropout
    probability of 0, nor with ``train``/``training`` False. Values not known yet (fx Nodes) may."""
    for name in ("p", "dropout_p", "dropout"):
        if isinstance(arguments.get(name), (int, float)) and not isinstance(arguments[name], bool) \
                and arguments[name] == 0:
            return False
    for name in ("train", "training"):
        if arguments.get(name) is False:
            return False
    return True


def bind(target: Any, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The arguments of a call by parameter name, defaults filled in; None where the signature is unknown.
    torch's C functions (``torch.dropout``) and Tensor methods (given as their name) bind by their aten schema."""
    if isinstance(target, torch._ops.OpOverload):
        return _bind_schema(target._schema, args, kwargs)
    if isinstance(target, torch._ops.OpOverloadPacket):
        overload = resolve(target, args, kwargs)
        return None if overload is None else _bind_schema(overload._schema, args, kwargs)
    signature = signature_of(target)
    if signature is not None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        return dict(bound.arguments)
    packet = getattr(aten, op_name(target), None)
    for overload in (packet.overloads() if isinstance(packet, torch._ops.OpOverloadPacket) else ()):
        bound = _bind_schema(getattr(packet, overload)._schema, args, kwargs)
        if bound is not None:
            return bound
    return None


def resolve(packet: torch._ops.OpOverloadPacket, args: tuple, kwargs: dict) -> torch._ops.OpOverload | None:
    """The overload a call of ``torch.ops.aten.<op>`` (no overload named) takes: the first, "default"
    first, whose schema accepts these arguments by number and name."""
    names = sorted(packet.overloads(), key=lambda o: o != "default")
    return next((getattr(packet, o) for o in names
                 if "out" not in o and _bind_schema(getattr(packet, o)._schema, args, kwargs) is not None), None)


def signature_of(target: Any) -> inspect.Signature | None:
    """``inspect.signature(target)``, None for a C function."""
    try:
        return _signature(target)
    except TypeError:  # unhashable: not cached
        return _signature.__wrapped__(target)


@functools.lru_cache(maxsize=None)
def _signature(target: Any) -> inspect.Signature | None:
    if isinstance(target, str) or not callable(target):
        return None
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # a C function
        return None


def _bind_schema(schema, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional) or any(k not in {a.name for a in schema.arguments} for k in kwargs):
        return None
    bound = {}
    for i, a in enumerate(schema.arguments):
        if i < len(args) and not a.kwarg_only:
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
        elif not (a.type.kind() == "OptionalType"):
            return None
    return bound


def takes_generator(target: Any) -> bool:
    """A torch function or Tensor method (given by name) whose aten op has a ``generator=`` argument."""
    packet = getattr(aten, op_name(target), None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(a.name == "generator" for o in packet.overloads() for a in getattr(packet, o)._schema.arguments)


# -- code codegen cannot see into -----------------------------------------------------

def call_with_generator(fn: Callable, generator: torch.Generator | None, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a module or function whose code the graph does not show) with every
    random op it runs drawing from ``generator``: a TorchFunctionMode catches attention dropout
    (which torch's fused kernels draw from the default generator) and a TorchDispatchMode gives the
    generator to each random aten kernel, also inside torch's own Python (nn.MultiheadAttention's
    dropout, which a function mode never sees). Both modes are thread-local and last for this call."""
    if generator is None:
        return fn(*args, **kwargs)
    where = getattr(fn, "__qualname__", None) or type(fn).__name__
    with _RoutedFunctions(generator), _RoutedKernels(generator, where):
        return fn(*args, **kwargs)


class _RoutedFunctions(TorchFunctionMode):
    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.generator = generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            if dropout_p > 0:
                return scaled_dot_product_attention(*args, **kwargs, generator=self.generator)
        return func(*args, **kwargs)


class _RoutedKernels(TorchDispatchMode):
    def __init__(self, generator: torch.Generator, where: str):
        super().__init__()
        self.generator = generator
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        bound = _bind_schema(func._schema, args, kwargs)
        if bound is not None and not draws(bound):
            return func(*args, **kwargs)
        how, target = aten_route(func)
        if how == "function":
            return target(*args, **kwargs, generator=self.generator)
        if how == "kwarg":
            args, kwargs = with_generator(target, args, kwargs, self.generator)
            return target(*args, **kwargs)
        raise UnroutedRandomOp(
            f"{func} draws random numbers inside {self.where} and takes no generator, so a recomputed "
            f"forward would not replay it; set its dropout to 0 / call model.eval(), or use an op that takes "
            f"a generator")


def with_generator(op: torch._ops.OpOverload, args: tuple, kwargs: dict, generator) -> tuple[tuple, dict]:
    """``op``'s arguments with ``generator`` given, unless the call already gives one."""
    for i, a in enumerate(op._schema.arguments):
        if a.name == "generator" and i < len(args) and not a.kwarg_only:
            return (args if args[i] is not None else args[:i] + (generator,) + args[i + 1:]), kwargs
    return args, (kwargs if kwargs.get("generator") is not None else {**kwargs, "generator": generator})
