"""``Options``: what every entry point (compile, plan, verify, the command line, the torchrun runtime) fills once and
every pass reads, checked when made."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from autopipe.cuda_graphs_option import check_option
from autopipe.ir.checkpoint import CHECKPOINT_MODES
from autopipe.ir.schedule import Schedule, device_of_stage, stages_per_device
from autopipe.runtime.streams import StageStream

BALANCE_MODES = ("flops", "train_flops", "params", "time")


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Options:
    """What every entry point fills once and every pass reads; checked when made."""

    devices: tuple[torch.device, ...]          # one per stage: K devices x v virtual stages, round robin (zbv: a V)
    chunks: int = 8
    balance: str | tuple[float, ...] = "flops"
    leaf_modules: tuple[type | str, ...] = ()
    tolerance: float = 0.03
    memory_cap: float | None = None
    # what a byte live across a cut costs each of its two stages, in the balance's units (passes/step_time.py's
    # crossing_price of a measured link); 0: bytes only break ties within the tolerance
    crossing_price: float = 0.0
    route: str = "auto"
    verbose: bool = False
    schedule: str = "gpipe"
    virtual_stages: int = 1
    checkpoint: str = "except_last"
    optimizer: str | None = "adam"         # for the plan's memory prediction: "sgd", "momentum", "adam", None
    cuda_graphs: bool = False             # replay each stage's tasks as CUDA graphs (runtime/cuda_graphs.py)
    streams: tuple[StageStream | None, ...] = ()  # like devices, where devices= gave CUDA streams; else empty

    def __post_init__(self) -> None:
        if not positive_int(self.chunks):
            raise ValueError(f"chunks must be a positive int (micro-batches per mini-batch), got {self.chunks!r}")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {self.checkpoint!r}")
        if isinstance(self.balance, str) and self.balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES} or a list of per-stage weights, got "
                             f"{self.balance!r}")
        if not (isinstance(self.crossing_price, (int, float)) and 0 <= self.crossing_price < float("inf")):
            raise ValueError(f"crossing_price must be a finite number >= 0 (the balance's units per byte crossing a "
                             f"cut), got {self.crossing_price!r}")
        if not positive_int(self.virtual_stages):
            raise ValueError(f"virtual_stages must be a positive int, got {self.virtual_stages!r}")
        Schedule.build(self.schedule, 1, 1, self.virtual_stages)  # names a bad schedule or virtual_stages
        check_option(self.cuda_graphs, self.schedule)
        object.__setattr__(self, "virtual_stages", stages_per_device(self.schedule, self.virtual_stages))
        object.__setattr__(self, "balance", self.balance if isinstance(self.balance, str) else tuple(self.balance))
        object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))

    @classmethod
    def make(cls, devices: Sequence[torch.device], **options: Any) -> "Options":
        """Options for K ``devices``: stage s of the K x virtual_stages stages runs on devices[s % K] (zbv: device d
        holds stages d and 2K-1-d, so the partitioner cuts 2K stages and balances them)."""
        checked, K = cls(tuple(devices), **options), len(devices)
        if checked.streams and len(checked.streams) != K:
            raise ValueError(f"Options.make: {len(checked.streams)} streams for {K} devices")
        where = [device_of_stage(checked.schedule, K, s) for s in range(K * checked.virtual_stages)]
        return replace(checked, devices=tuple(devices[d] for d in where),
                       streams=tuple(checked.streams[d] for d in where) if checked.streams else ())


def as_tuple(inputs: Any) -> tuple:
    return () if inputs is None else tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
