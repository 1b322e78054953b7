"""Real torch.distributed processes on 127.0.0.1 (gloo): one stage per rank.

Failures (a rank raising, killed, hung) are tested in test_p2p.py, which shares ``launch``."""
import math
import os
import socket
import sys
import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import autopipe
from dist_worker import double_inputs, per_sample_loss
from zoo import GPT, build, random_inputs

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launched:
    codes: list[int]        # exit codes (-9: killed, by itself or by the launcher)
    outputs: list[str]      # each rank's stdout and stderr
    seconds: float          # until the last rank ended
    ends: list[float]       # when each rank ended, seconds after the start

    def log(self) -> str:
        return "\n".join(f"--- rank {r} (exit {c}) ---\n{o}" for r, (c, o) in enumerate(zip(self.codes, self.outputs)))


# Note [ranks forked from a preloaded server]: a rank started as a fresh interpreter spends ~4 s of CPU importing
# torch and autopipe before it does anything, and the suite starts ~100 ranks on 2 cores. The ranks are forked
# instead from multiprocessing's forkserver, which imported them once (with OMP_NUM_THREADS=1, as every rank
# runs): each is still its own process with its own torch.distributed state, environment, argv and log file, and
# runs the worker file as ``__main__``, as torchrun's ranks do. What a fork shares with a fresh interpreter is the
# imported code alone; a rank ends as multiprocessing's children do (its non-daemon threads joined, then exit).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "autopipe",
           "autopipe.runtime.distributed", "zoo", "dist_worker"]


def _rank_processes():
    """multiprocessing's forkserver context, its server started (once a pytest process) with the ranks' thread
    count: Note [ranks forked from a preloaded server]."""
    import multiprocessing
    import multiprocessing.forkserver
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # the server imports what this process would: its sys.path (a checkout's own autopipe before the installed one)
    server_env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    saved = {k: os.environ.get(k) for k in server_env}
    os.environ.update(server_env)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    return ctx


def run_rank(worker: str, argv: list[str], env: dict[str, str], log_path: str, autopipe_file: str) -> None:
    """A forked rank: its environment, its log file as stdout and stderr, ``worker`` run as ``__main__``; the
    autopipe it runs is the launcher's (``autopipe_file``)."""
    import runpy
    if autopipe.__file__ != autopipe_file:
        raise RuntimeError(f"the rank server imported {autopipe.__file__}, the tests run {autopipe_file}")
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [worker, *argv]
    runpy.run_path(worker, run_name="__main__")


def launch(scenario, world, out_dir, timeout=120, stop_after=None, worker=None, **env) -> Launched:
    """Start ``world`` ranks the way torchrun does: its environment contract, and the rendezvous
    store hosted outside the ranks (torchrun's agent hosts it), so it outlives any rank; ``worker``:
    the file each rank runs (dist_worker.py). The ranks are forked from a preloaded server (Note [ranks
    forked from a preloaded server]).

    ``stop_after``: seconds after the first rank fails (exits non-zero) at which the ranks still
    running are killed, as torchrun's agent stops every worker when one fails (a hung rank never
    ends by itself). Without it every rank must end by itself within ``timeout``."""
    import torch.distributed as dist
    ctx = _rank_processes()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)  # noqa: F841
    procs, logs = [], []
    for rank in range(world):
        e = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                 LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1", TORCHELASTIC_USE_AGENT_STORE="True",
                 **{k: str(v) for k, v in env.items()})
        path = os.path.join(out_dir, f"rank{rank}.log")
        logs.append(open(path, "w+"))  # a file, not a pipe: no rank blocks on it
        p = ctx.Process(target=run_rank, args=(worker or WORKER, [scenario, str(out_dir)], e, path, autopipe.__file__))
        p.start()
        procs.append(p)
    start = time.monotonic()
    ends: list[float | None] = [None] * world
    first_failure = None
    try:
        while any(t is None for t in ends):
            now = time.monotonic() - start
            for r, p in enumerate(procs):
                if ends[r] is None and p.exitcode is not None:
                    ends[r] = now
                    if p.exitcode != 0 and first_failure is None:
                        first_failure = now
            if stop_after is not None and first_failure is not None and now > first_failure + stop_after:
                for r, p in enumerate(procs):
                    if ends[r] is None:
                        p.kill()
            if now > timeout:
                raise AssertionError(f"{scenario}: ranks {[r for r, t in enumerate(ends) if t is None]} still "
                                     f"running after {timeout} s")
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return Launched([p.exitcode for p in procs], outputs, max(ends), ends)


