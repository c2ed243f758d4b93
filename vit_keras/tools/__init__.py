"""The application half of vit_keras: what the command-line apps in `apps/` are built from, one
sub-package or module per concern.

- `runs`: a training run, end to end: `training` (the one training loop), `run_config` (a run's
  settings, the training apps' flags), `config_flags` (the apps' flags from dataclasses),
  `objectives` (classification or masked patch prediction), `recipes` (optimizers and
  schedules), `run_parts` (LoRA, linear probe, remat, layer decay, EMA as parts of a run), `ema`,
  `callbacks`, `evaluation` (a classifier's reports and top-k predictions) and `run_folder` (a
  run's files).
- `distributed`: one run over several devices and processes: `distribution`, `sharding` (fully
  sharded data parallelism), `sharded_checkpoint` (Orbax) and `memory` (whether a training step
  fits).
- `data` (tf.data pipelines), `finetuning` (LoRA, the linear probe, rematerialised blocks),
  `export` (SavedModel, LiteRT, ONNX) and `plots` (the inspection figures, a run's training
  curves).

Imports point one way: `runs` uses `distributed`, `data`, `finetuning` and `plots`; `export` reads
a run folder; none of those imports `runs`. These import TensorFlow or matplotlib where they need
them; the library core (`vit_keras.*`, `vit_keras.weights`) never imports this package. Import
the modules themselves, e.g. `from vit_keras.tools.runs import training`. The flat paths of
before (`vit_keras.tools.training`) are stand-ins behind a dated `DeprecationWarning`
(`vit_keras._moved`).
"""

import sys as _sys

from vit_keras import _moved

_moved.register(_sys.modules[__name__])
