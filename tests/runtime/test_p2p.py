"""The torch.distributed transport (autopipe/runtime/p2p.py, wire.py): what travels between ranks, and
how a failure on one rank ends every rank. Real processes on 127.0.0.1 (gloo) started the way torchrun
starts them (test_distributed.launch); each rank runs tests/runtime/dist_worker.py."""
import json

import pytest
import torch

import autopipe
from autopipe.ir.plan import TensorInfo
from autopipe.runtime.wire import Edge, ReceiveBuffers, WireSpec
from dist_worker import SkipGPT, skip_loss
from test_distributed import assert_ranks_hold_the_models_grads, gpt_batch, launch


def _skip_plan(devices: int):
    model = SkipGPT(vocab=64, d=32, heads=4, layers=devices, block=16, dropout=0.1)
    ids, _ = gpt_batch()
    return autopipe.plan(model, (ids,), devices=devices, chunks=4)


# -- the wire spec ---------------------------------------------------------------------------------

@pytest.mark.parametrize("devices", [3, 4])
def test_wire_spec_sends_a_skip_straight_to_its_reader_and_early_outputs_to_the_last_rank(devices):
    plan = _skip_plan(devices)
    spec = WireSpec.from_plan(plan)
    last = plan.n_stages - 1
    by_name = {e.name: e for e in spec.edges}
    assert len(by_name) == len(spec.edges)  # one edge per value: a value is never relayed stage to stage

    skips = [info for info in plan.tensors.values() if info.producer >= 0 and info.consumers
             and max(info.consumers) >= info.producer + 2]
    assert skips, f"the plan has no skip over a stage:\n{plan}"
    for info in skips:
        edge = by_name[info.name]
        assert edge.src == info.producer
        assert edge.dsts == tuple(sorted(set(info.consumers) - {info.producer})), edge
        for between in range(info.producer + 1, max(info.consumers)):
            if between not in info.consumers:  # a stage in between neither receives nor forwards it
                assert between not in edge.dsts
                assert info.name not in plan.stages[between].inputs
                assert info.name not in {e.name for e in spec.out_of(between)}
    # the embeddings skip from the first stage to the last
    assert any(info.producer == 0 and last in info.consumers for info in skips), plan

    early = [info for info in plan.tensors.values() if info.is_output and 0 <= info.producer < last]
    assert early, f"no model output is made before the last stage:\n{plan}"
    for info in early:
        edge = by_name[info.name]
        assert edge.src == info.producer and last in edge.dsts, edge  # the loss runs on the last rank
        assert edge.dsts == tuple(sorted(set(info.consumers) - {info.producer} | {last}))
    outputs_of_last = set(plan.stages[last].outputs)
    for name in plan.graph_outputs:  # every model output is on the last rank, made there or received
        assert name in outputs_of_last or last in by_name[name].dsts

    # every rank derives the same spec from the same plan; another plan has another digest
    assert WireSpec.from_plan(_skip_plan(devices)).digest() == spec.digest()
    assert WireSpec.from_plan(_skip_plan(devices + 1)).digest() != spec.digest()


