"""Train a small GPT as a pipeline over torch.distributed, one stage per process.

    torchrun --nproc-per-node 2 examples/train_distributed.py
    torchrun --nproc-per-node 4 examples/train_distributed.py --data-parallel 2   # 2 stages x 2 replicas

Every rank builds the same model and calls pipe.step with the same batch (each stage reads
only the inputs it uses); the loss comes back on the last stage's ranks.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import autopipe  # noqa: E402
from demo import TinyGPT, batch_of_text  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--data-parallel", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same weights on every rank
    model = TinyGPT()
    pipe = autopipe.compile(model, chunks=args.chunks, data_parallel=args.data_parallel, verbose=True)
    optimizer = None
    generator = torch.Generator().manual_seed(0)
    loss_fn = lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten())
    for step in range(1, args.steps + 1):
        x, y = batch_of_text(generator)
        if args.data_parallel > 1:  # each replica takes its own share of the batch
            x, y = x.chunk(args.data_parallel)[pipe.replica], y.chunk(args.data_parallel)[pipe.replica]
        loss = pipe.step(x, target=y, loss_fn=loss_fn)
        if optimizer is None:  # this rank's stage exists after the first step
            optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None and (step % 5 == 0 or step == 1):
            print(f"[rank {pipe.rank}, stage {pipe.stage_index}] step {step:2d}  loss {loss.item():.3f}", flush=True)
    if pipe.rank == 0:
        print(pipe.plan)
    pipe.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
