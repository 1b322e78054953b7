"""What a plan holds in memory and how long its step takes, per schedule, checkpoint mode and chunks: pure functions
over a Plan and its CostedGraph, no runtime starts and no real memory is touched. Activations are what autograd saves,
counted on fake tensors with pipe.memory's hook. Not modelled: the backward's transient gradients, the allocator, the
loss outside the pipeline."""
from .choice import AutoChoice, Candidate, choose_configuration
from .prediction import (BACKWARD_FACTOR, DEVICE_FLOPS, OP_SECONDS, OPTIMIZER_STATE, RECOMPUTE_FACTOR, TASK_SECONDS,
                         MemoryPrediction, PredictedMemory, predict_memory, predicted_step_time)
from .saved_tensors import SavedTensors, saved_tensors

__all__ = ["predict_memory", "PredictedMemory", "MemoryPrediction", "predicted_step_time", "choose_configuration",
           "AutoChoice", "Candidate", "saved_tensors", "SavedTensors", "OPTIMIZER_STATE", "BACKWARD_FACTOR",
           "RECOMPUTE_FACTOR", "DEVICE_FLOPS", "TASK_SECONDS", "OP_SECONDS"]
