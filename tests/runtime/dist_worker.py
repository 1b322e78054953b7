"""One rank of a distributed test: ``python dist_worker.py SCENARIO OUT_DIR`` with torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Writes this rank's results to OUT_DIR.

Scenarios: ``gpt`` and ``dp`` (gradients of a GPT, pipeline and pipeline x data parallel),
``meta`` (a model built on meta), ``masked`` (a (seq, seq) mask given to the forward), ``moe`` (experts given the rows routed to them),
``skip`` (a skip connection and an early model output between ranks), ``reuse`` (receive buffers reused over steps
in float64), ``trap`` (a failure injected on one rank;
see :class:`Trap`), ``zoo`` (float64 gradients of the small zoo's NAMES, ``name:mode+mode,...``, under SCHEDULE).
"""
import json
import os
import signal
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the root: zoo/
import autopipe  # noqa: E402
from zoo import GPT, build, random_inputs, tensor_leaves  # noqa: E402

OUT_DIR = "."


class SkipGPT(GPT):
    """zoo.GPT with a long skip (the embeddings, flattened to (batch * seq, d) and added again before the final
    norm: made on the first stage, read by the last) and an early model output (a statistic of the token
    embeddings, made on the first stage and read by no later stage)."""

    skip_to = None  # also add the embeddings before this block (a skip to a middle stage)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        emb = self.wte(idx)
        early = emb.pow(2).mean(-1)  # computed here, so it is in the first stage (stages are contiguous in this order)
        x0 = self.drop(emb + self.wpe(pos))
        flat = x0.flatten(0, 1)  # (batch * seq, d): seq rows a sample on the wire to the last stage
        x = x0
        for k, block in enumerate(self.blocks):
            x = block(x + x0 if k == self.skip_to else x)
        return self.lm_head(self.ln_f(x + flat.view_as(x))), early


def skip_loss(output, target):
    logits, early = output
    return F.cross_entropy(logits.flatten(0, 1), target.flatten()) + early.mean()


def _fire(action: str, where: str) -> None:
    """Spring the trap: note the time first (the test measures detection from it)."""
    with open(os.path.join(OUT_DIR, "inject.json"), "w") as f:
        json.dump({"rank": int(os.environ["RANK"]), "time": time.time(), "where": where}, f)
    if action == "raise":
        raise ValueError(f"trap sprung on purpose ({where})")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hang":
        time.sleep(3600)  # the test's launcher kills this rank, as torchrun's agent would


class _FireInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, trap):
        ctx.trap = trap
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.trap.backward_calls += 1
        if ctx.trap.backward_calls == 2:  # the second micro-batch's backward (GPipe: micro-batch 2 of 4)
            _fire(ctx.trap.action, "backward")
        return grad, None


class Trap(nn.Module):
    """Fails when armed, on the rank that holds it: ``action`` "raise" | "kill" | "hang", in the
    forward of micro-batch 1 (``phase`` "fwd") or in the second backward of the step ("bwd")."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.armed = False  # compiling runs the module too (fake tensors): arm it for the steps only
        self.action, self.phase = "raise", "fwd"
        self.calls = self.backward_calls = 0

    def forward(self, x):
        if self.armed and self.phase == "fwd":
            self.calls += 1
            if self.calls == 2:  # micro-batch 1: GPipe runs every forward before any recompute
                _fire(self.action, "forward of micro-batch 1")
        out = self.fc(x)
        if self.armed and self.phase == "bwd":
            out = _FireInBackward.apply(out, self)
        return out


class TrapModel(nn.Module):
    """Traps at the start (the first rank), the middle and the end (the last rank)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.trap0 = Trap()
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])
        self.trap1 = Trap()
        self.trap2 = Trap()
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = self.trap0(torch.tanh(self.inp(x)))
        for b in self.blocks[:2]:
            h = torch.tanh(b(h))
        h = self.trap1(h)
        for b in self.blocks[2:]:
            h = torch.tanh(b(h))
        return self.out(self.trap2(h))


