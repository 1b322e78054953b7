"""``Options``: what every entry point (compile, plan, verify, the command line, the torchrun runtime) fills once and
every pass reads, checked when made."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from autopipe.cuda_graphs_option import check_option
from autopipe.ir.checkpoint import CHECKPOINT_MODES
from autopipe.ir.plan import Plan
from autopipe.ir.schedule import Schedule, device_of_stage, stages_per_device
from autopipe.runtime.streams import StageStream

BALANCE_MODES = ("flops", "train_flops", "params", "time", "train_time")


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# Note [a plan's cut given as the balance]: ``balance=plan`` keeps that plan's cut (partition's ``cut_of``: each node
# in the stage it had there). A cut measured in one process (balance="train_time" runs the whole model on real
# weights) can so be given to torchrun's ranks, which trace on meta and must agree on one cut: measured on each rank,
# their timings, and so their cuts, would differ.
@dataclass(frozen=True)
class Options:
    """What every entry point fills once and every pass reads; checked when made."""

    devices: tuple[torch.device, ...]          # one per stage: K devices x v virtual stages, round robin (zbv: a V)
    chunks: int = 8
    balance: str | tuple[float, ...] | Plan = "flops"  # a Plan: its cut (Note [a plan's cut given as the balance])
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
            raise ValueError(f"balance must be one of {BALANCE_MODES}, a list of per-stage weights or a Plan whose cut "
                             f"to keep, got {self.balance!r}")
        if not (isinstance(self.crossing_price, (int, float)) and 0 <= self.crossing_price < float("inf")):
            raise ValueError(f"crossing_price must be a finite number >= 0 (the balance's units per byte crossing a "
                             f"cut), got {self.crossing_price!r}")
        if not positive_int(self.virtual_stages):
            raise ValueError(f"virtual_stages must be a positive int, got {self.virtual_stages!r}")
        Schedule.build(self.schedule, 1, 1, self.virtual_stages)  # names a bad schedule or virtual_stages
        check_option(self.cuda_graphs, self.schedule)
        object.__setattr__(self, "virtual_stages", stages_per_device(self.schedule, self.virtual_stages))
        if not isinstance(self.balance, (str, Plan)):
            object.__setattr__(self, "balance", tuple(self.balance))
        object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))

    @classmethod
    def make(cls, devices: Sequence[torch.device], **options: Any) -> "Options":
        """Options for K ``devices``: stage s of the K x virtual_stages stages runs on devices[s % K] (zbv: device d
        holds stages d and 2K-1-d, so the partitioner cuts 2K stages and balances each device's sum)."""
        checked, K = cls(tuple(devices), **options), len(devices)
        if checked.streams and len(checked.streams) != K:
            raise ValueError(f"Options.make: {len(checked.streams)} streams for {K} devices")
        where = [device_of_stage(checked.schedule, K, s) for s in range(K * checked.virtual_stages)]
        if isinstance(checked.balance, Plan) and checked.balance.n_stages != len(where):
            raise ValueError(f"balance is a plan of {checked.balance.n_stages} stages but {len(where)} are asked for: "
                             f"plan with as many stages (devices, schedule and virtual_stages alike)")
        return replace(checked, devices=tuple(devices[d] for d in where),
                       streams=tuple(checked.streams[d] for d in where) if checked.streams else ())


def stage_holders(options: Options) -> tuple[int, ...] | None:
    """The device (0..K-1) of each of ``options``' stages where a device holds several (the partitioner balances
    their sum: Note [stages balanced as their device's sum]); None where each stage has its own."""
    n_stages = len(options.devices)
    if options.virtual_stages < 2 or n_stages % options.virtual_stages:
        return None
    K = n_stages // options.virtual_stages
    return tuple(device_of_stage(options.schedule, K, s) for s in range(n_stages))


def as_tuple(inputs: Any) -> tuple:
    return () if inputs is None else tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
