"""The torch.distributed transport: point-to-point sends of each cross-cut value to the rank that reads it.

One stage per rank (v with the interleaved schedule). The receives of a task
are posted a few tasks before it runs, so data lands while the rank computes;
each output is sent with a non-blocking send as soon as it exists;
the executor (runtime/executor.py) decides the order of the work from the
Schedule. Tags are unique per (edge, micro-batch, direction), which gloo
matches on. (NCCL ignores tags and matches per peer pair in order: a NCCL
transport must post in the peer's send order; not built, see README.)

Failures (measured on gloo, torch 2.13; notes/distributed.md):

* A rank whose stage, loss or communication raises writes "<who failed,
  where, the exception>" to the store key ``failed`` (compare-and-set: the
  first failure wins), wakes every rank's watchdog through the store, then
  *poisons* its own gloo context: a receive that times out after 1 ms makes
  gloo close every pair of that context. Each peer blocked on that rank fails
  at once with "Connection closed by peer", and the watchdog of every other
  rank poisons its own context when it sees the key. Every rank raises
  :class:`PipelineError` with the first failure's message (naming the rank).
* A rank killed with SIGKILL writes nothing, but the kernel closes its
  sockets: its peers fail with "Connection closed by peer" and report it lost.
* A rank that hangs is caught only by ``timeout``: every wait is bounded by it.
* Each step ends with a barrier: a step returns on a rank only if it completed
  on every rank. After a failure the process group is unusable: exit, as
  torchrun's elastic restart expects.
"""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .executor import Transport
from .schedule import Task
from .wire import Edge, WireSpec

_POISON_TAG = 0x7FFF_FFF0  # a tag no real message uses
LOOKAHEAD = 2  # tasks whose receives are posted ahead of the one running


class PipelineError(RuntimeError):
    """A pipeline step failed on some rank; the message names the rank that failed first."""


class _CommError(RuntimeError):
    def __init__(self, what: str, peer: int, err: BaseException) -> None:
        super().__init__(f"{what}: {err}")
        self.what, self.peer, self.err = what, peer, err