def per_sample_loss(output, rows):
    """A loss whose micro-batch parts, weighted by their share of the rows, add up to the whole batch's: a sum over
    each sample's elements divided by the rows (``rows``: a tensor of one row a sample), a 0-dim output linearly."""
    total = 0
    for k, t in enumerate(tensor_leaves(output)):
        if t.is_floating_point():
            total = total + ((t * (k + 1)).sin().sum() / rows.shape[0] if t.dim() else t * (k + 1))
    return total


def double_inputs(name: str):
    """``random_inputs(name)`` of 8 rows in float64, the same on every rank."""
    args, kwargs = random_inputs(name, 8, torch.Generator().manual_seed(1))
    cast = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return [cast(a) for a in args], {k: cast(v) for k, v in kwargs.items()}


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor as the plain model holds it: an FSDP2 shard (a DTensor, data_parallel's replicas) gathered."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _write_error(rank: int, e: BaseException) -> None:
    with open(os.path.join(OUT_DIR, f"rank{rank}.err"), "w") as f:
        json.dump({"type": type(e).__name__, "message": str(e), "time": time.time()}, f)


def trap(rank: int, world: int):
    """One good step, then the trap armed where TRAP_AT says (trap0 | trap1 | trap2 | loss),
    sprung as TRAP ("raise" | "kill" | "hang") in TRAP_PHASE ("fwd" | "bwd")."""
    action, at, phase = os.environ.get("TRAP", "raise"), os.environ.get("TRAP_AT", "trap1"), \
        os.environ.get("TRAP_PHASE", "fwd")
    torch.manual_seed(0)
    model = TrapModel()
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    pipe = autopipe.compile(model, chunks=4, timeout=float(os.environ.get("TIMEOUT", "20")),
                            leaf_modules=[Trap], example_inputs=(x,))
    armed = [False]
    loss_calls = [0]

    def loss_fn(out, target):
        if armed[0] and at == "loss" and not out.is_meta:  # not autopipe's run on meta stand-ins before the step
            loss_calls[0] += 1
            if loss_calls[0] == 2:
                _fire(action, "the loss of micro-batch 1")
        return F.mse_loss(out, target)

    holds = rank == world - 1 if at == "loss" else at in pipe.plan.stages[pipe.stage_index].nodes
    if holds:
        with open(os.path.join(OUT_DIR, "trap_rank.txt"), "w") as f:
            f.write(str(rank))
    try:
        pipe.step(x, target=y, loss_fn=loss_fn)  # a good step first
        if at != "loss":
            module = getattr(model, at)
            module.action, module.phase, module.armed = action, phase, True
        armed[0] = True
        for _ in range(3):
            pipe.step(x, target=y, loss_fn=loss_fn)
    except Exception as e:
        _write_error(rank, e)
        sys.exit(3)
    return pipe


def training_loop(rank: int, world: int) -> "autopipe.DistributedPipeline":
    """A user's loop: float64 GPT with its LM head tied to the embedding, AdamW, pipe.clip_grad_norm_ every step
    (NORM_TYPE, MAX_NORM), sequence lengths from SEQ_LENS (dynamic padding: a new shape a step), the gradients of
    ACCUMULATE batches summed before each optimizer step (gradient accumulation: no zero_grad in between)."""
    torch.set_default_dtype(torch.float64)
    model = GPT(vocab=64, d=32, heads=4, layers=4, block=32, dropout=0.0)
    torch.set_default_dtype(torch.float32)
    seq_lens = list(map(int, os.environ.get("SEQ_LENS", "16,16,16,16").split(",")))
    pipe = autopipe.compile(model, chunks=4, timeout=30, schedule=os.environ.get("SCHEDULE", "gpipe"),
                            example_inputs=(torch.zeros(8, seq_lens[0], dtype=torch.long),))
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    norm_type, max_norm = float(os.environ.get("NORM_TYPE", "2")), float(os.environ.get("MAX_NORM", "0.5"))
    g = torch.Generator().manual_seed(1)
    losses, norms, seconds = [], [], {}
    accumulate = int(os.environ.get("ACCUMULATE", "1"))
    for k, seq in enumerate(seq_lens):
        ids, target = torch.randint(0, 64, (8, seq), generator=g), torch.randint(0, 64, (8, seq), generator=g)
        loss = pipe.step(ids, target=target, loss_fn=lm_loss)
        seconds.setdefault(seq, sum(pipe.plan.pass_seconds.values()))
        losses.append(None if loss is None else loss.item())
        if (k + 1) % accumulate:
            continue
        norms.append(pipe.clip_grad_norm_(max_norm, norm_type).item() if max_norm > 0 else None)
        opt.step()
        opt.zero_grad()
    results = {"params": {n: p.detach().clone() for n, p in pipe.named_parameters()}, "losses": losses,
               "norms": norms, "seconds": seconds, "programs": len(pipe._programs)}
    if os.environ.get("SKEW"):  # the last rank called with a shorter batch than the others: refused on every rank
        seq = 18 if rank < world - 1 else 14
        try:
            pipe.step(torch.zeros(8, seq, dtype=torch.long), target=torch.zeros(8, seq, dtype=torch.long),
                      loss_fn=lm_loss)
            results["skewed"] = "not refused"
        except ValueError as e:
            results["skewed"] = str(e)
    torch.save(results, os.path.join(OUT_DIR, f"rank{rank}.pt"))
    return pipe


def gpt_run(scenario: str, rank: int, world: int, data_parallel: int, checkpoint: str, schedule: str,
            virtual_stages: str):
    """The GPT scenarios' two steps under one configuration; the pipeline, its results in ``pipe.results``."""
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.1).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (16, 16), generator=g)
    target = torch.randint(0, 64, (16, 16), generator=g)
    if scenario == "dp":
        replica = rank // (world // data_parallel)
        ids, target = ids.chunk(data_parallel)[replica], target.chunk(data_parallel)[replica]
    # a CUDA model: its stages run there ("cuda:{local_rank}": a GPU per rank, NCCL; else via the host, gloo)
    device = os.environ.get("DEVICE", "cpu").format(local_rank=os.environ["LOCAL_RANK"])
    model, ids, target = model.to(device), ids.to(device), target.to(device)
    pipe = autopipe.compile(model, chunks=4, checkpoint=checkpoint, schedule=schedule,
                            virtual_stages=int(virtual_stages), data_parallel=data_parallel, timeout=30)
    losses = []
    for step in range(2):
        torch.manual_seed(100 + step)  # the same on every rank: the same dropout masks as in-process
        loss = pipe.step(ids, target=target, loss_fn=lm_loss)
        losses.append(None if loss is None else loss.item())
        if step == 0:
            grads = {n: whole(p.grad).cpu() for n, p in pipe.named_parameters() if p.grad is not None}
            pipe.zero_grad()
    pipe.results = {"grads": grads, "losses": losses, "stage": pipe.stage_index, "plan": str(pipe.plan),
                    "state": {k: whole(v) for k, v in pipe.state_dict().items()},
                    "backend": str(torch.distributed.get_backend())}
    return pipe


