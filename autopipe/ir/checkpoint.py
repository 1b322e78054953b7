"""Re-materialisation modes (torchgpipe's): which micro-batches drop their activations after the forward and recompute
them for the backward. The runtime's tasks follow them; the memory model prices them."""
from __future__ import annotations

CHECKPOINT_MODES = ("always", "except_last", "never")


def checkpoints(mode: str, micro_batch: int, chunks: int) -> bool:
    """Whether this micro-batch is recomputed in backward (torchgpipe's modes)."""
    return mode == "always" or (mode == "except_last" and micro_batch < chunks - 1)
