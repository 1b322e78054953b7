"""autopipe: compile an unmodified PyTorch model into a GPipe pipeline.

    pipe = autopipe.compile(model, devices=4, chunks=8)
    loss_fn(pipe(x), y).backward()      # gradients land on the model's own parameters
    print(pipe.plan); print(pipe.stages[1].code)
"""
from autopipe.compile import compile, plan
from autopipe.plan import Plan, StagePlan
from autopipe.runtime.pipeline import Pipeline
from autopipe.runtime.schedule import Schedule

__all__ = ["compile", "plan", "Pipeline", "Plan", "StagePlan", "Schedule"]
__version__ = "0.1.0"
