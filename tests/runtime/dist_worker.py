"""One rank of a distributed test: ``python dist_worker.py SCENARIO OUT_DIR`` with torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Writes this rank's results to OUT_DIR."""
import os
import signal
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import autopipe  # noqa: E402
from models import GPT  # noqa: E402

torch.set_num_threads(1)


class Trap(nn.Module):
    """Fails on one rank, on micro-batch 1, in the way the scenario asks."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.armed = False  # compiling runs the module too (fake tensors): arm it for the steps only
        self.calls = 0

    def forward(self, x):
        self.calls += self.armed
        scenario = os.environ.get("TRAP", "")
        if self.armed and self.calls == 2:  # micro-batch 1, on the rank that holds this module
            if scenario == "raise":
                raise ValueError("trap sprung on purpose")
            if scenario == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        return self.fc(x)


class TrapModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])
        self.trap = Trap()
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for b in self.blocks[:2]:
            h = torch.tanh(b(h))
        h = self.trap(h)
        for b in self.blocks[2:]:
            h = torch.tanh(b(h))
        return self.out(h)


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def main():
    scenario, out_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    data_parallel = int(os.environ.get("DATA_PARALLEL", "1"))
    torch.manual_seed(0)
    if scenario in ("gpt", "dp"):
        model = GPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.1).train()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 64, (16, 16), generator=g)
        target = torch.randint(0, 64, (16, 16), generator=g)
        if scenario == "dp":
            replica = rank // (int(os.environ["WORLD_SIZE"]) // data_parallel)
            ids, target = ids.chunk(data_parallel)[replica], target.chunk(data_parallel)[replica]
        pipe = autopipe.compile(model, chunks=4, checkpoint=os.environ.get("CHECKPOINT", "except_last"),
                                data_parallel=data_parallel, timeout=30)
        losses = []
        for step in range(2):
            torch.manual_seed(100 + step)  # the same on every rank: the same dropout masks as in-process
            loss = pipe.step(ids, target=target, loss_fn=lm_loss)
            losses.append(None if loss is None else loss.item())
            if step == 0:
                grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
                pipe.zero_grad()
        torch.save({"grads": grads, "losses": losses, "stage": pipe.stage_index, "plan": str(pipe.plan),
                    "state": pipe.state_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))
    elif scenario == "trap":
        model = TrapModel()
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        pipe = autopipe.compile(model, chunks=4, timeout=float(os.environ.get("TIMEOUT", "20")),
                                leaf_modules=[Trap], example_inputs=(x,))
        model.trap.armed = True
        if "trap" in pipe.plan.stages[pipe.stage_index].nodes:
            with open(os.path.join(out_dir, "trap_rank.txt"), "w") as f:
                f.write(str(rank))
        try:
            for _ in range(3):
                pipe.step(x, target=y, loss_fn=F.mse_loss)
        except Exception as e:
            with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
                f.write(f"{type(e).__name__}: {e}")
            sys.exit(3)
    elif scenario == "meta":
        with torch.device("meta"):
            model = GPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.0)
        pipe = autopipe.compile(model, chunks=2, example_inputs=(torch.randint(0, 64, (4, 16)),))
        on_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        mine = [n for n, p in pipe.named_parameters()]
        loss = pipe.step(torch.randint(0, 64, (4, 16)), target=torch.randint(0, 64, (4, 16)), loss_fn=lm_loss)
        torch.save({"on_meta": on_meta, "mine": mine, "loss": None if loss is None else loss.item(),
                    "state": pipe.state_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))
    import torch.distributed as dist
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
