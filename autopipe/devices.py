"""Which devices the stages run on: ``devices=`` resolved to one torch.device per stage (a CUDA stream stands for its
GPU), the streams it names, and the stage devices a plan names without checking they exist."""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from autopipe.runtime.streams import StageStream, as_stage_stream


def resolve_devices(devices: int | Sequence[str | torch.device] | None) -> list[torch.device]:
    """``devices=N``: N CUDA devices, or N CPU workers without CUDA; or an explicit list, where a CUDA stream stands
    for its GPU (``device_streams`` gives the streams)."""
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices is None:
        devices = cuda_count or min(os.cpu_count() or 1, 8)
    if isinstance(devices, bool) or not isinstance(devices, (int, list, tuple)):
        raise TypeError(f"devices must be an int or a list of devices, got {devices!r}")
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}")
        if devices > cuda_count > 0:
            raise ValueError(f"devices={devices} asks for {devices} CUDA devices but this host has {cuda_count}; "
                             f"pass devices={cuda_count} or a list such as ['cpu'] * {devices}")
        return [torch.device("cuda", i) for i in range(devices)] if cuda_count else [torch.device("cpu")] * devices
    if len(devices) == 0:
        raise ValueError("devices is an empty list: name at least one device, e.g. devices=['cpu', 'cpu']")
    resolved = []
    for d in devices:
        stream = as_stage_stream(d, cuda_count)
        if stream is not None:
            resolved.append(stream.device)
            continue
        try:
            device = torch.device(d)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"devices: {d!r} is not a device ({e})") from None
        if device.type == "cuda":
            if not cuda_count:
                raise ValueError(f"devices: {d!r} is a CUDA device but CUDA is not available here; use 'cpu' workers")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            if device.index >= cuda_count:
                raise ValueError(f"devices: {d!r} does not exist: this host has {cuda_count} CUDA device(s) "
                                 f"(cuda:0..cuda:{cuda_count - 1})")
        elif device.type != "cpu":
            raise ValueError(f"devices: {d!r}: autopipe runs stages on 'cpu' or 'cuda' devices")
        resolved.append(device)
    return resolved


def device_streams(devices: Any) -> tuple[StageStream | None, ...]:
    """Per entry of a ``devices`` list, its StageStream where it is a CUDA stream, else None; () if it holds no
    stream (the common case: every stage on the caller's current stream of its device)."""
    if not isinstance(devices, (list, tuple)):
        return ()
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    streams = tuple(as_stage_stream(d, cuda_count) for d in devices)
    return streams if any(s is not None for s in streams) else ()


def plan_devices(devices: int | Sequence[str | torch.device] | None) -> list[torch.device]:
    """For planning only: an int names that many stages without checking they exist."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:  # a list, or what resolve refuses
        return resolve_devices(devices)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [torch.device("cuda", i) if i < count else torch.device("cpu") for i in range(devices)]
