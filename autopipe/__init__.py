"""autopipe: compile an unmodified PyTorch model into a pipeline (README.md; design: docs/architecture.md)."""
from autopipe.compile import compile, plan
from autopipe.ir.plan import Plan, StagePlan
from autopipe.ir.schedule import Schedule
from autopipe.errors import (BatchSpecialised, CompileError, InputMismatch, ModuleCastRefused, NoFeasiblePlan,
                             PipelineError, StageFailure, TraceError, UnroutedRandomOp)
from autopipe.options import Options
from autopipe.pass_chain import run_passes
from autopipe.runtime.distributed import DistributedPipeline
from autopipe.runtime.pipeline import Pipeline
from autopipe.runtime.streams import sm_slices
from autopipe.verify import verify
from autopipe.verify_report import VerifyReport

__all__ = ["compile", "plan", "verify", "run_passes", "Options", "Pipeline", "DistributedPipeline", "Plan",
           "StagePlan", "Schedule", "VerifyReport", "BatchSpecialised", "CompileError", "InputMismatch",
           "ModuleCastRefused", "NoFeasiblePlan",
           "PipelineError", "StageFailure", "TraceError", "UnroutedRandomOp", "sm_slices"]
__version__ = "0.2.0"
