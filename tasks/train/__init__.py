"""The DeepSpeed 3D-parallel trainer: model, data sampler, checkpoint protocol, launcher, worker.

Importing this package is cheap; torch and deepspeed are imported by the
submodules that need them (`model`, `worker`), not here.
"""
