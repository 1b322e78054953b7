"""Stages on CUDA streams of their own: ``devices=[stream, ...]``, SM slices from green contexts, and the events that
hand a value from one stage's stream to another's on the same GPU.

A stage given a stream computes on it (its parameters on that stream's GPU); one given a device computes on the
caller's current stream there (task.py). Each phase of a step (forward, backward, a whole ``pipe.step``) first makes
every stage stream wait for the caller's stream and at its end makes the caller's stream wait for them (executor.py),
so the caller's work before and after is ordered as with one stream. In between, a value crosses streams by an event
recorded on its producer's stream when it is sent (``mark_ready``) and waited for by the consumer's stream when it is
read (``arrived``), with ``record_stream`` for the allocator (torchgpipe's copy.py does the same across devices).

SM slices are torch's green contexts (``torch.cuda.green_contexts``, CUDA 12.8+): ``sm_slices(k)`` creates k of them
with equal SM counts and returns one stream in each (``GreenContext.Stream()``: made inside the context, so no
``set_context`` per call, which makes the default stream wait on the current one). Each ``create`` splits the GPU's
SMs on its own, so two contexts may share SMs (pytorch#195378); torch has no call that splits once into disjoint
groups, and we add no driver code of our own. Nothing here has run on a GPU yet (docs/gpus.md).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Iterable

import torch

_READY = "_autopipe_ready"   # a tensor's (stream, event) from the stream that made it, set when it is sent
_SLICES: dict[tuple[int, int], tuple[Any, int]] = {}  # (device, raw stream) -> (green context, SMs): kept alive


@dataclass(frozen=True, eq=False)
class StageStream:
    """A stage's own CUDA stream: where it computes, and how it prints in the plan and the pipeline."""

    device: torch.device
    stream: Any              # torch.cuda.Stream
    sms: int | None = None   # the SMs of the green context it belongs to; None: a plain stream (all SMs)

    def __str__(self) -> str:
        return stream_label(self.device, self.stream.cuda_stream, self.sms)

    __repr__ = __str__

    def __deepcopy__(self, memo) -> "StageStream":
        return self  # a copied stage computes on the same stream


def stream_label(device: torch.device, raw_stream: int, sms: int | None) -> str:
    """How a stream device prints: ``cuda:0 stream 0x7f3a (green context, 32 SMs)``."""
    return f"{device} stream {raw_stream:#x} ({'all SMs' if sms is None else f'green context, {sms} SMs'})"


def check_stream_device(device: torch.device, cuda_count: int, entry: str) -> torch.device:
    """The GPU of a stream given in ``devices``, checked: a CUDA device of this host. ``entry`` names it."""
    if device.type != "cuda":
        raise ValueError(f"devices: {entry} is a {device.type} stream: autopipe puts stages on CUDA streams "
                         f"(torch.cuda.Stream(), or a green context's .Stream()); name CPU workers as 'cpu'")
    if not cuda_count:
        raise ValueError(f"devices: {entry} is a CUDA stream but CUDA is not available here")
    if device.index is None or not 0 <= device.index < cuda_count:
        raise ValueError(f"devices: {entry} is on {device}, which does not exist: this host has {cuda_count} CUDA "
                         f"device(s) (cuda:0..cuda:{cuda_count - 1})")
    return device


def as_stage_stream(entry: Any, cuda_count: int) -> StageStream | None:
    """``entry`` of ``devices=`` as a StageStream if it is a stream; None if it is not one (a device or a name)."""
    if isinstance(entry, torch.cuda.Stream):
        device = check_stream_device(torch.device("cuda", entry.device_index), cuda_count, repr(entry))
        return StageStream(device, entry, slice_sms_of(device.index, entry.cuda_stream))
    if isinstance(entry, torch.Stream):
        check_stream_device(torch.device(entry.device), cuda_count, repr(entry))
        raise ValueError(f"devices: {entry!r} is a generic torch.Stream: give a torch.cuda.Stream (e.g. "
                         f"torch.cuda.Stream(device), or autopipe.sm_slices(k))")
    return None


def slice_sms_of(device_index: int, raw_stream: int) -> int | None:
    entry = _SLICES.get((device_index, raw_stream))
    return entry[1] if entry is not None else None


# -- SM slices -------------------------------------------------------------------------------------------------

