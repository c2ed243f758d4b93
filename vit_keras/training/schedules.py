"""Learning-rate schedules the training recipes save inside a model's optimizer.

Part of the library core so that `import vit_keras` registers them: `keras.models.load_model`
then reads a compiled model written by the apps (its optimizer and schedule included) with
nothing else imported. Imports only Keras."""

import math

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="vit_keras")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """vit_jax's `create_learning_rate_schedule`: linear warm-up from 0, then cosine or linear decay.

        progress = clip((step - warmup_steps) / (total_steps - warmup_steps), 0, 1)
        cosine:  lr = base * 0.5 * (1 + cos(pi * progress))
        linear:  lr = end + (base - end) * (1 - progress)
        lr *= min(1, step / warmup_steps)

    `steps_per_update` divides the optimizer's iteration counter, which Keras advances on every
    batch even when gradients are accumulated, so `step` counts updates.
    """

    def __init__(self, base_learning_rate, total_steps, warmup_steps=0, decay="cosine",
                 end_learning_rate=0.0, steps_per_update=1):
        if decay not in ("cosine", "linear"):
            raise ValueError(f"Unknown decay {decay!r}; expected 'cosine' or 'linear'.")
        if total_steps <= warmup_steps:
            raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps "
                             f"({warmup_steps}); shorten the warm-up or train longer.")
        self.base_learning_rate = float(base_learning_rate)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.decay = decay
        self.end_learning_rate = float(end_learning_rate)
        self.steps_per_update = int(steps_per_update)

    def __call__(self, step):
        step = ops.floor(ops.cast(step, "float32") / self.steps_per_update)
        progress = ops.clip((step - self.warmup_steps) / (self.total_steps - self.warmup_steps),
                            0.0, 1.0)
        if self.decay == "cosine":
            lr = self.base_learning_rate * 0.5 * (1.0 + ops.cos(math.pi * progress))
        else:
            lr = self.end_learning_rate + (
                self.base_learning_rate - self.end_learning_rate) * (1.0 - progress)
        if self.warmup_steps:
            lr = lr * ops.minimum(1.0, step / self.warmup_steps)
        return lr

    def get_config(self):
        return {"base_learning_rate": self.base_learning_rate, "total_steps": self.total_steps,
                "warmup_steps": self.warmup_steps, "decay": self.decay,
                "end_learning_rate": self.end_learning_rate,
                "steps_per_update": self.steps_per_update}