@pytest.mark.parametrize("world, configs", [(3, "1:gpipe,1:zb-h1,2:zbv"), (2, "2:interleaved,2:zbv")])
def test_skip_and_early_output_between_real_ranks_equal_the_in_process_pipeline(tmp_path, world, configs):
    """v=2 (interleaved, stage s on rank s % 2): a skip to a stage on the same rank is handed over in
    memory, one to the other rank is sent; both carry gradients back. zbv: rank d holds stages d and 2K-1-d, so
    activations travel to lower ranks on the way up the V and the loss runs on rank 0; zb-h1 and zbv post W tasks,
    which move nothing, between the others. The configurations of one world run one after the other in one launch."""
    run = launch("skip", world, tmp_path, CONFIGS=configs)
    assert run.codes == [0] * world, run.log()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for entry in configs.split(","):
        v, schedule = int(entry.split(":")[0]), entry.split(":")[1]
        results = [r[entry] for r in ranks]
        edges = results[0]["edges"]
        last = world * v - 1
        assert any(src == 0 and last in dsts and 1 not in dsts for _, src, dsts in edges), edges  # 0 -> last direct
        if schedule == "interleaved":
            assert any(src == 0 and 2 in dsts for _, src, dsts in edges), edges  # 0 -> 2: both on rank 0
        ids, target = gpt_batch()
        torch.manual_seed(0)
        model = SkipGPT(vocab=64, d=32, heads=4, layers=world * v, block=16, dropout=0.1).train()
        model.skip_to = world + 1 if v > 1 else None
        pipe = autopipe.compile(model, devices=world, chunks=4, schedule=schedule, virtual_stages=v)
        torch.manual_seed(100)
        loss = pipe.step(ids, target=target, loss_fn=skip_loss)
        loss_rank = pipe.schedule.device_of(last)
        assert loss_rank == (0 if schedule == "zbv" else world - 1)
        assert results[loss_rank]["loss"] == pytest.approx(loss.item(), rel=1e-5), entry
        assert all(r["loss"] is None for k, r in enumerate(results) if k != loss_rank), entry
        assert_ranks_hold_the_models_grads(results, model, entry)
        # every pair of ranks posts its messages in one order on both ends (NCCL, unlike gloo, ignores tags)
        for a in range(world):
            for b in range(world):
                sent = [tag for send, peer, tag in results[a]["posts"] if send and peer == b]
                received = [tag for send, peer, tag in results[b]["posts"] if not send and peer == a]
                assert sent == received, (entry, a, b)
        pipe.close()


def test_a_receive_buffer_is_written_again_only_once_nothing_holds_it():
    """The pool hands a buffer out again once its holders are gone: the stage input made from it, which a saved
    tensor of the stage's graph keeps until its backward; a view; a user's reference over a step's end."""
    edge = Edge("h", 0, (1,), TensorInfo("h", (8, 4), torch.float64, 256, 0, (1,)))
    cpu = torch.device("cpu")
    pool = ReceiveBuffers()
    first = pool.take(edge, 2, cpu, False)
    assert first.shape == (2, 4) and first.dtype == torch.float64
    w = torch.ones(4, dtype=torch.float64, requires_grad=True)
    leaf = first.detach().requires_grad_()  # as the runtime makes a stage input
    loss = (leaf * w).sum()  # saves the leaf for w's gradient
    del leaf, first
    second = pool.take(edge, 2, cpu, False)
    assert pool.take(edge, 3, cpu, False).shape == (3, 4)  # another micro-batch size: another buffer
    loss.backward()  # the graph lets go of the first buffer's memory
    del loss
    view = second[1:]
    third = pool.take(edge, 2, cpu, False)
    assert third is not second  # the first buffer, now free
    del third
    assert pool.take(edge, 2, cpu, False) is not second
    del view
    kept = pool.take(edge, 2, cpu, False)
    pool.forget_held()  # a step starts while the caller still holds it: never written again
    assert all(pool.take(edge, 2, cpu, False) is not kept for _ in range(3))


REUSE_CONFIGS = "1:gpipe,1:1f1b,2:interleaved,1:zb-h1,1:zbv,1:dualpipev"


def test_receive_buffers_reused_over_steps_keep_every_schedules_float64_gradients(tmp_path):
    """Each schedule with more than one micro-batch in flight, 3 steps of new batches over 2 CPU ranks: a receive
    buffer is written again only when nothing holds it (Note [receive buffers reused]), so each step's loss and every
    gradient are the plain model's in float64, while the buffers of later steps are the first step's (a 1F1B rank
    reuses them within a step too)."""
    run = launch("reuse", 2, tmp_path, CONFIGS=REUSE_CONFIGS)
    assert run.codes == [0, 0], run.log()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.manual_seed(0)
    plain = SkipGPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.0).double().train()
    plain.skip_to = 2
    g, losses, grads = torch.Generator().manual_seed(1), [], []
    for _ in range(3):
        ids, target = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)
        loss = skip_loss(plain(ids), target)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in plain.named_parameters(remove_duplicate=False)})
        plain.zero_grad()
    for entry in REUSE_CONFIGS.split(","):
        results = [r[entry] for r in ranks]
        got = next(r["losses"] for r in results if r["losses"][0] is not None)
        assert got == pytest.approx(losses, rel=1e-12), entry
        for step, expected in enumerate(grads):
            seen = set()
            for r in results:
                for name, grad in r["grads"][step].items():
                    torch.testing.assert_close(grad, expected[name], rtol=1e-10, atol=1e-12,
                                               msg=f"{entry} step {step}: {name}")
                    seen.add(name)
            assert seen >= {n for n, _ in plain.named_parameters()}, entry
        for r in results:
            assert r["pooled"][0] == r["pooled"][-1] <= r["posted"][0], (entry, r)  # no new buffer after step 1
    assert any(r["1:1f1b"]["pooled"][0] < r["1:1f1b"]["posted"][0] for r in ranks), "1F1B reuses within a step"