def slice_size(total_sms: int, k: int, major: int) -> int:
    """SMs per slice for ``k`` equal slices of a GPU with ``total_sms`` SMs and compute capability ``major``: a
    multiple of the driver's split granularity (cuDevSmResourceSplitByCount: 8 SMs from sm_90 on, 2 before; at
    least 4 on sm_8x), rounded down so that k slices fit the GPU (132 SMs: 2 x 64, 4 x 32)."""
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise ValueError(f"sm_slices: k must be a positive int, got {k!r}")
    step, least = (8, 8) if major >= 9 else (2, 4) if major == 8 else (2, 2)
    size = total_sms // k // step * step
    if size < least:
        raise ValueError(f"sm_slices: {k} slices of a GPU with {total_sms} SMs would have {total_sms // k} SMs each; "
                         f"a green context needs at least {least} (in multiples of {step}) on sm_{major}x: use at most "
                         f"{total_sms // least} slices")
    return size


def sm_slices(k: int, device: int | str | torch.device = 0, *, sms: int | None = None,
              workqueue_scope: str | None = None) -> list:
    """``k`` CUDA streams, each in its own green context of ``sms`` SMs (default: an equal share, ``slice_size``),
    for ``autopipe.compile(model, devices=autopipe.sm_slices(4))``: stages on one GPU, each on its SM slice.

    ``workqueue_scope="balanced"`` (torch >= 2.13) gives each context its own hardware work queues. The contexts
    live as long as the process (their streams are torch's, which it never destroys either)."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"sm_slices: {device} is not a CUDA device here: SM slices are green contexts of a GPU")
    index = device.index if device.index is not None else torch.cuda.current_device()
    from torch.cuda import green_contexts
    if not green_contexts.SUPPORTED:
        raise RuntimeError(f"sm_slices: torch {torch.__version__} was built without green contexts (CUDA 12.8+ and a "
                           f"driver of 12.8+ are needed)")
    props = torch.cuda.get_device_properties(index)
    per = sms if sms is not None else slice_size(props.multi_processor_count, k, props.major)
    options: dict[str, Any] = {"num_sms": per, "device_id": index}
    if workqueue_scope is not None:
        if "workqueue_scope" not in inspect.signature(green_contexts.GreenContext.create).parameters:
            raise RuntimeError(f"sm_slices: workqueue_scope needs torch >= 2.13 (this is {torch.__version__})")
        options["workqueue_scope"] = workqueue_scope
    streams = []
    for _ in range(k):
        context = green_contexts.GreenContext.create(**options)
        stream = context.Stream()
        _SLICES[(index, stream.cuda_stream)] = (context, per)
        streams.append(stream)
    return streams


# -- hand-offs between the streams of one GPU -------------------------------------------------------------------

def mark_ready(values: Iterable[Any]) -> None:
    """Tag each CUDA tensor with an event recorded now on its device's current stream (the sending stage's): a
    consumer on another stream waits for that event, not for the whole stream."""
    events: dict[torch.device, tuple] = {}
    for x in values:
        if isinstance(x, torch.Tensor) and x.is_cuda:
            tag = events.get(x.device)
            if tag is None:
                stream = torch.cuda.current_stream(x.device)
                tag = events[x.device] = (stream, stream.record_event())
            setattr(x, _READY, tag)


def arrived(values: Iterable[Any]) -> None:
    """Make the current stream wait for each tagged tensor of the current GPU that another stream made, and tell
    the allocator it is used here. A tensor of another GPU is left to task.py's copy, which waits for its tag."""
    current = None
    for x in values:
        tag = getattr(x, _READY, None) if isinstance(x, torch.Tensor) else None
        if tag is None:
            continue
        if current is None:
            current = torch.cuda.current_stream()
        if x.device.index == current.device_index and tag[0] != current:
            current.wait_event(tag[1])
            x.record_stream(current)


def detached(x: torch.Tensor) -> torch.Tensor:
    """``x.detach()`` that keeps ``x``'s tag: a copy to another GPU waits for the event that made it."""
    y = x.detach()
    tag = getattr(x, _READY, None)
    if tag is not None:
        setattr(y, _READY, tag)
    return y


def wait_for_producer(stream, x: torch.Tensor, default) -> None:
    """``stream`` waits for the event that made ``x`` where it has one, else for the whole ``default`` stream."""
    tag = getattr(x, _READY, None)
    if tag is not None:
        stream.wait_event(tag[1])
    else:
        stream.wait_stream(default)
