"""Which ops draw random numbers, and how each draws from a stage's generator, so recompute replays the forward."""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._ops import OpOverload, OpOverloadPacket
from torch.fx.operator_schemas import _torchscript_schema_to_signature
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class UnroutedRandomOp(ValueError):
    """A random op of a stage that codegen cannot route to the stage's generator."""


RANDOM_OPS = frozenset({  # and every op whose name has "dropout" in it
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli", "multinomial",
    "normal", "poisson", "rrelu", "uniform", "random", "exponential", "geometric", "cauchy", "log_normal",
    "gumbel_softmax", "fractional_max_pool2d", "fractional_max_pool3d", "fractional_max_pool2d_with_indices",
    "fractional_max_pool3d_with_indices", "scaled_dot_product_attention",  # its dropout_p
})
_MODULES_THAT_DRAW = {  # torch.nn module -> whether it draws now
    nn.modules.dropout._DropoutNd: lambda m: m.training and m.p > 0, nn.RReLU: lambda m: m.training,
    nn.MultiheadAttention: lambda m: m.training and m.dropout > 0,
    nn.RNNBase: lambda m: m.training and m.dropout > 0 and m.num_layers > 1,
    (nn.FractionalMaxPool2d, nn.FractionalMaxPool3d): lambda m: m._random_samples is None,  # in eval too
}


def op_name(target: Any) -> str:
    """``aten.dropout.default`` and ``F.dropout`` -> "dropout"; a Tensor method's name stays as it is."""
    return target if isinstance(target, str) else getattr(target, "__name__", str(target)).split(".")[0]


def aten_overloads(target: Any, out: bool = True) -> list[OpOverload]:
    """The aten overloads of an op packet, a torch C function or a Tensor method (by name); "default" first."""
    packet = target if isinstance(target, OpOverloadPacket) else getattr(aten, op_name(target), None)
    names = packet.overloads() if isinstance(packet, OpOverloadPacket) else []
    return [getattr(packet, o) for o in sorted(names, key=lambda o: o != "default") if out or "out" not in o]