def gpt_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (16, 16), generator=g), torch.randint(0, 64, (16, 16), generator=g)


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def assert_ranks_hold_the_models_grads(results: list[dict], model, entry: str) -> None:
    """Each rank's gradients are those ``model`` holds after its in-process step, and every parameter got its
    gradient on some rank."""
    seen = set()
    for r in results:
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-4, atol=1e-6,
                                       msg=f"{entry}: {name}")
            seen.add(name)
    assert seen >= {n for n, _ in model.named_parameters()}, entry


@pytest.mark.parametrize("world,configs", [(2, "except_last:gpipe:1,always:interleaved:2,except_last:zbv:1"),
                                           (4, "always:gpipe:1,except_last:1f1b:1,always:zb-h1:1")])
def test_gradients_and_loss_equal_the_in_process_pipeline(tmp_path, world, configs):
    """Each configuration (checkpoint mode, schedule, virtual stages; interleaved: each rank holds 2 of the 4 stages),
    one after the other in one launch: the loss and every gradient are the in-process pipeline's."""
    run = launch("gpt", world, tmp_path, CONFIGS=configs)
    assert run.codes == [0] * world, run.log()
    ranks = [torch.load(tmp_path / f"rank{r}.pt")["configs"] for r in range(world)]
    ids, target = gpt_batch()
    for entry in configs.split(","):
        checkpoint, schedule, v = entry.split(":")
        results = [r[entry] for r in ranks]
        # In-process pipeline, same seeds: dropout masks are drawn per (stage, micro-batch) from the same seeds.
        torch.manual_seed(0)
        model = GPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.1).train()
        pipe = autopipe.compile(model, devices=world, chunks=4, checkpoint=checkpoint, schedule=schedule,
                                virtual_stages=int(v))
        torch.manual_seed(100)
        loss = pipe.step(ids, target=target, loss_fn=lm_loss)
        loss_rank = pipe.schedule.device_of(pipe.plan.n_stages - 1)  # zbv: the V turns back to rank 0
        assert results[loss_rank]["losses"][0] == pytest.approx(loss.item(), rel=1e-5), entry
        assert all(r["losses"] == [None, None] for k, r in enumerate(results) if k != loss_rank), entry
        assert_ranks_hold_the_models_grads(results, model, entry)
        # the tied embedding / LM head: summed across the first and the last rank, so both copies agree
        head = results[loss_rank]["grads"]  # zbv: rank 0 holds both ends, one tensor under the name wte.weight
        torch.testing.assert_close(results[0]["grads"]["wte.weight"],
                                   head.get("lm_head.weight", head.get("wte.weight")))
        pipe.close()


# 2 ranks: test_p2p's receive-buffer run trains zb-h1, zbv and dualpipev there against the plain model in float64;
# zb-h1 under "always" and zbv under "except_last" over ranks: test_gradients_and_loss_equal_the_in_process_pipeline;
# the experts over ranks: test_experts_given_rows_of_a_size_set_by_values_train_over_ranks_like_the_plain_model, and
# under zero bubble in process: test_zero_bubble.py; two inputs through the split backward: zbv here
@pytest.mark.parametrize("world,runs", [(4, "zb-h1=gpt:never|zbv=gpt:always,two_inputs:except_last")])
def test_zero_bubble_over_ranks_gives_the_plain_models_gradients_in_float64(tmp_path, world, runs):
    """zb-h1 and zbv over 4 gloo ranks, one launch (the other modes, models and 2 ranks run where the comment above
    says; test_zero_bubble.py runs every model in every mode in process): each parameter's gradient, on each rank that
    holds it, is the plain model's to 1e-10 (zbv: 8 stages in a V, the GPT's tied embedding and head on rank 0)."""
    run = launch("zoo", world, tmp_path, RUNS=runs)
    assert run.codes == [0] * world, run.log()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    expected_of = {}
    for schedule, names in (entry.split("=") for entry in runs.split("|")):
        results = [r[schedule] for r in ranks]
        if schedule in ("zbv", "dualpipev"):
            assert [r["stages"] for r in results] == [[d, 2 * world - 1 - d] for d in range(world)]
        for name, modes in (entry.split(":") for entry in names.split(",")):
            if name not in expected_of:
                model = build(name).double().eval()
                args, kwargs = double_inputs(name)
                per_sample_loss(model(*args, **kwargs), torch.zeros(8)).backward()
                expected_of[name] = (model, {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)
                                             if p.grad is not None})
            model, expected = expected_of[name]
            for checkpoint in modes.split("+"):
                seen = set()
                for r in results:
                    for n, grad in r["grads"][f"{name}/{checkpoint}"].items():
                        torch.testing.assert_close(grad, expected[n], rtol=0, atol=1e-10,
                                                   msg=f"{schedule} {name}/{checkpoint}: {n}")
                        seen.add(n)
                assert seen >= {n for n, _ in model.named_parameters()}, (schedule, name, checkpoint)


