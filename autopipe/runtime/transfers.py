"""Device moves: a tensor onto a stage's device, from the host through pinned memory, between GPUs on copy streams
that wait only for its producer (``moved``)."""
from __future__ import annotations

import torch

from .streams import wait_for_producer


# Note [copy streams]: a value moving between GPUs is copied on per-device copy streams: the source's copy stream
# waits for the producer's stream, the copy runs with both copy streams current (torch's device-to-device copy
# runs on the source's current stream and waits for the destination's), the consumer waits for the copy, and
# record_stream keeps both tensors alive for the allocator (torchgpipe's copy.py). A transfer waits only for its
# producer. A host input goes through pinned memory with a non-blocking copy.
def moved(x: torch.Tensor, device: torch.device, copy_streams: dict, streams: dict) -> torch.Tensor:
    """``x`` on ``device``: from the host through pinned memory; between GPUs on copy streams, so a transfer
    waits only for its producer (the event a stage stream tagged it with, else the caller's stream in ``streams``)
    and overlaps the consumer's compute on the current stream (Note [copy streams])."""
    if x.device == device or device.type != "cuda":
        return x if x.device == device else x.to(device)
    if x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    for d in (x.device, device):
        if d not in copy_streams:
            copy_streams[d] = torch.cuda.Stream(d)
    source, target = copy_streams[x.device], copy_streams[device]
    wait_for_producer(source, x, streams.get(x.device) or torch.cuda.current_stream(x.device))
    with torch.cuda.stream(source), torch.cuda.stream(target):
        y = x.to(device, non_blocking=True)
    compute = torch.cuda.current_stream(device)  # the consumer's: its own stream, or the caller's (on_device)
    compute.wait_stream(target)
    x.record_stream(source)
    y.record_stream(compute)
    return y
