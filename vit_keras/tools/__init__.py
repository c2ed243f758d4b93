"""The application half of vit_keras: what the command-line apps in `apps/` are built from.

`data` (tf.data pipelines), `recipes` (optimizers and schedules), `callbacks`, `distribution`
and `sharding` (fully sharded data parallelism),
`run_config` (a run's settings, the training apps' flags), `training` (one run, end to end, the
one training loop), `run_parts` (a run's optional parts: LoRA, linear probe, remat, layer decay,
EMA), `objectives` (what a run optimises: classification or masked patch prediction), `memory`
(whether a training step fits), `evaluation` (a classifier's reports and top-k predictions),
`config_flags` (the apps' flags from dataclasses), `run_folder` (a run's files), `export`
(SavedModel, LiteRT, ONNX) and `plots` (the inspection figures, a run's training curves). These
import TensorFlow or matplotlib where they need them; the library core (`vit_keras.*`,
`vit_keras.weights`) never imports this package. Import the modules themselves, e.g.
`from vit_keras.tools import data`.
"""
