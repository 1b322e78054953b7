"""A Hugging Face GPT-2, unmodified, built from a config (random weights, no download),
compiled to 4 CPU workers and trained for a few steps. fx cannot trace it; autopipe falls
back to torch.export and says so in the plan.

Run: python examples/huggingface_gpt2.py   (needs `pip install transformers`)
"""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import autopipe


def main():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=8, n_embd=128, n_head=4, vocab_size=256, n_positions=64,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)  # lm_head is tied to the token embedding
    pipe = autopipe.compile(model, devices=4, chunks=8)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for step in range(1, 11):
        start = torch.randint(0, 256, (32, 1), generator=generator)
        ids = (start + torch.arange(64)) % 256  # a learnable toy sequence
        loss = pipe.step(input_ids=ids, labels=ids)  # the model computes its own loss from labels
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            print(pipe.plan)
            print(pipe.stages[1].code.split("def forward")[0])  # the stage header: what goes in and out
        print(f"step {step:2d}  loss {loss.item():.3f}")
    pipe.close()


if __name__ == "__main__":
    main()
