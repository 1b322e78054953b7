"""One worker thread per device: runs its stage's tasks in schedule order.

Threads, not processes, for the in-process transport: stages share the
model's Parameter objects and the autograd graph of the caller. On CPU each
worker is its own "device" and sets its own intra-op thread count when it
starts (ATen keeps the OpenMP thread count per thread; a new thread takes the
last value set anywhere), so K workers with cores // K threads each do not
oversubscribe the cores, and the caller's own thread count is left alone.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch


class Worker:
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
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.intra_op_threads:
            torch.set_num_threads(self.intra_op_threads)
        while True:
            item = self._tasks.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller, who re-raises it
                future.set_exception(e)
                del e
            del item, fn, future  # the task closure holds the step; let the pipeline be collected

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
