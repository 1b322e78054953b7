"""One rank of test_loss.py's torchrun runs: the token-mean losses over gloo, float64; saves each rank's gradients and
loss. Run by test_distributed.launch as ``python loss_worker.py <out_dir>``."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the root: zoo/

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopipe
from test_loss import CAUSAL_LM_LOSSES, CausalLM, Classifier, ignored_targets, labelled_tokens, small_gpt, token_sum


def main():
    out_dir = sys.argv[-1]
    torch.set_num_threads(1)
    rank, results = int(os.environ["RANK"]), {}
    x, y = ignored_targets()
    ids, labels = labelled_tokens()
    runs = {"F.cross_entropy": (Classifier, (x,), {"target": y, "loss_fn": F.cross_entropy}, "gpipe"),
            "(sum, count)": (Classifier, (x,), {"target": y, "loss_fn": token_sum}, "1f1b"),
            "the model's own": (CausalLM, (ids, labels), {"loss_fn": lambda out, _: out[0]}, "1f1b"),
            "a causal LM's lambda": (small_gpt, (ids,), {"target": labels, "loss_fn": CAUSAL_LM_LOSSES[
                "F.cross_entropy of shifted labels"]}, "1f1b")}
    for name, (model_type, args, kwargs, schedule) in runs.items():
        torch.manual_seed(0)
        pipe = autopipe.compile(model_type().double(), chunks=4, schedule=schedule, timeout=30)
        loss = pipe.step(*args, **kwargs)
        results[name] = {"loss": None if loss is None else loss.item(),
                         "grads": {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}}
        pipe.close()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