def main():
    global OUT_DIR
    scenario, OUT_DIR = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    data_parallel = int(os.environ.get("DATA_PARALLEL", "1"))
    torch.manual_seed(0)
    if scenario in ("gpt", "dp"):
        # CONFIGS: "checkpoint:schedule:virtual_stages,..." run one after the other in this launch (each saved under
        # its entry); without it one configuration from CHECKPOINT, SCHEDULE, VIRTUAL_STAGES, saved flat
        configs = os.environ.get("CONFIGS")
        entries = configs.split(",") if configs else [":".join([os.environ.get("CHECKPOINT", "except_last"),
                                                                 os.environ.get("SCHEDULE", "gpipe"),
                                                                 os.environ.get("VIRTUAL_STAGES", "1")])]
        saved = {}
        for entry in entries:
            saved[entry] = pipe = gpt_run(scenario, rank, world, data_parallel, *entry.split(":"))
            if entry != entries[-1]:
                pipe.close()
        pipe = saved[entries[-1]]
        results = {e: p.results for e, p in saved.items()}
        torch.save({"configs": results} if configs else results[entries[0]], os.path.join(OUT_DIR, f"rank{rank}.pt"))
    elif scenario == "skip":  # CONFIGS: "virtual_stages:schedule,...", one after the other in this launch
        from autopipe.runtime.p2p import P2PTransport
        from autopipe.runtime.wire import WireSpec
        posts = []  # (send?, peer, tag) in the order this rank posts them: NCCL would match each pair in this order
        post = P2PTransport._post
        P2PTransport._post = lambda self, send, tensor, peer, tag, what: (
            posts.append((send, peer, tag)), post(self, send, tensor, peer, tag, what))[1]
        runs = {}
        for entry in os.environ["CONFIGS"].split(","):
            v, schedule = int(entry.split(":")[0]), entry.split(":")[1]
            torch.manual_seed(0)
            model = SkipGPT(vocab=64, d=32, heads=4, layers=world * v, block=16, dropout=0.1).train()
            model.skip_to = world + 1 if v > 1 else None
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(0, 64, (16, 16), generator=g)
            target = torch.randint(0, 64, (16, 16), generator=g)
            pipe = autopipe.compile(model, chunks=4, timeout=30, virtual_stages=v, schedule=schedule)
            posts.clear()
            torch.manual_seed(100)
            loss = pipe.step(ids, target=target, loss_fn=skip_loss)
            grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
            edges = [(e.name, e.src, e.dsts) for e in WireSpec.from_plan(pipe.plan).edges]
            runs[entry] = {"grads": grads, "loss": None if loss is None else loss.item(), "edges": edges,
                           "posts": list(posts)}
            if entry != os.environ["CONFIGS"].split(",")[-1]:
                pipe.close()
        torch.save(runs, os.path.join(OUT_DIR, f"rank{rank}.pt"))
    elif scenario == "reuse":  # CONFIGS: "virtual_stages:schedule,...": 3 float64 steps each
        from autopipe.runtime.p2p import P2PTransport
        receives = []  # per step: the receives this rank posted
        post = P2PTransport._post
        P2PTransport._post = lambda self, send, tensor, peer, tag, what: (
            None if send else receives.append(tag), post(self, send, tensor, peer, tag, what))[1]
        runs = {}
        for entry in os.environ["CONFIGS"].split(","):
            v, schedule = int(entry.split(":")[0]), entry.split(":")[1]
            torch.manual_seed(0)
            model = SkipGPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.0).double().train()
            model.skip_to = 2  # a skip from the first stage to a middle one as well
            pipe = autopipe.compile(model, chunks=4, timeout=30, virtual_stages=v, schedule=schedule)
            g = torch.Generator().manual_seed(1)
            losses, posted, pooled, grads = [], [], [], []
            for _ in range(3):  # a new batch a step: a buffer written too early would carry another step's values
                ids, target = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)
                receives.clear()
                loss = pipe.step(ids, target=target, loss_fn=skip_loss)
                losses.append(None if loss is None else loss.item())
                posted.append(len(receives))
                pooled.append(sum(map(len, pipe._transport._buffers._kept.values())))
                grads.append({n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None})
                pipe.zero_grad()
            runs[entry] = {"grads": grads, "losses": losses, "posted": posted, "pooled": pooled}
            if entry != os.environ["CONFIGS"].split(",")[-1]:
                pipe.close()
        torch.save(runs, os.path.join(OUT_DIR, f"rank{rank}.pt"))
    elif scenario == "masked":  # a (seq, seq) mask: a tensor argument without the batch, which every rank reads whole
        (x, mask), _ = random_inputs("masked", 8, torch.Generator().manual_seed(1))
        target = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        pipe = autopipe.compile(build("masked").double(), chunks=4, timeout=30)
        loss = pipe.step(x.double(), mask.double(), target=target, loss_fn=F.mse_loss)
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        torch.save({"grads": grads, "loss": None if loss is None else loss.item()}, os.path.join(OUT_DIR, f"rank{rank}.pt"))
    elif scenario == "constants":  # tensors the fx trace made (_tensor_constant*), which the model does not hold
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
        from test_placement import RelativePositionViT
        torch.manual_seed(0)
        x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        target = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(2))
        pipe = autopipe.compile(RelativePositionViT().double(), chunks=2, timeout=30)
        loss = pipe.step(x, target=target, loss_fn=F.cross_entropy)
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        torch.save({"grads": grads, "loss": None if loss is None else loss.item(), "route": pipe.plan.route},
                   os.path.join(OUT_DIR, f"rank{rank}.pt"))
    elif scenario == "moe":  # experts take the rows routed to them, a number set by values: inside a stage, never on the wire
        (x,), _ = random_inputs("moe", 8, torch.Generator().manual_seed(1))
        target = torch.randn(8, 5, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        pipe = autopipe.compile(build("moe").double(), chunks=4, timeout=30)
        loss = pipe.step(x.double(), target=target, loss_fn=F.mse_loss)
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        torch.save({"grads": grads, "loss": None if loss is None else loss.item()}, os.path.join(OUT_DIR, f"rank{rank}.pt"))
    elif scenario == "zoo":  # eval mode: BatchNorm's and dropout's per micro-batch draws are tested against 1F1B
        runs = {}  # RUNS: "schedule=name:mode+mode,name:mode|schedule=...", one schedule after the other
        for run in os.environ["RUNS"].split("|"):
            schedule, names = run.split("=")
            grads = {}
            for name, modes in (entry.split(":") for entry in names.split(",")):
                args, kwargs = double_inputs(name)
                for checkpoint in modes.split("+"):
                    model = build(name).double().eval()
                    pipe = autopipe.compile(model, chunks=4, timeout=30, checkpoint=checkpoint, schedule=schedule)
                    pipe.step(*args, **kwargs, target=torch.zeros(8), loss_fn=per_sample_loss)
                    grads[f"{name}/{checkpoint}"] = {n: p.grad.clone() for n, p in pipe.named_parameters()
                                                     if p.grad is not None}
                    pipe.close()
            runs[schedule] = {"grads": grads, "stages": pipe.stage_indices}
        torch.save(runs, os.path.join(OUT_DIR, f"rank{rank}.pt"))
    elif scenario == "trap":
        pipe = trap(rank, world)
    elif scenario == "loop":
        pipe = training_loop(rank, world)
    elif scenario == "meta":
        with torch.device("meta"):
            model = GPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.0)
        pipe = autopipe.compile(model, chunks=2, example_inputs=(torch.randint(0, 64, (4, 16)),))
        on_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        mine = [n for n, p in pipe.named_parameters()]
        ids, target = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
        loss = pipe.step(ids, target=target, loss_fn=lm_loss)
        try:
            pipe.to(torch.float64)
            moved = "moved"
        except RuntimeError as e:
            moved = str(e)
        torch.save({"on_meta": on_meta, "mine": mine, "loss": None if loss is None else loss.item(), "moved": moved,
                    "dtypes": {p.dtype for p in pipe.parameters()}, "state": pipe.state_dict(), "batch": (ids, target)},
                   os.path.join(OUT_DIR, f"rank{rank}.pt"))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    import torch.distributed as dist
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