class P2PTransport(Transport):
    """This rank's end of the pipeline's messages (see module docstring).

    The rank holds ``stages`` (one, or v for the interleaved schedule: stage s lives on rank s % world).
    A value whose reader is on the same rank, or its gradient, is handed over in memory."""

    def __init__(self, spec: WireSpec, stages: dict[int, Any], *, group: dist.ProcessGroup, timeout: float,
                 name: str) -> None:
        self.spec, self.stages = spec, stages
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if spec.n_stages % self.world or sorted(stages) != list(range(self.rank, spec.n_stages, self.world)):
            raise ValueError(f"rank {self.rank} of {self.world} cannot hold stages {sorted(stages)} of a "
                             f"{spec.n_stages}-stage plan (stage s runs on rank s % {self.world})")
        self.timeout = timedelta(seconds=timeout)
        self._tags = {e.name: k for k, e in enumerate(spec.edges)}
        self._edges = {e.name: e for e in spec.edges}
        # remote values this rank reads, each received once and waited for by its first local reader
        self._in = {e.name: e for t in sorted(stages) for e in spec.into(t) if not self._local(e.src)}
        self._first_reader = {n: min(d for d in e.dsts if self._local(d)) for n, e in self._in.items()}
        base = dist.distributed_c10d._get_default_store()
        self._store = dist.PrefixStore(name, base)
        self._failed: str | None = None   # set once this pipeline is dead
        self._remote: str | None = None   # set by the watchdog: another rank's report
        # Own store clients (own TCP connections): one the watchdog blocks in, one with a short
        # timeout for failure reports.
        self._wstore = self._store.clone()
        self._rstore = self._store.clone()
        self._rstore.set_timeout(timedelta(seconds=5))
        # Clear a stale wake-up before the spec check, which no rank leaves before every rank has
        # entered it: no failure report can be lost.
        self._store.delete_key(f"wake/{self.rank}")
        self._check_spec()
        self._steps = 0
        self._poisoned = False
        self._poison_lock = threading.Lock()
        self._wd_stop = threading.Event()
        self._wd = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True) if self.world > 1 else None
        if self._wd is not None:
            self._wd.start()

    def _local(self, stage: int) -> bool:
        return stage % self.world == self.rank

    def _check_spec(self) -> None:
        mine = self.spec.digest()
        self._store.set(f"spec/{self.rank}", mine)
        for q in range(self.world):
            theirs = self._store.get(f"spec/{q}").decode()
            if theirs != mine:
                raise ValueError(f"rank {self.rank}: rank {q} planned a different pipeline ({theirs} != {mine}); "
                                 f"call compile and step with the same model and arguments on every rank")

    # -- one step --------------------------------------------------------------
    def start_step(self, local: list[dict[str, Any]], sizes: Sequence[int], order: Sequence[Task]) -> None:
        """``local[i]``: the graph inputs of micro-batch i by name; ``order``: this rank's tasks in the order
        they run. Receives are posted a few tasks ahead of the task that reads them, so data lands while the
        rank computes, yet a 1F1B rank holds buffers for the micro-batches in flight, not for all M."""
        self.local, self.sizes, self.order = local, list(sizes), list(order)
        self.outputs: list[dict[str, Any]] = [{} for _ in sizes]
        self.final_grads: list[dict[str, Any]] = [{} for _ in sizes]
        self.sends: list = []
        self.received: list[dict[str, torch.Tensor]] = [{} for _ in sizes]
        # the gradient each reader stage sends back for a value a local stage made, by (name, reader)
        self.grads: list[dict[tuple[str, int], Any]] = [{} for _ in sizes]
        self.posted: dict[tuple[str, int, int], list] = {}
        self._position = {(t.kind, t.stage, t.micro_batch): k for k, t in enumerate(self.order)}
        self._next_to_post = 0

    def _receive(self, kind: str, stage: int, i: int) -> None:
        """Wait for a task's messages, first posting the receives of the tasks up to LOOKAHEAD after it."""
        through = min(len(self.order), self._position[(kind, stage, i)] + 1 + LOOKAHEAD)
        while self._next_to_post < through:
            self._post_receives(self.order[self._next_to_post])
            self._next_to_post += 1
        self._wait(self.posted.pop((kind, stage, i), []))  # a gloo work must not be waited on twice

    def _post_receives(self, task: Task) -> None:
        i, rows, ops = task.micro_batch, self.sizes[task.micro_batch], []
        if task.kind == "F":
            for n, e in self._in.items():
                if self._first_reader[n] == task.stage:
                    self.received[i][n] = buf = e.empty(rows)
                    r = e.src % self.world
                    ops.append(("recv", buf, r, self._tag(e, i, None), f"receive {n!r} mb {i} from rank {r}"))
        else:
            for e in self.spec.out_of(task.stage):
                for d in (d for d in e.dsts if e.grad and not self._local(d)):
                    self.grads[i][(e.name, d)] = buf = e.empty(rows)
                    r = d % self.world
                    ops.append(("recv", buf, r, self._tag(e, i, d), f"receive grad of {e.name!r} mb {i} from rank {r}"))
        self.posted[(task.kind, task.stage, i)] = self._post(ops)

    def _value(self, i: int, name: str) -> Any:
        if name in self.local[i]:
            return self.local[i][name]
        if name in self.outputs[i]:
            return self.outputs[i][name]
        return self._edges[name].from_wire(self.received[i][name])

    def inputs(self, stage: int, i: int):
        self._receive("F", stage, i)
        names = self.stages[stage].input_names
        return [self._value(i, n) for n in names], [n in self._edges and self._edges[n].grad for n in names]

    def send_outputs(self, stage: int, i: int, outputs: list) -> None:
        produced = dict(zip(self.stages[stage].output_names, outputs))
        self.outputs[i].update(produced)
        ops = []
        for e in self.spec.out_of(stage):
            payload = e.to_wire(produced[e.name])
            for r in sorted({d % self.world for d in e.dsts} - {self.rank}):
                ops.append(("send", payload, r, self._tag(e, i, None), f"send {e.name!r} mb {i} to rank {r}"))
        self.sends += self._post(ops)

    def finals(self, i: int) -> list:  # after the last stage's forward, which received them
        return [self._value(i, n) for n in self.spec.graph_outputs]

    def send_final_grads(self, i: int, grads: list) -> None:
        self.final_grads[i] = dict(zip(self.spec.graph_outputs, grads))

    def output_grads(self, stage: int, i: int) -> list:
        """The loss's gradient (last stage), then each reader stage's, in stage order: a fixed sum."""
        self._receive("B", stage, i)
        last = stage == self.spec.n_stages - 1
        grads = []
        for name in self.stages[stage].output_names:
            total = self.final_grads[i].get(name) if last else None
            edge = self._edges.get(name)
            for d in edge.dsts if edge is not None and edge.grad else ():
                g = self.grads[i].get((name, d))
                if g is not None:
                    total = g if total is None else total + g
            grads.append(total)
        return grads

    def send_input_grads(self, stage: int, i: int, grads: list) -> None:
        mine = dict(zip(self.stages[stage].input_names, grads))
        last = stage == self.spec.n_stages - 1
        ops = []
        for e in self.spec.into(stage):
            if not e.grad:
                continue
            g = mine.get(e.name)
            final = self.final_grads[i].get(e.name) if last else None  # a model output made earlier, read by the loss here
            if final is not None:
                g = final if g is None else g + final
            if self._local(e.src):
                self.grads[i][(e.name, stage)] = g
                continue
            g = torch.zeros(e.info.micro_batch_shape(self.sizes[i]), dtype=e.info.dtype) if g is None else g
            r = e.src % self.world
            ops.append(("send", g.contiguous(), r, self._tag(e, i, stage), f"send grad of {e.name!r} mb {i} to rank {r}"))
        self.sends += self._post(ops)

    def finish_step(self) -> None:
        """Wait for this rank's sends, then for every rank: a step returns only if it completed everywhere."""
        self._wait(self.sends)
        self.sends = []
        if self.world > 1:
            # A barrier cannot say which peer broke it: each rank marks its step done in the store
            # first, so a failed barrier names the ranks that never got there.
            self._steps += 1
            self._rstore.set(f"done/{self._steps}/{self.rank}", "1")
            try:
                dist.barrier(group=self.group, async_op=True).wait(self.timeout)
            except RuntimeError as err:
                missing = [q for q in range(self.world) if not self._done(q)]
                raise _CommError("the end-of-step barrier", missing[0] if missing else -1, err) from err

    def _done(self, rank: int) -> bool:
        try:
            return self._rstore.check([f"done/{self._steps}/{rank}"])
        except Exception:  # noqa: BLE001 - store unreachable
            return False

    def run(self, step: Callable[[], Any]) -> Any:
        """Run one step; any failure is reported to every rank and raised as PipelineError."""
        if self._failed is not None:
            raise PipelineError(f"pipeline is dead after an earlier failure: {self._failed}")
        if self._remote is not None:
            self._failed = self._remote
            raise PipelineError(f"pipeline step failed: {self._remote}")
        try:
            return step()
        except PipelineError:
            raise
        except Exception as err:
            raise self._fail(err) from err
        except BaseException as err:  # KeyboardInterrupt, SystemExit: still tell the others
            self._fail(err)
            raise

    # -- messages --------------------------------------------------------------
    def _tag(self, e: Edge, i: int, reader: int | None) -> int:
        """Unique per (edge, micro-batch, direction; the reader stage for a gradient)."""
        kind = 0 if reader is None else reader + 1
        return ((self._tags[e.name] * len(self.sizes) + i) * (self.spec.n_stages + 1)) + kind

    def _post(self, ops: list[tuple[str, torch.Tensor, int, int, str]]) -> list[tuple[Any, int, str]]:
        """Post ("send"|"recv", tensor, peer, tag, what) ops; returns [(work, peer, what)]."""
        try:
            works = [(self.group.send([t], p, tag) if k == "send" else self.group.recv([t], p, tag))
                     for k, t, p, tag, _ in ops]
        except RuntimeError as err:
            raise _CommError(f"posting {ops[0][4]}", ops[0][2], err) from err
        return [(w, p, what) for w, (_, _, p, _, what) in zip(works, ops)]

    def _wait(self, posted: Sequence[tuple[Any, int, str]]) -> None:
        for w, peer, what in posted:
            try:
                w.wait(self.timeout)
            except RuntimeError as err:
                raise _CommError(what, peer, err) from err

    # -- failure handling ------------------------------------------------------
    def _poison(self) -> None:
        """Make gloo close every pair of this rank's context, so each peer blocked on us fails now."""
        with self._poison_lock:
            if self._poisoned or self.world < 2:
                return
            self._poisoned = True
        try:
            self.group.recv([torch.empty(1)], (self.rank + 1) % self.world, _POISON_TAG).wait(timedelta(milliseconds=1))
        except RuntimeError:
            pass  # the expected "Timed out waiting 1ms": the context is now closed

    def _watch(self) -> None:
        """Sleeps in a store wait until some rank reports a failure (or the store dies), then
        poisons this rank's context so the main thread's pending wait fails now."""
        store, key = self._wstore, f"wake/{self.rank}"
        while not self._wd_stop.is_set():
            try:
                store.wait([key], timedelta(seconds=3600))  # event-driven; each expiry logs a c10d warning
            except dist.DistStoreError:
                continue
            except Exception as err:  # noqa: BLE001 - the store is gone: its host died
                if self._wd_stop.is_set():
                    return
                self._remote = (f"rank {self.rank} lost the rendezvous store ({type(err).__name__}); the rank "
                                "hosting it (rank 0 with a tcp:// init_method) probably died")
                self._poison()
                return
            if self._wd_stop.is_set():
                return
            try:
                if not store.check(["failed"]):
                    store.delete_key(key)  # a stray wake-up (a closed earlier pipeline)
                    continue
                self._remote = store.get("failed").decode()
            except Exception as err:  # noqa: BLE001
                self._remote = f"another rank failed (its report is unreadable: {err})"
            self._poison()
            return

    def _report(self, msg: str) -> tuple[str, bool]:
        """Publish ``msg`` unless a failure was reported first: (the first report, store reachable)."""
        try:
            first = self._rstore.compare_set("failed", "", msg).decode() or msg
            self._rstore.multi_set([f"wake/{q}" for q in range(self.world)], ["1"] * self.world)
            return first, True
        except Exception:  # noqa: BLE001 - store unreachable: keep our own message
            return msg, False

    def _describe(self, err: BaseException) -> str:
        if not isinstance(err, _CommError):
            where = getattr(err, "_autopipe_where", "the step")
            return f"rank {self.rank} failed in {where}: {type(err).__name__}: {err}"
        text = str(err.err)
        if "Timed out" in text:
            return (f"rank {self.rank}: {err.what} timed out after {self.timeout.total_seconds():g} s: "
                    f"rank {err.peer} is hung or far too slow")
        who = f"rank {err.peer}" if err.peer >= 0 else "a rank"
        return (f"rank {self.rank}: {err.what} failed: {who} closed its connections "
                f"(it died, or failed itself) [{type(err.err).__name__}: {text.splitlines()[0][:200]}]")

    def _fail(self, err: BaseException) -> PipelineError:
        mine = self._describe(err)
        first, reachable = self._report(self._remote or mine)
        self._poison()
        if not reachable:
            first = mine = ("the rendezvous store is unreachable, so the rank hosting it (rank 0 with a tcp:// "
                            f"init_method) probably died or exited; rank {self.rank} saw: {mine}")
        self._failed = first
        if first == mine:
            return PipelineError(f"pipeline step failed: {first}")
        return PipelineError(f"pipeline step failed: {first} [seen from rank {self.rank} as: {mine}]")

    def close(self) -> None:
        """Stop the watchdog (the pipeline stays usable only if nothing failed)."""
        self._wd_stop.set()
        if self._wd is not None and self._failed is None:
            try:
                self._store.set(f"wake/{self.rank}", "close")
                self._wd.join(timeout=5)
                self._store.delete_key(f"wake/{self.rank}")
            except Exception:  # noqa: BLE001
                pass