# -- failures --------------------------------------------------------------------------------------

SCENARIOS = {
    # id: (TRAP action, TRAP_AT, TRAP_PHASE)
    "raise-forward-middle": ("raise", "trap1", "fwd"),
    "raise-backward-last": ("raise", "trap2", "bwd"),
    "raise-in-loss": ("raise", "loss", "fwd"),
    "sigkill-backward-first": ("kill", "trap0", "bwd"),
    "hang-forward-middle": ("hang", "trap1", "fwd"),
}
HANG_TIMEOUT = 5.0     # compile(timeout=...) for the hang: every wait on a peer is bounded by it
PROMPT = 10.0          # raise / kill: seconds from the failure to each rank's PipelineError (timeout is 60 s)
MARGIN = 10.0          # hang: seconds past the timeout


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_failing_rank_ends_every_rank_promptly_naming_it(tmp_path, scenario):
    action, at, phase = SCENARIOS[scenario]
    world = 3
    timeout = HANG_TIMEOUT if action == "hang" else 60.0
    run = launch("trap", world, tmp_path, timeout=120, stop_after=5 if action == "hang" else None,
                 TRAP=action, TRAP_AT=at, TRAP_PHASE=phase, TIMEOUT=timeout)
    culprit = int((tmp_path / "trap_rank.txt").read_text())
    if at == "trap0":
        assert culprit == 0
    if at in ("trap2", "loss"):
        assert culprit == world - 1
    assert (tmp_path / "inject.json").exists(), f"the trap never fired\n{run.log()}"
    injected = json.loads((tmp_path / "inject.json").read_text())
    assert injected["rank"] == culprit

    for r in range(world):
        if r == culprit and action != "raise":
            continue
        path = tmp_path / f"rank{r}.err"
        assert path.exists(), f"rank {r} ended without an error (exit {run.codes[r]})\n{run.log()}"
        err = json.loads(path.read_text())
        text = err["message"]
        assert err["type"] == "PipelineError", err
        # it exits with an error (3 from dist_worker; seen too: -6, SIGABRT "terminate called without an
        # active exception" while the interpreter tears down after the failure)
        assert run.codes[r] != 0, run.log()
        detected = err["time"] - injected["time"]
        if action == "raise":
            assert f"rank {culprit} failed in" in text and "trap sprung on purpose" in text, text
            where = {"fwd": "forward of micro-batch 1", "bwd": "backward of micro-batch 2"}[phase]
            assert where in text, text
        elif action == "kill":
            assert f"rank {culprit} closed its connections" in text, text
        else:
            assert f"rank {culprit} is hung or far too slow" in text and f"after {timeout:g} s" in text, text
        if action == "hang":
            assert timeout - 1.0 < detected < timeout + MARGIN, f"rank {r}: {detected:.2f} s after the hang"
        else:
            assert "timed out" not in text, text
            assert detected < PROMPT, f"rank {r}: {detected:.2f} s after the failure: {text}"
    if action == "kill":
        assert run.codes[culprit] == -9
    if action == "hang":
        assert run.codes[culprit] == -9  # killed by the launcher, as torchrun's agent would
    else:
        assert run.seconds < 60, f"took {run.seconds:.1f} s"  # every rank ended by itself, well before the timeout
