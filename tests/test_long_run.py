"""1,000 steps of a small model: no growth in memory held or in thread count."""
import gc
import threading

import psutil
import torch

import autopipe
from zoo import MLP


def test_a_thousand_steps_leak_nothing():
    torch.manual_seed(0)
    model = MLP(depth=4)
    pipe = autopipe.compile(model, devices=3, chunks=4, checkpoint="except_last")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    process = psutil.Process()

    def one_step():
        loss = torch.nn.functional.mse_loss(pipe(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(100):  # warm up allocator and caches
        one_step()
    gc.collect()
    rss_before, threads_before = process.memory_info().rss, threading.active_count()
    for _ in range(900):
        one_step()
    gc.collect()
    rss_growth = process.memory_info().rss - rss_before
    assert threading.active_count() == threads_before
    assert rss_growth < 20 * 2**20, f"RSS grew by {rss_growth / 2**20:.1f} MiB over 900 steps"
    pipe.close()
