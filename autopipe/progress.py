"""Compile progress: each pass says when it starts and what it did, with its seconds.

A large model can spend seconds in tracing alone; a user should see which pass
is running rather than a silent prompt. Reports always go to the ``autopipe``
logger (start at DEBUG, end at INFO), and to stderr with ``verbose=True``
(``autopipe.compile(..., verbose=True)``, and always on the command line). The
seconds stay on the Plan (``plan.pass_seconds``), so a slow compile can be
diagnosed after the fact.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Iterator, TextIO

logger = logging.getLogger("autopipe")


class Progress:
    """Times the passes of one compile and reports them (see module docstring)."""

    def __init__(self, verbose: bool = False, stream: TextIO | None = None, seconds: dict[str, float] | None = None):
        self.verbose = verbose
        self.stream = stream
        self.seconds = {} if seconds is None else seconds  # pass a plan's pass_seconds to add to it

    def say(self, message: str, level: int = logging.INFO) -> None:
        logger.log(level, message)
        if self.verbose and level >= logging.INFO:
            print(f"autopipe: {message}", file=self.stream or sys.stderr, flush=True)

    @contextlib.contextmanager
    def run(self, name: str) -> Iterator[dict[str, str]]:
        """``with progress.run("trace") as report: ...; report["detail"] = "fx, 120 nodes"``."""
        self.say(f"{name} ...", logging.DEBUG)
        report: dict[str, str] = {}
        start = time.perf_counter()
        yield report
        seconds = time.perf_counter() - start
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        detail = report.get("detail")
        self.say(f"{name:<9} {seconds:7.3f} s" + (f"  ({detail})" if detail else ""))

    @property
    def total(self) -> float:
        return sum(self.seconds.values())
