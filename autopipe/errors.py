"""Every exception a user of autopipe may catch, in one place (each is defined beside the code that raises it)."""
from autopipe.ir.batch import InputMismatch
from autopipe.passes.cut_solver import NoFeasiblePlan
from autopipe.passes.diagnostics import BatchSpecialised, CompileError, ModuleCastRefused, TraceError
from autopipe.random_ops import UnroutedRandomOp
from autopipe.runtime.executor import StageFailure
from autopipe.runtime.p2p import PipelineError

__all__ = ["BatchSpecialised", "CompileError", "InputMismatch", "ModuleCastRefused", "NoFeasiblePlan", "PipelineError",
           "StageFailure", "TraceError", "UnroutedRandomOp"]
