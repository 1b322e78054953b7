"""The memory report: bytes each stage keeps between forward and backward, and its peak; how they are counted:
docs/architecture.md, "Memory report"."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from tabulate import tabulate

from autopipe.ir.plan import human_bytes


@dataclass
class StageMemory:
    kept: int = 0            # bytes held from the end of forward to backward, all micro-batches
    recompute_peak: int = 0  # largest activations of one re-materialised micro-batch (GPipe sec. 2.3)
    cuda_peak: int | None = None  # the device's allocator peak during the step, where the step raised it
    device: str | None = None

    @property
    def peak(self) -> int:
        return self.kept + self.recompute_peak


@dataclass
class MemoryReport:
    stages: list[StageMemory]
    checkpoint: str
    tracked: bool = True   # False: no step ran with compile(..., track_memory=True)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def empty(cls, n_stages: int, checkpoint: str) -> "MemoryReport":
        return cls([StageMemory() for _ in range(n_stages)], checkpoint, tracked=False)

    def add_kept(self, stage: int, nbytes: int) -> None:
        with self._lock:
            self.stages[stage].kept += nbytes

    def add_recompute(self, stage: int, nbytes: int) -> None:
        with self._lock:
            self.stages[stage].recompute_peak = max(self.stages[stage].recompute_peak, nbytes)

    def __str__(self) -> str:
        if not self.tracked:
            return ("Memory: not measured. Compile with track_memory=True to count the bytes each stage keeps "
                    "between forward and backward (it hooks every tensor autograd saves).")
        def cuda(j: int, s: StageMemory) -> str:  # one allocator per device: stages on one GPU share its peak
            if s.cuda_peak is None:
                return "-"
            others = [str(k) for k, t in enumerate(self.stages) if k != j and t.device == s.device]
            shared = f", shared with stage {', '.join(others)}" if others else ""
            return f"{human_bytes(s.cuda_peak)} {s.device}{shared}"

        rows = [[j, human_bytes(s.kept), human_bytes(s.recompute_peak), human_bytes(s.peak), cuda(j, s)]
                for j, s in enumerate(self.stages)]
        return (f"Memory of the last step (checkpoint={self.checkpoint!r}; saved activations, parameters excluded):\n"
                + tabulate(rows, headers=["stage", "kept fwd->bwd", "recompute", "peak (saved)", "peak (CUDA alloc)"],
                           tablefmt="simple"))

    __repr__ = __str__


# Note [saved-tensor hooks chain]: only the innermost pair of saved-tensor hooks runs, so the memory counter
# chains to the caller's own hooks (save_on_cpu) instead of shadowing them.
class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the distinct storages autograd saves inside the ``with`` block, except ``exclude`` (the
    storage pointers of the stage's parameters: weights, and views of them like weight.t(), are resident)."""

    def __init__(self, exclude: set[int]):
        # the caller's hooks (save_on_cpu) are chained, not shadowed (Note [saved-tensor hooks chain])
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        super().__init__(self._pack, self.outer[1] if self.outer else lambda t: t)
        self.exclude = exclude
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor):
        if t.device.type != "meta" and t.untyped_storage().data_ptr() not in self.exclude:
            self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return self.outer[0](t) if self.outer else t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> "SavedBytes":
        super().__enter__()
        return self


def tensor_bytes(tensors) -> int:
    """Bytes of the tensors themselves (a micro-batch is a view of the whole batch's storage)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
