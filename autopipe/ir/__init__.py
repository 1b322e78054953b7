"""What the passes hand the runtime, and what both read: the Plan and its facts (plan.py), the CUDA-graph capture
report (capture.py), the schedule tables (schedule.py), the re-materialisation modes (checkpoint.py), and which tensors
carry the batch (batch.py). Plain data and pure functions: these modules import nothing else of autopipe, the passes
(passes/) and the runtime (runtime/) import these and never each other (tests/test_layout.py)."""
