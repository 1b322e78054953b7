"""The torch.distributed transport: each cross-cut value sent point to point to the rank that reads it. Tags,
posting order and failure reports: docs/architecture.md, "Under torchrun"; measured in notes/distributed.md."""
from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autopipe.ir.schedule import Schedule, Task

from .executor import Transport, run_tasks
from .gradients import sum_grads
from .wire import Edge, ReceiveBuffers, WireSpec

_POISON_TAG = 0x7FFF_FFF0  # a tag no real message uses
# Note [receives two tasks ahead]: a task's receives are posted two tasks before it runs: data lands while the
# rank computes, yet a 1F1B rank holds buffers only for the micro-batches in flight (posting every receive up
# front held all M).
LOOKAHEAD = 2  # tasks whose receives are posted ahead of the one running


class PipelineError(RuntimeError):
    """A pipeline step failed on some rank; the message names the rank that failed first."""


class _CommError(RuntimeError):
    """A send, receive or barrier that failed, described from this rank (``_comm_error``)."""


class P2PTransport(Transport):
    """This rank's end of the pipeline's messages; it holds ``stages`` (stage s lives on rank ``rank_of(s)``: s % world,
    or zbv's V). A value whose reader is on the same rank, or its gradient, is handed over in memory."""

    def __init__(self, spec: WireSpec, stages: dict[int, Any], *, group: dist.ProcessGroup, timeout: float,
                 name: str, downward: dist.ProcessGroup | None = None,
                 rank_of: Callable[[int], int] | None = None) -> None:
        self.spec, self.stages, self.group = spec, stages, group
        self.downward = downward or group  # carries the messages to a lower rank (NCCL: distributed.py)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.rank_of = rank_of or (lambda stage: stage % self.world)
        # NCCL moves device memory; gloo host memory, so a CUDA rank stages its messages in pinned host buffers
        device = next(iter(stages.values())).device
        self.nccl = device.type == "cuda" and "nccl" in str(dist.get_backend(group))
        self.wire_device, self.pinned = (device, False) if self.nccl else (torch.device("cpu"), device.type == "cuda")
        self.timeout = timedelta(seconds=timeout)
        self._store = dist.PrefixStore(name, dist.distributed_c10d._get_default_store())
        self._failed: str | None = None   # set once this pipeline is dead
        self._remote: str | None = None   # set by the watchdog: another rank's report
        # own store clients (own TCP connections): one the watchdog blocks in, one with a short timeout for reports
        self._wstore, self._rstore = self._store.clone(), self._store.clone()
        self._rstore.set_timeout(timedelta(seconds=5))
        # Clear a stale wake-up before the spec check, which no rank leaves before every rank has entered it: no failure
        # report can be lost.
        self._store.delete_key(f"wake/{self.rank}")
        self._specs: dict[str, int] = {}  # each spec this rank checked against the others, in order
        self._buffers = ReceiveBuffers()  # kept from step to step (Note [receive buffers reused])
        self.use(spec, stages)
        self._steps, self._poisoned = 0, False
        self._plans: dict[tuple[str, Schedule], tuple] = {}  # _messages per spec (its digest) and schedule
        self._poison_lock = threading.Lock()
        self._wd_stop = threading.Event()
        self._wd = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        if self.world > 1:
            self._wd.start()

    def use(self, spec: WireSpec, stages: dict[int, Any]) -> None:
        """Carry the messages of ``spec`` between ``stages`` from the next step on: one spec per compiled program (an
        input signature). Every rank checks a new spec against every other's before any message of it is sent."""
        self.spec, self.stages = spec, stages
        self._tags = {e.name: k for k, e in enumerate(spec.edges)}
        self._edges = {e.name: e for e in spec.edges}
        # remote values this rank reads, each received once, by its first local reader
        self._in = {e.name: e for t in sorted(stages) for e in spec.into(t) if not self._local(e.src)}
        self._first_reader = {n: min(d for d in e.dsts if self._local(d)) for n, e in self._in.items()}
        # Note [a step lets go of each value once read]: how often a micro-batch's value is read here (each local
        # reader, and the loss on the last stage); after the last read the step holds it no longer, so a received
        # buffer returns to the pool once the stage is done with it, and the step keeps no tensor past its use (a
        # gradient once read, a send once complete) to split the heap between micro-batches.
        self._reads: dict[str, int] = {}
        for t in stages:
            for n in stages[t].input_names:
                self._reads[n] = self._reads.get(n, 0) + 1
        for n in spec.graph_outputs if self._local(spec.n_stages - 1) else ():
            self._reads[n] = self._reads.get(n, 0) + 1
        self._digest = mine = spec.digest()
        if mine in self._specs:
            return
        self._specs[mine] = k = len(self._specs)
        self._store.set(f"spec/{k}/{self.rank}", mine)
        for q in range(self.world):
            if (theirs := self._store.get(f"spec/{k}/{q}").decode()) != mine:
                raise ValueError(f"rank {self.rank}: rank {q} planned a different pipeline ({theirs} != {mine}); "
                                 f"call compile and step with the same model and arguments on every rank")

    def _local(self, stage: int) -> bool:
        return self.rank_of(stage) == self.rank

    def run(self, local: list[dict[str, Any]], sizes: Sequence[int], schedule: Schedule,
            runners: Callable[[Task], Any], state: Any, loss: Any) -> None:
        """One step: ``local[i]`` holds micro-batch i's graph inputs by name. Any failure is reported to every rank and
        raised as PipelineError."""
        if self._failed is not None:
            raise PipelineError(f"pipeline is dead after an earlier failure: {self._failed}")
        if self._remote is not None:
            self._failed = self._remote
            raise PipelineError(f"pipeline step failed: {self._remote}")
        self.sizes = list(sizes)
        # graph inputs, outputs made here, buffers received: each until its last read here
        self.values = [{n: v for n, v in row.items() if n in self._reads} for row in local]
        self.unread = [dict(self._reads) for _ in sizes]
        self.grads: list[dict[tuple[str, int], Any]] = [{} for _ in sizes]  # by (value, reader stage)
        self.final_grads: list[dict[str, Any]] = [{} for _ in sizes]  # the loss's, by model output
        self.sends: list = []
        self._buffers.forget_held()  # after the last step's values are let go of
        plan_key = (self._digest, schedule)
        if plan_key not in self._plans:
            self._plans[plan_key] = self._messages(schedule)
        self.order, self.reading, self.needs, self.peer_sends = self._plans[plan_key]
        self.posted: dict[tuple, tuple] = {}  # receives posted, by message
        self.cursor = {q: 0 for q in self.peer_sends}  # how far each peer's sends have matching receives
        try:
            run_tasks(self.order, runners, self, state, loss)
            self._finish_step()
        except PipelineError:
            raise
        except Exception as err:
            raise self._fail(err) from err
        except BaseException as err:  # KeyboardInterrupt, SystemExit: still tell the others
            self._fail(err)
            raise

    # Note [posting order per peer]: gloo matches messages by tag, unique per (value, micro-batch, direction, reader);
    # NCCL ignores tags and matches per peer pair in posting order. So each rank posts its receives from a peer in the
    # order that peer posts its sends, computed once per schedule from the schedule and the wire spec every rank
    # shares (posting in this rank's own task order did not agree for a skip). A reader whose input got no gradient
    # sends zeros, so the message pattern never depends on data.
    def _messages(self, schedule: Schedule) -> tuple[list[Task], list[Task], dict[tuple, tuple[int, list]], dict]:
        """This rank's tasks; those that read messages (F and B: a W reads none); per such task, its place among them
        and the messages it reads; what each peer sends this rank, in the order it posts those sends. A message is
        ("F", value, mb) or ("B", value, mb, reader stage); Note [posting order per peer]."""
        order = schedule.device_order(self.rank)
        reading = [t for t in order if t.kind != "W"]
        needs: dict[tuple, tuple[int, list]] = {}
        for k, t in enumerate(reading):
            i = t.micro_batch
            if t.kind == "F":
                read = [("F", n, i) for n, first in self._first_reader.items() if first == t.stage]
            else:
                read = [("B", e.name, i, d) for e in self.spec.out_of(t.stage) if e.grad
                        for d in e.dsts if not self._local(d)]
            needs[(t.kind, t.stage, i)] = (k, read)
        peer_sends: dict[int, list] = {q: [] for q in range(self.world) if q != self.rank}
        for q, sends in peer_sends.items():  # as send_outputs and send_input_grads post them on rank q
            for t in schedule.device_order(q):
                if t.kind == "F":
                    sends += [("F", e.name, t.micro_batch)
                              for e in self.spec.out_of(t.stage) if any(self._local(d) for d in e.dsts)]
                elif t.kind == "B":
                    sends += [("B", e.name, t.micro_batch, t.stage) for e in self.spec.into(t.stage) if e.grad
                              and self._local(e.src)]
        return order, reading, needs, peer_sends

    def _receive(self, kind: str, stage: int, i: int) -> None:
        """Wait for a task's messages. Receives are posted for the tasks up to LOOKAHEAD after it, and from each
        peer in the order that peer posts its sends: NCCL matches a pair's messages in posting order."""
        at, reads = self.needs[(kind, stage, i)]
        for task in self.reading[at:at + 1 + LOOKAHEAD]:
            for message in self.needs[(task.kind, task.stage, task.micro_batch)][1]:
                peer = self.rank_of(self._edges[message[1]].src if message[0] == "F" else message[3])
                while message not in self.posted:
                    self._post_receive(peer, self.peer_sends[peer][self.cursor[peer]])
                    self.cursor[peer] += 1
        self._wait([self.posted.pop(m) for m in reads])  # a work is waited on once

    def _post_receive(self, peer: int, message: tuple) -> None:
        edge, i = self._edges[message[1]], message[2]
        buffer = self._buffers.take(edge, self.sizes[i], self.wire_device, self.pinned)  # where the backend writes it
        reader = message[3] if message[0] == "B" else None
        if reader is None:
            self.values[i][edge.name] = buffer
        else:
            self.grads[i][(edge.name, reader)] = buffer
        what = f"{edge.name!r} mb {i}" if reader is None else f"grad of {edge.name!r} mb {i}"
        self.posted[message] = self._post(False, buffer, peer, self._tag(edge, i, reader), what)

    def _value(self, i: int, name: str) -> Any:
        """A value's read: the last one here takes it from the step (Note [a step lets go of each value once read])."""
        self.unread[i][name] -= 1
        value = self.values[i][name] if self.unread[i][name] else self.values[i].pop(name)
        return self._in[name].from_wire(value) if name in self._in else value

    def inputs(self, stage: int, i: int):
        self._receive("F", stage, i)
        names = self.stages[stage].input_names
        return [self._value(i, n) for n in names], [n in self._edges and self._edges[n].grad for n in names]

    def send_outputs(self, stage: int, i: int, outputs: list) -> None:
        produced = dict(zip(self.stages[stage].output_names, outputs))
        self.values[i].update((n, v) for n, v in produced.items() if n in self._reads)  # what is read here
        self._let_go_of_sent()
        for e in self.spec.out_of(stage):
            payload = e.to_wire(produced[e.name])
            for r in sorted({self.rank_of(d) for d in e.dsts} - {self.rank}):
                self.sends.append(self._post(True, payload, r, self._tag(e, i, None), f"{e.name!r} mb {i}"))

    def finals(self, i: int) -> list:  # after the last stage's forward, which received them
        return [self._value(i, n) for n in self.spec.graph_outputs]

    def send_final_grads(self, i: int, grads: list) -> None:
        self.final_grads[i] = {}
        for name, g in zip(self.spec.graph_outputs, grads):  # a value the model returns twice: one sum
            self.final_grads[i][name] = sum_grads([self.final_grads[i].get(name), g])

    def output_grads(self, stage: int, i: int) -> list:
        """The loss's gradient (last stage), then each reader stage's, in stage order: a fixed sum."""
        self._receive("B", stage, i)
        last = stage == self.spec.n_stages - 1
        grads = []
        for name in self.stages[stage].output_names:  # each taken: read once
            readers = self._edges[name].dsts if name in self._edges else ()
            grads.append(sum_grads([self.final_grads[i].pop(name, None) if last else None]
                                   + [self.grads[i].pop((name, d), None) for d in readers]))
        return grads

    def send_input_grads(self, stage: int, i: int, grads: list) -> None:
        mine = dict(zip(self.stages[stage].input_names, grads))
        last = stage == self.spec.n_stages - 1
        for e in self.spec.into(stage):
            if not e.grad:
                continue
            # on the last stage, a model output made earlier also has the loss's gradient
            g = sum_grads([mine.get(e.name), self.final_grads[i].pop(e.name, None) if last else None])
            if self._local(e.src):
                self.grads[i][(e.name, stage)] = g
                continue
            g = e.empty(self.sizes[i], self.wire_device, self.pinned).zero_() if g is None else g.contiguous()
            what = f"grad of {e.name!r} mb {i}"
            self._let_go_of_sent()
            self.sends.append(self._post(True, g, self.rank_of(e.src), self._tag(e, i, stage), what))

    def _let_go_of_sent(self) -> None:
        """Forget the sends that completed (a failed one raises here), so the step holds no tensor it sent (Note [a
        step lets go of each value once read])."""
        pending, done = [], []
        for sent in self.sends:
            (done if sent[0].is_completed() else pending).append(sent)
        self.sends = pending
        self._wait(done)

    def _finish_step(self) -> None:
        """Wait for this rank's sends, then for every rank: a step returns only if it completed everywhere."""
        self._wait(self.sends)
        if self.world > 1:
            # A barrier cannot say which peer broke it: each rank first marks its step done in the store, so a failed
            # one names the ranks that never got there.
            self._steps += 1
            self._rstore.set(f"done/{self._steps}/{self.rank}", "1")
            try:
                dist.barrier(group=self.group, async_op=True).wait(self.timeout)
            except RuntimeError as err:
                missing = [q for q in range(self.world) if not self._done(q)]
                raise self._comm_error("the end-of-step barrier", missing[0] if missing else -1, err) from err

    def _done(self, rank: int) -> bool:
        try:
            return self._rstore.check([f"done/{self._steps}/{rank}"])
        except Exception:  # noqa: BLE001 - store unreachable
            return False

    def _tag(self, e: Edge, i: int, reader: int | None) -> int:
        """Unique per (edge, micro-batch, direction; the reader stage for a gradient)."""
        kind = 0 if reader is None else reader + 1
        return ((self._tags[e.name] * len(self.sizes) + i) * (self.spec.n_stages + 1)) + kind

    def _post(self, send: bool, tensor: torch.Tensor, peer: int, tag: int, what: str) -> tuple[Any, int, str]:
        """Post one send to (or receive from) rank ``peer``: (work, peer, what it is)."""
        what = f"send {what} to rank {peer}" if send else f"receive {what} from rank {peer}"
        tensor = self._on_wire(tensor)
        try:
            group = self.downward if (peer < self.rank) == send else self.group
            return (group.send if send else group.recv)([tensor], peer, tag), peer, what
        except RuntimeError as err:
            raise self._comm_error(f"posting {what}", peer, err) from err

    def _on_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` where the backend reads it: on the GPU for NCCL, else on the host (pinned for a CUDA rank)."""
        if not self.pinned or tensor.is_pinned():
            return tensor.to(self.wire_device)
        return torch.empty_like(tensor, device="cpu", pin_memory=True).copy_(tensor)

    def _wait(self, posted: Sequence[tuple[Any, int, str]]) -> None:
        for work, peer, what in posted:
            try:
                work.wait(self.timeout)
            except RuntimeError as err:
                raise self._comm_error(what, peer, err) from err

    # Note [failure ends every rank]: the first failure wins a compare-and-set on the store key "failed", wakes every
    # rank's watchdog through wake/<rank> keys, then poisons its own gloo context (a 1 ms receive timeout makes gloo
    # close every pair), so a blocked peer fails at once; over NCCL, ProcessGroup.abort(). A SIGKILLed rank writes
    # nothing, but the kernel closes its sockets; a hung rank is caught only by timeout. Each step ends with a barrier
    # after done/<step>/<rank> marks, so a broken barrier names the missing rank.
    def _poison(self) -> None:
        """Make gloo close every pair of this rank's context (a receive timing out after 1 ms does), so each peer
        blocked on us fails now (Note [failure ends every rank])."""
        with self._poison_lock:
            if self._poisoned or self.world < 2:
                return
            self._poisoned = True
        if self.nccl:  # aborting the communicators fails every pending NCCL operation
            for group in {self.group, self.downward}:
                group.abort()
            return
        with contextlib.suppress(RuntimeError):  # the expected "Timed out waiting 1ms": the context is now closed
            self.group.recv([torch.empty(1)], (self.rank + 1) % self.world, _POISON_TAG).wait(timedelta(milliseconds=1))

    def _watch(self) -> None:
        """Waits in the store until some rank reports a failure (or the store dies), then poisons this rank's context:
        the main thread's wait fails now."""
        store, key = self._wstore, f"wake/{self.rank}"
        while not self._wd_stop.is_set():
            try:
                store.wait([key], timedelta(seconds=3600))  # event-driven; each expiry logs a c10d warning
            except dist.DistStoreError:
                continue
            except Exception as err:  # noqa: BLE001 - the store is gone: its host died
                report = (f"rank {self.rank} lost the rendezvous store ({type(err).__name__}); the rank "
                          "hosting it (rank 0 with a tcp:// init_method) probably died")
            else:  # a wake-up after close() finds no report and ends the loop
                try:
                    if not store.check(["failed"]):
                        store.delete_key(key)  # a stray wake-up (a closed earlier pipeline)
                        continue
                    report = store.get("failed").decode()
                except Exception as err:  # noqa: BLE001
                    report = f"another rank failed (its report is unreadable: {err})"
            if not self._wd_stop.is_set():
                self._remote = report
                self._poison()
            return

    def _comm_error(self, what: str, peer: int, err: RuntimeError) -> _CommError:
        text = str(err)
        if "Timed out" in text:
            return _CommError(f"rank {self.rank}: {what} timed out after {self.timeout.total_seconds():g} s: rank "
                              f"{peer} is hung or far too slow")
        who = f"rank {peer}" if peer >= 0 else "a rank"
        return _CommError(f"rank {self.rank}: {what} failed: {who} closed its connections (it died, or failed "
                          f"itself) [{type(err).__name__}: {text.splitlines()[0][:200]}]")

    def _fail(self, err: BaseException) -> PipelineError:
        """Publish this failure unless another came first (the first report wins), wake every rank, poison."""
        mine = str(err) if isinstance(err, _CommError) else (
            f"rank {self.rank} failed in {getattr(err, '_autopipe_where', 'the step')}: {type(err).__name__}: {err}")
        try:
            first = self._rstore.compare_set("failed", "", self._remote or mine).decode() or self._remote or mine
            self._rstore.multi_set([f"wake/{q}" for q in range(self.world)], ["1"] * self.world)
        except Exception:  # noqa: BLE001 - the store is unreachable
            first = mine = ("the rendezvous store is unreachable, so the rank hosting it (rank 0 with a tcp:// "
                            f"init_method) probably died or exited; rank {self.rank} saw: {mine}")
        self._poison()
        self._failed = first
        seen = "" if first == mine else f" [seen from rank {self.rank} as: {mine}]"
        return PipelineError(f"pipeline step failed: {first}{seen}")

    def close(self) -> None:
        """Stop the watchdog (the pipeline stays usable only if nothing failed)."""
        self._wd_stop.set()
        if self._wd.is_alive() and self._failed is None:
            with contextlib.suppress(Exception):
                self._store.set(f"wake/{self.rank}", "close")
                self._wd.join(timeout=5)
                self._store.delete_key(f"wake/{self.rank}")
