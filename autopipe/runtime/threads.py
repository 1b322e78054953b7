"""The in-process transport: one worker thread per device, values handed over in a mailbox of set-once slots.

A CPU worker sets its own intra-op thread count (ATen keeps it per thread), so K workers do not
oversubscribe the cores. A gradient read by several stages is summed in a fixed order: consumers by
stage index, the model's output last.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any, Callable, Sequence

import torch

from .executor import StageFailure, Transport
from .gradients import differentiable, sum_grads
from .streams import arrived, mark_ready

OUTPUT = 1 << 30   # the model's output as a gradient contributor: after every stage


# Note [one thread count per worker]: torch.set_num_threads is a process-wide default for new threads, but ATen
# keeps the thread count per thread: each worker sets its own (cores // workers, or intra_op_threads), so the
# workers do not oversubscribe the cores, and the calling thread's setting is left alone.
class Worker:
    """A thread that runs submitted functions in order, on its device, with its thread count (Note [one thread count
    per worker])."""

    def __init__(self, device: torch.device, name: str, intra_op_threads: int | None = None):
        self.device = torch.device(device)
        self.name = name
        self.intra_op_threads = intra_op_threads
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> Future:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        future: Future = Future()
        self._tasks.put((fn, future))
        return future

    def _loop(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            if self.intra_op_threads:
                torch.set_num_threads(self.intra_op_threads)
        except BaseException as e:  # a worker that cannot start fails its tasks rather than hanging the caller
            startup_error = e
        else:
            startup_error = None
        while True:
            item = self._tasks.get()
            if item is None:
                return
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    if startup_error is not None:
                        raise RuntimeError(f"worker {self.name} on {self.device} could not start") from startup_error
                    future.set_result(fn())
                except BaseException as e:  # handed to the caller, who re-raises it
                    future.set_exception(e)
                    del e
            del item, fn, future  # the closure holds the step: let it be collected

    def close(self, timeout: float | None = 10.0) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._tasks.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


# Note [set-once slots]: a mailbox value is a set-once slot latched by a C lock. A concurrent.futures.Future ran
# about forty lines of Python per use, which a step of small ops feels.
class _Slot:
    """A value set once and read by any thread; a C lock is the latch (Note [set-once slots])."""

    __slots__ = ("value", "error", "done", "latch")

    def __init__(self):
        self.value = self.error = None
        self.done = False
        self.latch = threading.Lock()
        self.latch.acquire()  # released once, by whoever sets the slot

    def get(self):
        if not self.done:
            with self.latch:  # waits until set; each reader passes the latch on
                pass
        if self.error is not None:
            raise self.error
        return self.value


class Mailbox(Transport):
    """One step's values and gradients, keyed by (micro-batch, name); plans may differ per micro-batch
    (a model traced at a static micro-batch size has one program per size)."""

    def __init__(self, programs: Sequence[Any], inputs: list[list[torch.Tensor]], input_grad: list[bool]):
        self.programs = programs                   # per micro-batch: the Program (plan + stages) it runs
        self.values: dict[tuple[int, str], _Slot] = {}
        self.needs_grad: dict[tuple[int, str], bool] = {}
        self.grad_parts: dict[tuple[int, str], dict[int, torch.Tensor | None]] = {}
        self.grads: dict[tuple[int, str], _Slot] = {}
        self.lock = threading.Lock()
        self.aborted = False
        # stages on streams of their own: values carry their producer's event, and readers wait for it (streams.py)
        self.streamed = any(r.stream is not None for p in programs for r in p.runners)
        for i, row in enumerate(inputs):
            for name, value, grad in zip(programs[i].plan.graph_inputs, row, input_grad):
                self._set(self.values, (i, name), value)
                self.needs_grad[(i, name)] = grad and differentiable(value)

    def _slot(self, table: dict, key) -> _Slot:
        with self.lock:
            slot = table.get(key)
            if slot is None:
                slot = table[key] = _Slot()
                if self.aborted:
                    slot.error, slot.done = StageFailure("another task of this step failed"), True
                    slot.latch.release()
            return slot

    def _set(self, table: dict, key, value: Any = None, error: BaseException | None = None) -> None:
        slot = self._slot(table, key)
        with self.lock:  # the first value (or the abort's error) stays
            if slot.done:
                return
            slot.value, slot.error, slot.done = value, error, True
        slot.latch.release()

    # -- forward -------------------------------------------------------------
    def inputs(self, stage: int, i: int):
        names = self.programs[i].stages[stage].input_names
        values = [self._slot(self.values, (i, n)).get() for n in names]
        if self.streamed:
            arrived(values)
        return values, [self.needs_grad.get((i, n), False) for n in names]

    def send_outputs(self, stage: int, i: int, outputs: list) -> None:
        if self.streamed:
            mark_ready(outputs)
        for name, value in zip(self.programs[i].stages[stage].output_names, outputs):
            self.needs_grad[(i, name)] = differentiable(value)
            self._set(self.values, (i, name), value)

    def value(self, i: int, name: str):
        return self._slot(self.values, (i, name)).get()

    def finals(self, i: int) -> list:
        values = [self.value(i, n) for n in self.programs[i].plan.graph_outputs]
        if self.streamed:  # for the loss, on the last stage's stream
            arrived(values)
        return values

    # -- backward ------------------------------------------------------------
    def output_grads(self, stage: int, i: int) -> list:
        grads = [self._slot(self.grads, (i, n)).get() if self.needs_grad.get((i, n)) else None
                 for n in self.programs[i].stages[stage].output_names]
        if self.streamed:
            arrived(grads)
        return grads

    def send_input_grads(self, stage: int, i: int, grads: list) -> None:
        if self.streamed:
            mark_ready(grads)
        for name, g in zip(self.programs[i].stages[stage].input_names, grads):
            if self.needs_grad.get((i, name)):  # else no one waits for it
                self.contribute(i, name, stage, g)

    def send_final_grads(self, i: int, grads: list) -> None:
        if self.streamed:  # made on the caller's stream (pipe(x)'s backward) or the last stage's (pipe.step)
            mark_ready(grads)
        summed: dict[str, torch.Tensor | None] = {}  # a value the model returns twice gets one gradient
        for name, g in zip(self.programs[i].plan.graph_outputs, grads):
            summed[name] = sum_grads([summed.get(name), g])
        for name, g in summed.items():
            self.contribute(i, name, OUTPUT, g)

    def contribute(self, i: int, name: str, who: int, grad: torch.Tensor | None) -> None:
        """One reader's gradient for a value; summed in a fixed order once every reader answered."""
        with self.lock:
            parts = self.grad_parts.setdefault((i, name), {})
            parts[who] = grad
            if len(parts) < self.programs[i].readers.get(name, 1):
                return
            del self.grad_parts[(i, name)]
        ordered = [g for _, g in sorted(parts.items(), key=lambda kv: kv[0])]
        if self.streamed and len(ordered) > 1:  # summed on this task's stream: the other readers' parts waited for
            arrived(ordered)
            total = sum_grads(ordered)
            mark_ready([total])
        else:
            total = sum_grads(ordered)
        self._set(self.grads, (i, name), total)

    def grad(self, i: int, name: str) -> torch.Tensor | None:
        """The summed gradient of a graph input (after the backward phase)."""
        slot = self.grads.get((i, name))
        return slot.value if slot is not None and slot.done else None

    # -- failure ----------------------------------------------------------------
    def abort(self) -> None:
        """Wake every task waiting on a value that will never come."""
        with self.lock:
            self.aborted = True
            pending = [(table, key) for table in (self.values, self.grads)
                       for key, slot in table.items() if not slot.done]
        for table, key in pending:
            self._set(table, key, error=StageFailure("another task of this step failed"))


def run_on_workers(workers: Sequence[Worker], jobs: Sequence[Callable[[], None]], mailbox: Mailbox) -> None:
    """Run one job per worker; the first failure aborts the others and is raised as it was."""
    failure: list[BaseException] = []

    def guarded(job):
        def run():
            try:
                job()
            except BaseException as e:
                if not isinstance(e, StageFailure):
                    failure.append(e)
                mailbox.abort()
                raise
        return run

    futures = [w.submit(guarded(job)) for w, job in zip(workers, jobs)]
    try:
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
            if any(f.done() and f.exception() is not None for f in futures):
                break
        wait(futures)
    except KeyboardInterrupt:
        mailbox.abort()
        wait(futures)
        raise
    if failure:
        raise failure[0]
    for f in futures:
        if f.exception() is not None:
            raise f.exception()
