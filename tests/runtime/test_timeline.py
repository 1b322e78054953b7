import json

import torch

import autopipe
from models import build


def test_timeline_records_every_task_and_prints(tmp_path):
    model = build("mlp")
    pipe = autopipe.compile(model, devices=3, chunks=4, checkpoint="always")
    pipe(torch.randn(16, 8)).sum().backward()
    tl = pipe.timeline
    kinds = {(e.stage, e.micro_batch, e.kind) for e in tl.events}
    for s in range(3):
        for i in range(4):
            assert {(s, i, "forward"), (s, i, "recompute"), (s, i, "backward")} <= kinds
    for s in range(3):  # a stage's own tasks never overlap in time
        spans = sorted((e.start, e.end) for e in tl.events if e.stage == s and e.kind in ("forward", "backward"))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    text = str(tl)
    assert text.count("stage ") == 3 and "measured" in text and "0.333" in text
    with open(tl.save_chrome_trace(tmp_path / "trace.json")) as f:
        trace = json.load(f)
    assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X") == len(tl.events)
    assert 0.0 <= tl.measured_bubble < 1.0
