"""Running a step: the model adapter that runs unmodified mlx-lm models on the pool (and the
load-time check of which architectures may use it), the batched sampler, the overlapped
step itself, its output (tokens to events) and telemetry, and the fallback engine for
models the pool cannot run.
"""
