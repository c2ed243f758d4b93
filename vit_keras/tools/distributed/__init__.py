"""One run over several devices and processes: `distribution` (data, model and fully sharded
parallelism, several JAX processes), `sharding` (fsdp's rule from each weight's shape, what a
device holds), `sharded_checkpoint` (Orbax checkpoints each process writes its shards of) and
`memory` (whether a training step fits on a device). Nothing here imports `vit_keras.tools.runs`.
Import the modules themselves; this package imports none of them.
"""