def assert_two_ranks_give_the_plain_models(results: list[dict], model, loss) -> None:
    """The loss on the last rank alone, and every parameter's float64 gradient on some rank, the plain model's."""
    assert results[1]["loss"] == pytest.approx(loss.item(), rel=1e-12) and results[0]["loss"] is None
    grads = {name: grad for r in results for name, grad in r["grads"].items()}
    assert set(grads) == {n for n, _ in model.named_parameters()}
    for name, grad in grads.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-10, atol=1e-12, msg=name)


def test_tensors_the_trace_made_are_no_model_attribute_under_torchrun(tmp_path):
    """fx's _tensor_constant* (a relative-position index built in the forward): each rank looked every planned tensor
    up in the model to materialise it and raised AttributeError (tests/test_placement.py's case, on the torchrun path)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from test_placement import RelativePositionViT
    run = launch("constants", 2, tmp_path)
    assert run.codes == [0, 0], run.log()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert results[0]["route"] == "fx"
    torch.manual_seed(0)
    model = RelativePositionViT().double()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    target = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(2))
    loss = F.cross_entropy(model(x), target)
    loss.backward()
    assert_two_ranks_give_the_plain_models(results, model, loss)


def test_a_tensor_argument_without_the_batch_reaches_every_rank_whole(tmp_path):
    """A (seq, seq) mask every layer reads: each rank takes it whole from its own arguments; float64, against the plain model."""
    run = launch("masked", 2, tmp_path)
    assert run.codes == [0, 0], run.log()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    model = build("masked").double()
    (x, mask), _ = random_inputs("masked", 8, torch.Generator().manual_seed(1))
    target = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    loss = F.mse_loss(model(x.double(), mask.double()), target)
    loss.backward()
    assert_two_ranks_give_the_plain_models(results, model, loss)


def test_experts_given_rows_of_a_size_set_by_values_train_over_ranks_like_the_plain_model(tmp_path):
    """x[mask], nonzero, torch.where: each rank sizes its experts' rows itself; what crosses between ranks has sizes fixed by the batch."""
    run = launch("moe", 3, tmp_path)
    assert run.codes == [0, 0, 0], run.log()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    model = build("moe").double()
    (x,), _ = random_inputs("moe", 8, torch.Generator().manual_seed(1))
    target = torch.randn(8, 5, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    loss = F.mse_loss(model(x.double()), target)
    loss.backward()
    assert results[-1]["loss"] == pytest.approx(loss.item(), rel=1e-12) and results[0]["loss"] is None
    grads = {name: grad for r in results for name, grad in r["grads"].items()}
    assert set(grads) == {n for n, _ in model.named_parameters()}
    for name, grad in grads.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-10, atol=1e-12, msg=name)


def test_pipeline_times_data_parallel(tmp_path):
    run = launch("dp", 4, tmp_path, DATA_PARALLEL=2, CHECKPOINT="never")
    assert run.codes == [0] * 4, run.log()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    ids, target = gpt_batch()
    # Each replica's in-process pipeline, same seeds (so the same dropout masks); the data-parallel
    # gradient is their average.
    expected = {}
    for replica in range(2):
        torch.manual_seed(0)
        m = GPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.1).train()
        p = autopipe.compile(m, devices=2, chunks=4, checkpoint="never")
        torch.manual_seed(100)
        p.step(ids.chunk(2)[replica], target=target.chunk(2)[replica], loss_fn=lm_loss)
        for n, q in m.named_parameters(remove_duplicate=False):
            expected[n] = expected.get(n, 0) + q.grad / 2
    for r in results:
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6)
    # replicas of the same stage hold identical gradients after the all-reduce
    for a, b in ((0, 2), (1, 3)):
        for name in results[a]["grads"]:
            torch.testing.assert_close(results[a]["grads"][name], results[b]["grads"][name])


