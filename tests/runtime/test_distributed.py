"""Real torch.distributed processes on 127.0.0.1 (gloo): one stage per rank."""
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import autopipe
from models import GPT

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario, world, out_dir, timeout=120, **env):
    """Start ``world`` ranks the way torchrun does: its environment contract, and the rendezvous
    store hosted outside the ranks (torchrun's agent hosts it), so it outlives any rank."""
    import torch.distributed as dist
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)  # noqa: F841
    procs = []
    for rank in range(world):
        e = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1", TORCHELASTIC_USE_AGENT_STORE="True",
                 **{k: str(v) for k, v in env.items()})
        procs.append(subprocess.Popen([sys.executable, WORKER, scenario, str(out_dir)], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    start = time.monotonic()
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{scenario}: ranks still running after {timeout} s")
        outputs.append(out)
    return [p.returncode for p in procs], outputs, time.monotonic() - start


def gpt_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (16, 16), generator=g), torch.randint(0, 64, (16, 16), generator=g)


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


@pytest.mark.parametrize("world,checkpoint", [(2, "except_last"), (4, "always")])
def test_gradients_and_loss_equal_the_in_process_pipeline(tmp_path, world, checkpoint):
    codes, outs, _ = launch("gpt", world, tmp_path, CHECKPOINT=checkpoint)
    assert codes == [0] * world, "\n".join(outs)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    ids, target = gpt_batch()
    # In-process pipeline, same seeds: dropout masks are drawn per (stage, micro-batch) from the same seeds.
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.1).train()
    pipe = autopipe.compile(model, devices=world, chunks=4, checkpoint=checkpoint)
    torch.manual_seed(100)
    loss = pipe.step(ids, target=target, loss_fn=lm_loss)
    assert results[-1]["losses"][0] == pytest.approx(loss.item(), rel=1e-5)
    assert all(r["losses"] == [None, None] for r in results[:-1])
    seen = set()
    for r in results:
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-4, atol=1e-6)
            seen.add(name)
    assert seen >= {n for n, _ in model.named_parameters()}  # every parameter got its gradient somewhere
    # the tied embedding / LM head: summed across the first and the last rank, so both copies agree
    torch.testing.assert_close(results[0]["grads"]["wte.weight"], results[-1]["grads"]["lm_head.weight"])


def test_pipeline_times_data_parallel(tmp_path):
    codes, outs, _ = launch("dp", 4, tmp_path, DATA_PARALLEL=2, CHECKPOINT="never")
    assert codes == [0] * 4, "\n".join(outs)
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


@pytest.mark.parametrize("trap", ["raise", "kill"])
def test_a_failing_rank_ends_every_rank_promptly(tmp_path, trap):
    codes, outs, seconds = launch("trap", 3, tmp_path, TRAP=trap, TIMEOUT=60)
    assert seconds < 45, f"took {seconds:.1f} s"  # far below the 60 s per-wait timeout
    assert all(c != 0 for c in codes), (codes, outs)
    culprit = int((tmp_path / "trap_rank.txt").read_text())
    for r in set(range(3)) - {culprit}:
        text = (tmp_path / f"rank{r}.err").read_text()
        assert f"rank {culprit}" in text, text
        if trap == "raise":
            assert "trap sprung on purpose" in text and "micro-batch 1" in text, text
    if trap == "kill":
        assert codes[culprit] == -9


def test_meta_model_materialises_only_this_ranks_parameters(tmp_path):
    codes, outs, _ = launch("meta", 2, tmp_path)
    assert codes == [0, 0], "\n".join(outs)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in results:
        assert set(r["mine"]).isdisjoint(r["on_meta"])  # its own: real
        assert r["on_meta"]  # the other rank's: still on meta, never allocated here
    assert results[1]["loss"] is not None and results[1]["loss"] == results[1]["loss"]
    # tied weights were initialised identically on both ranks
    torch.testing.assert_close(results[0]["state"]["wte.weight"], results[1]["state"]["lm_head.weight"]
                               if "lm_head.weight" in results[1]["state"] else results[1]["state"]["wte.weight"])
