"""A minimal GPipe transport over torch.distributed point-to-point (prototype).

Standalone on purpose (imports nothing else from autopipe): one process per
stage, one stage per rank. Everything the transport needs is static and known
on every rank in advance -- which tensors cross which cut, their per-micro-batch
shapes and dtypes -- so a step exchanges payload only: no shape handshakes, no
metadata messages.

    spec = PipeSpec(
        edges=[Edge("h", src=0, dsts=(1,), shape=(32, 512)),
               Edge("skip", src=0, dsts=(2,), shape=(32, 512))],   # skips rank 1
        stage_inputs=[("x",), ("h",), ("h2", "skip")],
        stage_outputs=[("h", "skip"), ("h2",), ("out",)],
        batch_size=1024, chunks=32)
    pipe = P2PGPipe(my_stage_module, spec)          # after init_process_group
    loss = pipe.step({"x": x} if rank == 0 else None,
                     target=y, loss_fn=F.mse_loss)  # loss on the last rank, else None

Schedule (GPipe): every rank posts all of the step's receives (activations and
gradients, all micro-batches) up front, so data lands while the rank computes;
then forward of micro-batches 0..M-1, each output sent with a non-blocking send
as soon as it exists; then backward in reverse order M-1..0, gradients of the
received inputs sent back the same way. The last rank computes
``loss_fn(*outputs_i, target_i) * size_i / batch_size`` per micro-batch; the
gradients accumulate into the stage's parameters (``.grad``), so after a step
they equal the unpipelined model's for the whole batch.

Failures (measured on gloo, torch 2.13; see notes/distributed.md):

* A rank whose stage, loss or communication raises writes
  ``"<who failed, where, the exception>"`` to the store key ``failed``
  (compare-and-set: the first failure wins, later ones are consequences), wakes
  every rank's watchdog through the store, then *poisons* its own gloo
  context: a receive that times out after 1 ms makes gloo close every pair of
  that context (``Application timeout caused pair closure``). Each peer blocked
  on that rank fails at once with ``Connection closed by peer``, and the
  watchdog thread of every other rank poisons its own context when it sees
  the key, so ranks blocked on anyone else fail as well. Each rank raises
  :class:`PipelineError` with the first failure's message (which names the
  rank). Detection takes milliseconds for a waiting rank; a rank busy
  computing notices at its next send/receive.
* A rank killed with SIGKILL writes nothing, but the kernel closes its
  sockets: the ranks talking to it fail with ``Connection closed by peer`` and
  report "rank k lost" in its place. If it hosted the TCPStore (rank 0 under
  ``init_method="tcp://..."`` and torchrun's static rendezvous), the
  watchdogs lose the store and poison too.
* A rank that hangs (deadlock, endless loop) without dying is caught only by
  ``timeout``: every wait is bounded by it, and gloo's own timeout handling
  poisons the context when it fires, so the hang turns into errors everywhere.
* Each step ends with a barrier (``confirm=True``): a step returns on a rank
  only if it completed on every rank.

After a failure the process group is unusable (its pairs are closed): destroy
it and start over, as torchrun's elastic restart does.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["Edge", "PipeSpec", "P2PGPipe", "PipelineError", "split_sizes"]

_POISON_TAG = 0x7FFF_FFF0  # a tag no real message uses


class PipelineError(RuntimeError):
    """A pipeline step failed on some rank; the message names the rank that failed first."""


def split_sizes(batch_size: int, chunks: int) -> list[int]:
    """Micro-batch sizes, as ``torch.tensor_split`` makes them (first ones one larger)."""
    q, r = divmod(batch_size, chunks)
    return [q + (i < r) for i in range(chunks)]


@dataclass(frozen=True)
class Edge:
    """One tensor that crosses from rank ``src`` to each rank in ``dsts``, once per micro-batch.

    ``shape`` is the tensor's shape for one micro-batch; its ``batch_dim`` entry
    is replaced by each micro-batch's size (so uneven splits work). Use
    ``batch_dim=None`` for a tensor whose shape is the same for every
    micro-batch. Gradients flow back along the edge iff ``requires_grad``
    (default: the dtype is floating point or complex); a receiver whose input
    got no gradient sends zeros, so the message pattern never depends on data.
    """

    name: str
    src: int
    dsts: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    batch_dim: int | None = 0
    requires_grad: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dsts", tuple(int(d) for d in self.dsts))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    @property
    def grad(self) -> bool:
        if self.requires_grad is not None:
            return self.requires_grad
        return self.dtype.is_floating_point or self.dtype.is_complex

    def mb_shape(self, size: int) -> tuple[int, ...]:
        if self.batch_dim is None:
            return self.shape
        s = list(self.shape)
        s[self.batch_dim] = size
        return tuple(s)


@dataclass(frozen=True)
class PipeSpec:
    """The static description of the whole pipeline, identical on every rank.

    ``stage_inputs[r]`` names the positional arguments of rank ``r``'s stage:
    each is an edge received from an earlier rank or a *local* input, i.e. a
    whole-batch tensor the caller passes to ``step`` on that rank and the
    transport splits into micro-batches along dim 0 (graph inputs go straight
    to the stages that use them). ``stage_outputs[r]`` names the tensors the
    stage returns, in order: edges with ``src == r`` or, on the last rank only,
    the final outputs handed to ``loss_fn(*finals, target)``.
    """

    edges: tuple[Edge, ...]
    stage_inputs: tuple[tuple[str, ...], ...]
    stage_outputs: tuple[tuple[str, ...], ...]
    batch_size: int
    chunks: int
    sizes: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "edges", tuple(self.edges))
        object.__setattr__(self, "stage_inputs", tuple(tuple(x) for x in self.stage_inputs))
        object.__setattr__(self, "stage_outputs", tuple(tuple(x) for x in self.stage_outputs))
        if not 1 <= self.chunks <= self.batch_size:
            raise ValueError(
                f"chunks={self.chunks} must be between 1 and batch_size={self.batch_size}"
            )
        object.__setattr__(self, "sizes", tuple(split_sizes(self.batch_size, self.chunks)))
        self._validate()

    @property
    def world(self) -> int:
        return len(self.stage_inputs)

    def edge(self, name: str) -> Edge:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, Edge]:
        return {e.name: e for e in self.edges}

    def finals(self) -> tuple[str, ...]:
        return tuple(n for n in self.stage_outputs[-1] if n not in self._by_name())

    def locals(self, rank: int) -> tuple[str, ...]:
        return tuple(n for n in self.stage_inputs[rank] if n not in self._by_name())

    def _validate(self) -> None:
        n = self.world
        if len(self.stage_outputs) != n:
            raise ValueError(
                f"stage_inputs has {n} ranks but stage_outputs has {len(self.stage_outputs)}"
            )
        names = [e.name for e in self.edges]
        dup = {x for x in names if names.count(x) > 1}
        if dup:
            raise ValueError(f"edge names must be unique; repeated: {sorted(dup)}")
        for e in self.edges:
            if not 0 <= e.src < n or not e.dsts:
                raise ValueError(f"edge {e.name!r}: bad src {e.src} or empty dsts")
            for d in e.dsts:
                if not e.src < d < n:
                    raise ValueError(
                        f"edge {e.name!r}: destination rank {d} must come after source "
                        f"rank {e.src} (and be < {n})"
                    )
                if e.name not in self.stage_inputs[d]:
                    raise ValueError(f"edge {e.name!r} goes to rank {d}, whose stage_inputs lack it")
            if len(set(e.dsts)) != len(e.dsts):
                raise ValueError(f"edge {e.name!r}: repeated destination in {e.dsts}")
            if e.name not in self.stage_outputs[e.src]:
                raise ValueError(
                    f"edge {e.name!r} comes from rank {e.src}, whose stage_outputs lack it"
                )
            if e.batch_dim is not None and not 0 <= e.batch_dim < len(e.shape):
                raise ValueError(f"edge {e.name!r}: batch_dim {e.batch_dim} out of range for {e.shape}")
        by = self._by_name()
        for r in range(n):
            for x in self.stage_inputs[r]:
                if x in by and r not in by[x].dsts:
                    raise ValueError(f"rank {r} takes {x!r} but the edge does not go to rank {r}")
            for y in self.stage_outputs[r]:
                if y in by:
                    if by[y].src != r:
                        raise ValueError(f"rank {r} returns {y!r} but the edge comes from rank {by[y].src}")
                elif r != n - 1:
                    raise ValueError(
                        f"rank {r} returns {y!r}, which is no edge; only the last rank has final outputs"
                    )
        if not self.finals():
            raise ValueError("the last rank returns no final output for the loss")

    def digest(self) -> str:
        """A short hash of the spec, compared across ranks once at start-up."""
        return hashlib.sha1(repr((self.edges, self.stage_inputs, self.stage_outputs, self.sizes)).encode()).hexdigest()[:16]


class _CommError(RuntimeError):
    def __init__(self, what: str, peer: int, err: BaseException) -> None:
        super().__init__(f"{what}: {err}")
        self.what, self.peer, self.err = what, peer, err


class P2PGPipe:
    """Runs this rank's stage of a GPipe pipeline over point-to-point messages.

    Args:
        stage: ``stage(*inputs) -> tuple[Tensor, ...]`` (a single Tensor is
            accepted too), inputs and outputs ordered as in ``spec``. Usually an
            ``nn.Module`` holding only this rank's parameters.
        spec: the :class:`PipeSpec`, identical on every rank (checked once).
        group: the process group (default: the world); spec ranks are ranks
            in this group.
        store: a ``torch.distributed.Store`` shared by the ranks, for failure
            reports (default: the default group's store).
        timeout: seconds any single send/receive may wait; the bound on
            detecting a rank that hangs without dying. Must exceed the
            longest stretch a rank waits for its peers legitimately (about a
            whole step in the worst case).
        ops: ``"pg"`` (ProcessGroup.send/recv directly, default), ``"isend"``
            (dist.isend/irecv) or ``"batch"`` (dist.batch_isend_irecv with
            P2POp lists). On gloo all three issue the same messages (gloo has
            no coalescing; batch_isend_irecv loops over isend/irecv); they
            differ only in Python overhead.
        loss_fn: default loss function for :meth:`step`.
        watchdog: start the thread that turns other ranks' failure reports into
            an error here while this rank is blocked in a wait.
        confirm: end each step with a barrier, so that a step returns on a
            rank only if it completed on every rank (a failure anywhere fails
            the step everywhere). Without it, a rank whose part was done
            before another rank failed returns normally and learns of the
            failure at its next step.
        name: prefix of this pipeline's store keys (distinct per pipeline).
    """

    def __init__(
        self,
        stage: Callable[..., Any],
        spec: PipeSpec,
        *,
        group: dist.ProcessGroup | None = None,
        store: dist.Store | None = None,
        timeout: float = 300.0,
        ops: str = "pg",
        loss_fn: Callable[..., torch.Tensor] | None = None,
        watchdog: bool = True,
        confirm: bool = True,
        name: str = "autopipe_p2p",
    ) -> None:
        if ops not in ("pg", "isend", "batch"):
            raise ValueError(f"ops must be 'pg', 'isend' or 'batch', not {ops!r}")
        self.stage, self.spec, self.ops, self.loss_fn = stage, spec, ops, loss_fn
        self.confirm = confirm
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        world = dist.get_world_size(self.group)
        if world != spec.world:
            raise ValueError(f"spec describes {spec.world} stages but the group has {world} ranks")
        self.timeout = timedelta(seconds=timeout)
        self._global = [dist.get_global_rank(self.group, r) for r in range(world)]
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self._store = dist.PrefixStore(name, base)
        self._failed: str | None = None  # set once this pipeline is dead
        self._remote: str | None = None  # set by the watchdog: another rank's report
        # Extra store clients (own TCP connections): one the watchdog blocks
        # in, one with a short timeout for failure reports.
        self._wstore = self._store.clone()
        self._rstore = self._store.clone()
        self._rstore.set_timeout(timedelta(seconds=5))
        self.last_stats: dict[str, float] = {}

        r = self.rank
        by = spec._by_name()
        self._in_edges = [by[x] for x in spec.stage_inputs[r] if x in by]
        self._out_edges = [by[y] for y in spec.stage_outputs[r] if y in by]
        self._locals = spec.locals(r)
        self._is_last = r == world - 1
        self._finals = spec.finals() if self._is_last else ()
        self._eidx = {e.name: i for i, e in enumerate(spec.edges)}
        self._edge = by
        self._bufs: dict[str, list[torch.Tensor]] | None = None
        self._gbufs: dict[tuple[str, int], list[torch.Tensor]] | None = None
        self._zeros: dict[tuple[str, int], torch.Tensor] = {}

        # Clear a stale wake-up before the spec check, which no rank leaves
        # before every rank has entered it: no failure report can be lost.
        self._store.delete_key(f"wake/{r}")
        self._check_spec()
        self._poisoned = False
        self._poison_lock = threading.Lock()
        self._wd: threading.Thread | None = None
        self._wd_stop = threading.Event()
        if watchdog and world > 1:
            self._wd = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
            self._wd.start()

    # -- set-up ----------------------------------------------------------------
    def _check_spec(self) -> None:
        """Once per pipeline: all ranks must hold the same spec (a wrong shape
        would otherwise surface as a gloo size-mismatch error mid-step)."""
        mine = self.spec.digest()
        self._store.set(f"spec/{self.rank}", mine)
        for q in range(self.spec.world):
            theirs = self._store.get(f"spec/{q}").decode()
            if theirs != mine:
                raise ValueError(f"rank {self.rank}: rank {q} holds a different PipeSpec ({theirs} != {mine})")

    def _alloc(self) -> None:
        sz = self.spec.sizes
        self._bufs = {
            e.name: [torch.empty(e.mb_shape(s), dtype=e.dtype) for s in sz] for e in self._in_edges
        }
        self._gbufs = {
            (e.name, d): [torch.empty(e.mb_shape(s), dtype=e.dtype) for s in sz]
            for e in self._out_edges
            if e.grad
            for d in e.dsts
        }

    # -- messages --------------------------------------------------------------
    def _tag(self, e: Edge, i: int, backward: bool) -> int:
        return (self._eidx[e.name] * self.spec.chunks + i) * 2 + int(backward)

    def _post(self, ops: list[tuple[str, torch.Tensor, int, int, str]]) -> list[tuple[Any, int, str]]:
        """Post ("send"|"recv", tensor, peer, tag, what) ops; returns [(work, peer, what)]."""
        if not ops:
            return []
        try:
            if self.ops == "pg":
                g = self.group
                works = [
                    (g.send([t], p, tag) if k == "send" else g.recv([t], p, tag)) for k, t, p, tag, _ in ops
                ]
            elif self.ops == "isend":
                works = [
                    (
                        dist.isend(t, self._global[p], group=self.group, tag=tag)
                        if k == "send"
                        else dist.irecv(t, self._global[p], group=self.group, tag=tag)
                    )
                    for k, t, p, tag, _ in ops
                ]
            else:
                works = dist.batch_isend_irecv(
                    [
                        dist.P2POp(dist.isend if k == "send" else dist.irecv, t, self._global[p], self.group, tag)
                        for k, t, p, tag, _ in ops
                    ]
                )
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
        """Make gloo close every pair of this rank's context, so that each peer
        blocked on us fails now instead of at its timeout."""
        with self._poison_lock:
            if self._poisoned or self.spec.world < 2:
                return
            self._poisoned = True
        peer = (self.rank + 1) % self.spec.world
        try:
            self.group.recv([torch.empty(1)], peer, _POISON_TAG).wait(timedelta(milliseconds=1))
        except RuntimeError:
            pass  # the expected "Timed out waiting 1ms": the context is now closed

    def _watch(self) -> None:
        """Watchdog thread: sleeps in a store wait until some rank reports a
        failure (or the store dies), then poisons this rank's gloo context so
        that the main thread's pending wait fails now."""
        store = self._wstore
        key = f"wake/{self.rank}"
        while not self._wd_stop.is_set():
            try:
                # Event-driven, no polling: a failing rank sets wake/<r> for
                # every r. Long timeout because each expiry logs a c10d warning.
                store.wait([key], timedelta(seconds=3600))
            except dist.DistStoreError:
                continue  # timed out: nothing happened for an hour
            except Exception as err:  # noqa: BLE001 - the store is gone: its host died
                if self._wd_stop.is_set():
                    return
                self._remote = (
                    f"rank {self.rank} lost the rendezvous store ({type(err).__name__}); the rank "
                    "hosting it (rank 0 with a tcp:// init_method) probably died"
                )
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
        """Publish ``msg`` unless a failure was reported first.

        Returns (the first report, whether the store could be reached). Uses
        its own store client with a short timeout, so a dead store host costs
        at most a few seconds here and the default group's store keeps its
        own timeout.
        """
        try:
            first = self._rstore.compare_set("failed", "", msg).decode() or msg
            w = self.spec.world
            self._rstore.multi_set([f"wake/{q}" for q in range(w)], ["1"] * w)
            return first, True
        except Exception:  # noqa: BLE001 - store unreachable: keep our own message
            return msg, False

    def _describe(self, err: BaseException, where: str) -> str:
        r = self.rank
        if not isinstance(err, _CommError):
            return f"rank {r} failed in {where}: {type(err).__name__}: {err}"
        text = str(err.err)
        if "Timed out" in text:
            return (
                f"rank {r}: {err.what} timed out after {self.timeout.total_seconds():g} s: "
                f"rank {err.peer} is hung or far too slow"
            )
        return (
            f"rank {r}: {err.what} failed: rank {err.peer} closed its connections "
            f"(it died, or failed itself) [{type(err.err).__name__}: {text.splitlines()[0][:200]}]"
        )

    def _fail(self, err: BaseException, where: str) -> PipelineError:
        """Report, poison, and build the error this rank raises."""
        mine = self._describe(err, where)
        first, reachable = self._report(self._remote or mine)
        self._poison()
        if not reachable:
            first = mine = (
                "the rendezvous store is unreachable, so the rank hosting it (rank 0 with a "
                f"tcp:// init_method) probably died or exited; rank {self.rank} saw: {mine}"
            )
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

    # -- the step ----------------------------------------------------------------
    def step(
        self,
        inputs: Mapping[str, torch.Tensor] | torch.Tensor | None = None,
        *,
        target: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """One training step's forward and backward (no optimizer step).

        ``inputs``: this rank's local inputs (whole batch), by name, or one
        tensor when the stage has exactly one local input. ``target``: whole
        batch, on the last rank (a tensor, or a tuple/list of tensors split
        alike). Returns the batch loss (detached) on the last rank, else None.
        """
        if self._failed is not None:
            raise PipelineError(f"pipeline is dead after an earlier failure: {self._failed}")
        if self._remote is not None:
            self._failed = self._remote
            raise PipelineError(f"pipeline step failed: {self._remote}")
        try:
            # Bad arguments are reported like any failure: the other ranks
            # must not wait for this one until their timeout.
            local_mbs, tgt, loss_fn = self._prepare(inputs, target, loss_fn)
            return self._step(local_mbs, tgt, loss_fn)
        except PipelineError:
            raise
        except Exception as err:
            raise self._fail(err, getattr(err, "_autopipe_where", "the step")) from err
        except BaseException as err:  # KeyboardInterrupt, SystemExit: still tell the others
            self._fail(err, getattr(err, "_autopipe_where", "the step"))
            raise

    def _prepare(self, inputs, target, loss_fn):
        spec, M = self.spec, self.spec.chunks
        if isinstance(inputs, torch.Tensor):
            if len(self._locals) != 1:
                raise ValueError(f"step() got one tensor, but this stage takes local inputs {self._locals}")
            inputs = {self._locals[0]: inputs}
        inputs = dict(inputs or {})
        missing = set(self._locals) - set(inputs)
        if missing:
            raise ValueError(f"step() lacks this stage's local inputs {sorted(missing)}")
        local_mbs = {}
        for k in self._locals:
            if inputs[k].shape[0] != spec.batch_size:
                raise ValueError(f"input {k!r} has batch {inputs[k].shape[0]}, spec says {spec.batch_size}")
            local_mbs[k] = inputs[k].tensor_split(M)
        loss_fn = loss_fn or self.loss_fn
        tgt = None
        if self._is_last:
            if loss_fn is None or target is None:
                raise ValueError("the last rank's step() needs target= and loss_fn=")
            tgt = (
                list(zip(*[t.tensor_split(M) for t in target]))
                if isinstance(target, (tuple, list))
                else [(t,) for t in target.tensor_split(M)]
            )
        return local_mbs, tgt, loss_fn

    def _step(self, local_mbs, tgt, loss_fn) -> torch.Tensor | None:
        spec, M, r = self.spec, self.spec.chunks, self.rank
        if self._bufs is None:
            self._alloc()
        bufs, gbufs = self._bufs, self._gbufs
        t_start = time.perf_counter()
        wait_s = 0.0

        # 1. post every receive of the step: activations for all micro-batches
        #    in order, then the gradients coming back (any order is fine: tags
        #    are unique per edge, micro-batch and direction).
        for e in self._in_edges:
            for b in bufs[e.name]:
                b.requires_grad_(False)
                b.grad = None
        fwd_recv = [
            self._post(
                [
                    ("recv", bufs[e.name][i], e.src, self._tag(e, i, False),
                     f"receive {e.name!r} mb {i} from rank {e.src}")
                    for e in self._in_edges
                ]
            )
            for i in range(M)
        ]
        bwd_recv = [
            self._post(
                [
                    ("recv", gl[i], d, self._tag(self._edge[name], i, True),
                     f"receive grad of {name!r} mb {i} from rank {d}")
                    for (name, d), gl in gbufs.items()
                ]
            )
            for i in range(M)
        ]

        sends: list[tuple[Any, int, str]] = []
        saved: list[tuple[list[torch.Tensor], list[Edge]] | None] = [None] * M
        losses: list[torch.Tensor | None] = [None] * M
        total = None

        # 2. forward, micro-batches 0..M-1
        for i in range(M):
            t0 = time.perf_counter()
            self._wait(fwd_recv[i])
            wait_s += time.perf_counter() - t0
            args = []
            for x in spec.stage_inputs[r]:
                if x in local_mbs:
                    args.append(local_mbs[x][i])
                else:
                    b = bufs[x][i]
                    if self._edge[x].grad:
                        b.requires_grad_(True)
                    args.append(b)
            try:
                outs = self.stage(*args)
            except BaseException as err:
                err._autopipe_where = f"forward of micro-batch {i}"  # type: ignore[attr-defined]
                raise
            if isinstance(outs, torch.Tensor):
                outs = (outs,)
            outs = tuple(outs)
            if len(outs) != len(spec.stage_outputs[r]):
                err = ValueError(
                    f"stage returned {len(outs)} tensors, spec names {len(spec.stage_outputs[r])}: "
                    f"{spec.stage_outputs[r]}"
                )
                err._autopipe_where = f"forward of micro-batch {i}"  # type: ignore[attr-defined]
                raise err
            ops = []
            edge_outs, edges = [], []
            finals = []
            for y, t in zip(spec.stage_outputs[r], outs):
                if y in self._finals:
                    finals.append(t)
                    continue
                e = self._edge[y]
                want = e.mb_shape(spec.sizes[i])
                if tuple(t.shape) != want or t.dtype != e.dtype:
                    err = ValueError(f"output {y!r} is {tuple(t.shape)} {t.dtype}, spec says {want} {e.dtype}")
                    err._autopipe_where = f"forward of micro-batch {i}"  # type: ignore[attr-defined]
                    raise err
                payload = t.detach().contiguous()
                for d in e.dsts:
                    ops.append(("send", payload, d, self._tag(e, i, False), f"send {y!r} mb {i} to rank {d}"))
                edge_outs.append(t)
                edges.append(e)
            sends += self._post(ops)
            saved[i] = (edge_outs, edges)
            if self._is_last:
                try:
                    li = loss_fn(*finals, *tgt[i]) * (spec.sizes[i] / spec.batch_size)
                except BaseException as err:
                    err._autopipe_where = f"loss of micro-batch {i}"  # type: ignore[attr-defined]
                    raise
                losses[i] = li
                total = li.detach() if total is None else total + li.detach()

        # 3. backward, micro-batches M-1..0
        for i in reversed(range(M)):
            edge_outs, edges = saved[i]
            saved[i] = None
            t0 = time.perf_counter()
            self._wait(bwd_recv[i])
            wait_s += time.perf_counter() - t0
            tensors, grads = [], []
            if losses[i] is not None:
                if losses[i].requires_grad:
                    tensors.append(losses[i])
                    grads.append(None)
                losses[i] = None
            for t, e in zip(edge_outs, edges):
                if not e.grad:
                    continue
                g = gbufs[(e.name, e.dsts[0])][i]
                for d in e.dsts[1:]:
                    g = g + gbufs[(e.name, d)][i]
                if t.requires_grad:
                    tensors.append(t)
                    grads.append(g)
            if tensors:
                try:
                    torch.autograd.backward(tensors, grads)
                except BaseException as err:
                    err._autopipe_where = f"backward of micro-batch {i}"  # type: ignore[attr-defined]
                    raise
            ops = []
            for e in self._in_edges:
                if not e.grad:
                    continue
                b = bufs[e.name][i]
                g = b.grad
                if g is None:
                    key = (e.name, spec.sizes[i])
                    if key not in self._zeros:
                        self._zeros[key] = torch.zeros(e.mb_shape(spec.sizes[i]), dtype=e.dtype)
                    g = self._zeros[key]
                ops.append(("send", g.contiguous(), e.src, self._tag(e, i, True), f"send grad of {e.name!r} mb {i} to rank {e.src}"))
            sends += self._post(ops)

        t0 = time.perf_counter()
        self._wait(sends)
        if self.confirm and spec.world > 1:
            # Every rank returns only once every rank has finished the step, so
            # a failure anywhere fails the step everywhere (no rank goes on to
            # an optimizer step with the others' gradients incomplete).
            try:
                work = dist.barrier(group=self.group, async_op=True)
            except RuntimeError as err:
                raise _CommError("the end-of-step barrier", (r + 1) % spec.world, err) from err
            self._wait([(work, (r + 1) % spec.world, "the end-of-step barrier")])
        wait_s += time.perf_counter() - t0
        self.last_stats = {"step_s": time.perf_counter() - t_start, "wait_s": wait_s}
        return total