def test_meta_model_materialises_only_this_ranks_parameters(tmp_path):
    run = launch("meta", 2, tmp_path)
    assert run.codes == [0, 0], run.log()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in results:
        assert set(r["mine"]).isdisjoint(r["on_meta"])  # its own: real
        assert r["on_meta"]  # the other rank's: still on meta, never allocated here
    # tied weights were initialised identically on both ranks
    torch.testing.assert_close(results[0]["state"]["wte.weight"], results[1]["state"]["lm_head.weight"]
                               if "lm_head.weight" in results[1]["state"] else results[1]["state"]["wte.weight"])
    # the loss is the plain model's, with the weights the two ranks materialised
    state = {**results[1]["state"], **results[0]["state"]}
    state["lm_head.weight"] = state["wte.weight"]
    plain = GPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.0)
    plain.load_state_dict(state)
    (ids, _), (_, target) = results[0]["batch"], results[1]["batch"]
    assert results[0]["loss"] is None  # the loss is on the last rank
    assert results[1]["loss"] == pytest.approx(lm_loss(plain(ids), target).item(), rel=1e-5)
    for r in results:  # pipe.to() is refused, as in-process: it would move this rank's stages only, not the plan
        assert "placement" in r["moved"] and r["dtypes"] == {torch.float32}


@pytest.mark.parametrize("world,schedule,norm_type,seq_lens,accumulate", [(2, "gpipe", 2.0, "16,24,12,16", 2),
                                                                          (4, "1f1b", math.inf, "16,16,20,16", 1)])
def test_a_training_loop_with_clipping_and_a_new_length_a_step_is_the_plain_models(tmp_path, world, schedule,
                                                                                  norm_type, seq_lens, accumulate):
    """AdamW, pipe.clip_grad_norm_ every optimizer step (the norm over every stage, the tied embedding and LM head
    counted once), dynamic padding (a longer, then a shorter sequence: a program per shape, one cut for all) and
    gradient accumulation over 2 batches (the tie summed over its ranks once a batch: Note [a tie sums the step's
    gradient alone]): every parameter, loss and total norm is the plain model's, in float64."""
    from test_clipping import plain_loop
    run = launch("loop", world, tmp_path, NORM_TYPE=norm_type, MAX_NORM=0.5, SEQ_LENS=seq_lens, SCHEDULE=schedule,
                 SKEW=1, ACCUMULATE=accumulate)
    assert run.codes == [0] * world, run.log()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    lengths = [int(n) for n in seq_lens.split(",")]
    params, losses, norms = plain_loop(lengths, 0.5, norm_type, accumulate)
    for r in ranks:
        assert r["norms"] == pytest.approx(norms, rel=1e-12), "every rank scales by the plain model's norm"
        assert r["programs"] == len(set(lengths))
    assert min(norms) > 0.5  # clipping is active
    assert ranks[-1]["losses"] == pytest.approx(losses, rel=1e-12)
    seen = set()
    for r in ranks:
        for name, p in r["params"].items():
            torch.testing.assert_close(p, params[name], rtol=1e-10, atol=1e-10)
            seen.add(name)
    assert seen == set(params)  # every parameter, the tied head under both names
    # then the last rank is called with a shorter batch than the others: every rank refuses before anything is sent,
    # naming the argument and both shapes (no gloo size error, no hang)
    for rank, r in enumerate(ranks):
        here, there = ((8, 18), (8, 14)) if rank < world - 1 else ((8, 14), (8, 18))
        assert f"argument idx is of shape {here} (torch.int64) here but of shape {there}" in r["skewed"], r["skewed"]


def test_a_plan_made_on_one_rank_and_broadcast_gives_every_rank_its_cut(pp_run):
    """docs/torchrun.md's recipe for a measured cut: ``broadcast_object_list`` of rank 0's plan, then
    ``compile(..., balance=plan)``: every rank plans that cut, not its own (mesh_worker.given_cut_scenario)."""
    for r in pp_run:
        got = r["given_cut"]
        assert got["stages"] == got["made"] != got["default"]
        assert got["notes"][-1].startswith("the cut is the given plan's (balanced by shares")
