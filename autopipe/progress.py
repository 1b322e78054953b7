"""Compile progress: each pass reports its seconds and what it did to the ``autopipe`` logger (start at DEBUG,
end at INFO), and to stderr with ``verbose=True``; the seconds stay on the Plan (``plan.pass_seconds``). Every pass
runs under ``Progress.run``: the one place where an exception escaping a pass becomes autopipe's."""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Iterator

import torch

from autopipe.passes.diagnostics import failures_named

logger = logging.getLogger("autopipe")


class Progress:
    def __init__(self, verbose: bool = False):
        self.verbose = verbose
        self.seconds: dict[str, float] = {}

    def say(self, message: str, level: int = logging.INFO) -> None:
        logger.log(level, message)
        if self.verbose and level >= logging.INFO:
            print(f"autopipe: {message}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def run(self, name: str, model: torch.nn.Module | None = None) -> Iterator[dict[str, str]]:
        """``with progress.run("trace", model) as report: ...; report["detail"] = "fx, 120 nodes"``. An exception
        that escapes the pass leaves it as autopipe's, naming the pass and ``model``'s line (``failures_named``)."""
        self.say(f"{name} ...", logging.DEBUG)
        report: dict[str, str] = {}
        start = time.perf_counter()
        with failures_named(name, model):
            yield report
        seconds = time.perf_counter() - start
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.say(f"{name:<9} {seconds:7.3f} s" + (f"  ({report['detail']})" if report.get("detail") else ""))
