"""A training run, end to end: `training.run` (the one training loop) takes a `run_config.RunConfig`
(the training apps' flags, defined by `config_flags`) and an `objectives.Objective`, resolves a
`recipes.Recipe`, applies the `run_parts` the flags ask for (LoRA, linear probe, remat, layer
decay, `ema`), trains with `callbacks`, reports through `evaluation`, and writes a run folder whose
files `run_folder` alone knows. Import the modules themselves; this package imports none of them.
"""