def is_random_target(target: Any) -> bool:
    """A call_function / call_method target that may draw; an aten op says so by its tag."""
    if isinstance(target, OpOverloadPacket):
        return any(is_random_target(getattr(target, o)) for o in target.overloads())
    if isinstance(target, OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags or target in FUNCTIONS or "dropout" in op_name(target)
    return op_name(target).strip("_") in RANDOM_OPS or "dropout" in op_name(target)


# Note [torch's own functions]: a function fx keeps whole (torch.fx.wrap) is wrapped to draw from the task's
# generator unless torch defines it. "Defined by torch" is the module torch or torch.*, not a name beginning
# with "torch": torchvision's stochastic_depth drew from the global generator, so recomputed and kept micro-batches
# trained on other masks.
def from_torch(target: Any) -> bool:
    """Defined by torch itself (Note [torch's own functions])."""
    module = getattr(target, "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")


def drawing(func: OpOverload, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """A random kernel's arguments by name where this call draws (not with probability 0, nor with train False); else
    None."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return None
    bound = bind(func, args, kwargs) or {}
    return bound if draws(bound) else None


class Draws(TorchDispatchMode):
    """Sees whether a random kernel draws while it is active (``seen``; Note [dropout hidden behind a zero gain])."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seen = self.seen or drawing(func, args, kwargs) is not None
        return func(*args, **kwargs)


def draws_when_called(fn: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether ``fn`` draws when called on these (fake) values; True where it cannot run on them (it may)."""
    try:
        with torch.no_grad(), Draws() as seen:
            fn(*args, **kwargs)
    except Exception:  # noqa: BLE001
        return True
    return seen.seen


# a random op -> the value each draw takes (its mean, or one it can take: bernoulli keeps), from its bound arguments
_FIXED: dict[str, Callable[[dict[str, Any]], Any]] = {"bernoulli": lambda b: 1.0,
                                                      "uniform": lambda b: (b.get("from", 0.0) + b.get("to", 1.0)) / 2,
                                                      "rand": lambda b: 0.5, "rand_like": lambda b: 0.5,
                                                      "normal": lambda b: b.get("mean", 0.0), "randn": lambda b: 0.0,
                                                      "randn_like": lambda b: 0.0,
                                                      "random": lambda b: b.get("from", 0),
                                                      "randint": lambda b: b.get("low", 0),
                                                      "randint_like": lambda b: b.get("low", 0),
                                                      "exponential": lambda b: 1.0 / b.get("lambd", 1.0),
                                                      "multinomial": lambda b: 0, "geometric": lambda b: 1,
                                                      "log_normal": lambda b: math.exp(b.get("mean", 1.0)),
                                                      "cauchy": lambda b: b.get("median", 0.0)}


class FixedDraws(TorchDispatchMode):
    """Every random kernel's draws take fixed values (dropout keeps everything and scales): a training step of the plain
    model and one of the pipeline compute the same numbers, whoever draws from which generator (Note [training steps
    with draws fixed]). A dispatch mode runs the pipeline's tasks inline, on this thread. ``unfixed``: the random
    kernels it does not know."""

    def __init__(self):
        super().__init__()
        self.unfixed: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (bound := drawing(func, args, kwargs)) is None:
            return out
        name = func.overloadpacket.__name__.strip("_")
        if name == "native_dropout":  # (output, keep-mask)
            p = bound["p"]
            return args[0] * (0.0 if p == 1 else 1.0 / (1 - p)), torch.ones_like(args[0], dtype=torch.bool)
        if name == "rrelu_with_noise":  # a negative input's slope: the middle of [lower, upper]
            x, noise, slope = args[0], args[1], (bound["lower"] + bound["upper"]) / 2
            noise.copy_(torch.where(x >= 0, 1.0, slope))
            return x * noise
        if name not in _FIXED:
            self.unfixed.add(str(func))
            return out
        value = _FIXED[name](bound)
        written = [args[k] if k < len(args) else kwargs.get(a.name) for k, a in enumerate(func._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]  # bernoulli_'s self, an out=
        for target in written or [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]:
            target.copy_(value.expand_as(target)) if isinstance(value, torch.Tensor) else target.fill_(value)
        return out


def module_draws(module: nn.Module) -> bool:
    """Whether calling ``module`` draws, in its modules' train/eval modes and with their probabilities."""
    return any(not type(m).__module__.startswith("torch.nn")  # code fx did not look into
               or any(isinstance(m, kind) and drawing(m) for kind, drawing in _MODULES_THAT_DRAW.items())
               for m in module.modules())


def _dropout(name: str, feature: bool = False, alpha: bool = False, batched_dim: int | None = None) -> Callable:
    """torch's dropout ``name``, same signature, with ``generator=``: Dropout.cpp's ``_dropout_impl``."""
    def fn(input, p=0.5, training=not alpha, inplace=False, *, generator=None):
        if p < 0 or p > 1:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if p == 0 or not training or input.numel() == 0:
            return input
        mul = input.mul_ if inplace else input.mul
        if p == 1:
            return mul(torch.zeros((), dtype=input.dtype, device=input.device))
        # feature dropout draws once per (sample, channel); F.dropout1d/3d take an unbatched input as a batch of one
        channels = 1 if batched_dim is not None and input.dim() != batched_dim else 2
        if feature and input.dim() < channels:
            raise RuntimeError("Feature dropout requires at least 2 dimensions in the input")
        noise = input.new_empty(input.shape[:channels] + (1,) * (input.dim() - channels)) if feature \
            else torch.empty_like(input)
        noise.bernoulli_(1 - p, generator=generator)
        if not alpha:
            return mul(noise.div_(1 - p))
        saturation = 1.7580993408473766  # SELU's, for very negative inputs
        a = 1.0 / math.sqrt((saturation * saturation * p + 1) * (1 - p))
        b = noise.add(-1).mul_(saturation * a).add_(saturation * a * p)
        return mul(noise.mul_(a)).add_(b)
    fn.__name__ = fn.__qualname__ = name
    return fn


dropout = _dropout("dropout")
feature_dropout = _dropout("feature_dropout", feature=True)
alpha_dropout = _dropout("alpha_dropout", alpha=True)
feature_alpha_dropout = _dropout("feature_alpha_dropout", feature=True, alpha=True)
dropout1d = _dropout("dropout1d", feature=True, batched_dim=3)
dropout2d = _dropout("dropout2d", feature=True)  # like torch, a 3-D input is taken as batched
dropout3d = _dropout("dropout3d", feature=True, batched_dim=5)


# torch's Python bindings, as aten.randint_like leaves a broken autograd node
rand_like, randn_like, randint_like = torch.rand_like, torch.randn_like, torch.randint_like


def native_dropout(input, p, train=True, *, generator=None):
    """``aten.native_dropout``: (output, keep-mask), as Dropout.cpp's native_dropout_cpu."""
    if train is not None and not train:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    keep = torch.empty_like(input, dtype=torch.bool).bernoulli_(1 - p, generator=generator)
    return input.mul(keep).mul_(0.0 if p == 1 else 1.0 / (1 - p)), keep


def rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False, *, generator=None):
    return (torch.rrelu_ if inplace else torch.rrelu)(input, lower, upper, training, generator=generator)


_DEFAULT_GENERATORS = threading.Lock()


# Note [fused kernels on the default generator]: an op that takes no generator and draws (a fused attention
# kernel) runs on its device's default generator, lent the task generator's state under a lock and given its own
# back; a CUDA generator's state is host-side, so nothing synchronises. On the CPU the lock would serialise the
# stages, so attention with dropout runs the documented math reference with the generator; any other such op is
# refused on a CPU stage.
def on_default_generator(generator: torch.Generator, fn: Callable, /, *args, **kwargs):
    """``fn(*args, **kwargs)``, a kernel that draws from its device's default generator only (torch's fused attention),
    drawing from ``generator`` (Note [fused kernels on the default generator])."""
    device = generator.device
    default = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" else torch.default_generator
    with _DEFAULT_GENERATORS:
        saved = default.get_state()
        default.set_state(generator.get_state())
        try:
            return fn(*args, **kwargs)
        finally:
            generator.set_state(default.get_state())
            default.set_state(saved)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, generator=None):
    """On a GPU torch's own (fused flash / memory-efficient kernels) on ``generator``'s state; elsewhere its
    documentation's math reference (Note [fused kernels on the default generator])."""
    if generator is not None and query.device.type == "cuda":
        return on_default_generator(generator, F.scaled_dot_product_attention, query, key, value, attn_mask,
                                    dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if enable_gqa:
        key, value = (t.repeat_interleave(query.size(-3) // t.size(-3), -3) for t in (key, value))
    scores = query @ key.transpose(-2, -1) * (1 / math.sqrt(query.size(-1)) if scale is None else scale)
    if is_causal:  # torch refuses is_causal with an attn_mask
        attn_mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return dropout(aten._safe_softmax(scores, -1), dropout_p, True, generator=generator) @ value


# op that takes no generator -> (our function that does, keyword arguments it adds)
FUNCTIONS: dict[Any, tuple[Callable, dict[str, Any]]] = {
    getattr(F, fn.__name__): (fn, {}) for fn in (dropout, dropout1d, dropout2d, dropout3d, alpha_dropout,
                                                 feature_alpha_dropout, rrelu, scaled_dot_product_attention)}
for _fn in (dropout, feature_dropout, alpha_dropout, feature_alpha_dropout):
    for _suffix, _extra in (("", {}), ("_", {"inplace": True})):  # torch.dropout_ & co. work in place
        FUNCTIONS[getattr(torch, _fn.__name__ + _suffix)] = (_fn, _extra)
        FUNCTIONS[getattr(aten, _fn.__name__ + _suffix).default] = (_fn, _extra)
for _fn in (rand_like, randn_like, randint_like, native_dropout, scaled_dot_product_attention):
    FUNCTIONS.update({o: (_fn, {}) for o in aten_overloads(getattr(aten, _fn.__name__), out=False)})


def _attributes(*names: str) -> Callable[[nn.Module], dict[str, Any]]:
    return lambda module: {name: getattr(module, name) for name in names}


# module fx keeps whole -> (our function, its arguments read from the module), as its forward calls it
MODULES: dict[type, tuple[Callable, Callable[[nn.Module], dict[str, Any]]]] = {
    **{kind: (fn, _attributes("p", "training", "inplace")) for kind, fn in (
        (nn.Dropout, dropout), (nn.Dropout1d, dropout1d), (nn.Dropout2d, dropout2d), (nn.Dropout3d, dropout3d))},
    nn.AlphaDropout: (alpha_dropout, _attributes("p", "training")),
    nn.FeatureAlphaDropout: (feature_alpha_dropout, _attributes("p", "training")),
    nn.RReLU: (rrelu, _attributes("lower", "upper", "training", "inplace")),
}


@functools.lru_cache(maxsize=None)
def aten_route(op: OpOverload) -> tuple[str, Any]:
    """How a random aten op gets a generator: "function" (FUNCTIONS), "kwarg" (it or an overload takes one),
    "wrap" (it decomposes into such ops: ``call_with_generator``) or "unrouted"."""
    if op in FUNCTIONS:
        return "function", FUNCTIONS[op][0]
    names = set(signature_of(op).parameters) | {"generator"}
    if twins := [t
                 for t in (op,
                           *aten_overloads(op.overloadpacket, out=False)) if set(signature_of(t).parameters) == names]:
        return "kwarg", twins[0]
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return "wrap", op
    return "unrouted", None


def draws(arguments: dict[str, Any]) -> bool:
    """Whether a random op with these bound arguments draws: not with probability 0, nor with train(ing) False."""
    probabilities = [arguments.get(name) for name in ("p", "dropout_p", "dropout")]
    return not any(isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0 for p in probabilities) \
        and arguments.get("train") is not False and arguments.get("training") is not False


def signature_of(target: Any) -> inspect.Signature | None:
    """A Python function's signature, or an aten op's (by its schema, as fx reads it); None for a C function."""
    if isinstance(target, OpOverload):
        return _torchscript_schema_to_signature(target._schema)
    with contextlib.suppress(TypeError, ValueError):
        return inspect.signature(target) if callable(target) else None
    return None


def _bind(targets: list[Any], args: tuple, kwargs: dict) -> tuple[Any, dict[str, Any] | None]:
    """The first target whose signature takes these arguments, and them by name, defaults filled in."""
    for target in targets:
        with contextlib.suppress(TypeError):
            bound = signature_of(target).bind(*args, **kwargs)
            bound.apply_defaults()
            return target, dict(bound.arguments)
    return None, None


def resolve(target: Any, args: tuple, kwargs: dict) -> Any:
    """The overload a call of ``aten.<op>`` (an fx trace names none) takes; any other target as it is."""
    if isinstance(target, OpOverloadPacket):
        return _bind(aten_overloads(target, out=False), args, kwargs)[0] or target
    return target


def bind(target: Any, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """A call's arguments by parameter name, defaults filled in; None where the signature is unknown."""
    if isinstance(target, OpOverloadPacket):
        return _bind(aten_overloads(target, out=False), args, kwargs)[1]
    return _bind([target] if signature_of(target) else aten_overloads(target), args, kwargs)[1]


def takes_generator(target: Any) -> bool:
    """A torch function or Tensor method (by name) whose aten op takes ``generator=``."""
    return any("generator" in signature_of(o).parameters for o in aten_overloads(target))


def with_generator(target: Any, generator: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments with ``generator`` in place of the generator it passes (positionally where it does so)."""
    names = list(signature_of(target).parameters) if isinstance(target, OpOverload) else []
    if "generator" in names[:len(args)]:
        return tuple(generator if name == "generator" else a for name, a in zip(names, args)), kwargs
    return args, {**kwargs, "generator": generator}


def call_with_generator(fn: Callable, generator: torch.Generator | None, /, *args, **kwargs):
    """``fn(*args, **kwargs)``, code the graph does not show, with each random op it runs drawing from ``generator``."""
    if generator is None:
        return fn(*args, **kwargs)
    with _RoutedFunctions(generator), _RoutedKernels(generator, getattr(fn, "__qualname__", None) or type(fn).__name__):
        return fn(*args, **kwargs)


class _Routed:
    def __init__(self, generator: torch.Generator, where: str = ""):
        super().__init__()
        self.generator, self.where = generator, where


class _RoutedFunctions(_Routed, TorchFunctionMode):
    """Attention dropout on the CPU, where torch's kernels draw from the default generator, runs our math (a GPU's
    reaches _RoutedKernels)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0)
        if func is F.scaled_dot_product_attention and dropout > 0 and args[0].device.type != "cuda":
            return scaled_dot_product_attention(*args, **kwargs, generator=self.generator)
        return func(*args, **kwargs)


class _RoutedKernels(_Routed, TorchDispatchMode):
    """Each random aten kernel, also those torch's own Python runs (nn.MultiheadAttention's dropout), gets it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if drawing(func, args, kwargs) is None:
            return func(*args, **kwargs)
        how, target = aten_route(func)
        if how == "function":
            return target(*args, **kwargs, generator=self.generator)
        if how != "kwarg" and self.generator.device.type == "cuda":
            return on_default_generator(self.generator, func, *args, **kwargs)
        if how != "kwarg":
            raise UnroutedRandomOp(f"{func} draws random numbers inside {self.where} and takes no generator, so a "
                                   f"recomputed forward would not replay it; set its dropout to 0 / call model.eval(), "
                                   f"or use an op that takes a generator")
        args, kwargs = with_generator(target, self.generator, args, kwargs)
        return target(*args, **kwargs)
