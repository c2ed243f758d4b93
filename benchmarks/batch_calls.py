"""What one `predict_on_batch` or `train_on_batch` call costs beyond its compiled step, on JAX
(issue 59).

Per call, median milliseconds of three ways, alternating call by call so that the machine's drift
reaches each alike:

- `--call predict`: Keras' own `predict_on_batch` (`keras.Model.predict_on_batch`, which passes
  every variable through its step and assigns each back), `ViT.predict_on_batch`
  (`vit_keras.model.jax_predict`), and the floor both are held to: one jitted `stateless_call`
  whose logits are copied to NumPy.
- `--call train` (AdamW, sparse cross-entropy, accuracy): Keras' own `train_on_batch`,
  `ViT.train_on_batch` (`vit_keras.model.jax_train`), and the floor: Keras' compiled training
  step on a state held between calls, as `fit` holds it, whose loss is read back.

A small image keeps the step short, so that what is measured is the calls' overhead, which
depends on the number of variables, not on the image size.

    KERAS_BACKEND=jax python benchmarks/batch_calls.py --call predict --model ViT-B/16 \\
        --image_size 32 --batch_size 1 --calls 300 [--json FILE]
    KERAS_BACKEND=jax python benchmarks/batch_calls.py --call train --model ViT-Ti/16 \\
        --image_size 16 --batch_size 1 --calls 300
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")


def predict_ways(model, x):
    """`{way: call}` of `--call predict`."""
    import jax
    import keras
    import numpy as np

    model.compile(jit_compile=True)
    forward = jax.jit(lambda t, n, x: model.stateless_call(t, n, x, training=False)[0])

    def stateless():
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        return np.asarray(forward(trainable, non_trainable, x))

    return {"keras predict_on_batch": lambda: keras.Model.predict_on_batch(model, x),
            "vit_keras predict_on_batch": lambda: model.predict_on_batch(x),
            "jitted stateless_call": stateless}


def train_ways(model, x):
    """`{way: call}` of `--call train`."""
    import jax
    import keras
    import numpy as np

    from vit_keras.model import jax_train

    model.compile(optimizer=keras.optimizers.AdamW(1e-4), metrics=["accuracy"], jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    y = jax.device_put(np.zeros((x.shape[0],), "int32"))
    model.train_on_batch(x, y)  # builds the optimizer and Keras' compiled step
    # The floor's own copy of the state: the step donates what it is given.
    held = [tuple(jax.numpy.copy(v.value) for v in group)
            for group in jax_train.state_variables(model)]

    def held_step():
        logs, held[:] = model.train_function(tuple(held), iter([(x, y, None)]))
        return float(logs["loss"])

    return {"keras train_on_batch": lambda: keras.Model.train_on_batch(model, x, y),
            "vit_keras train_on_batch": lambda: model.train_on_batch(x, y),
            "compiled step on a held state": held_step}


def measure(call, model_name, image_size, batch_size, calls, dtype_policy):
    """`{way: median ms per call}` and the model's variable count."""
    import jax
    import keras
    import numpy as np

    import vit_keras

    if keras.backend.backend() != "jax":
        sys.exit("batch_calls.py measures the JAX backend: run it with KERAS_BACKEND=jax")
    keras.config.set_dtype_policy(dtype_policy)
    model = vit_keras.build_model(model_name, image_size=image_size, num_classes=1000)
    x = jax.device_put(np.random.default_rng(0).uniform(
        0, 255, (batch_size, image_size, image_size, 3)).astype("float32"))
    ways = (predict_ways if call == "predict" else train_ways)(model, x)
    for way in ways.values():  # compile and warm up
        for _ in range(5):
            way()
    times = {name: [] for name in ways}
    for _ in range(calls):
        for name, way in ways.items():
            started = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - started)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}, len(model.weights)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--call", choices=("predict", "train"), default="predict")
    parser.add_argument("--model", default="ViT-B/16")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--dtype_policy", default="float32", help="e.g. mixed_bfloat16")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    milliseconds, variables = measure(args.call, args.model, args.image_size, args.batch_size,
                                      args.calls, args.dtype_policy)
    floor = list(milliseconds.values())[-1]
    print(f"{args.model} ({args.dtype_policy}), {variables} variables, batch {args.batch_size} "
          f"of {args.image_size} px, "
          f"median of {args.calls} calls each, alternating:")
    for name, ms in milliseconds.items():
        print(f"  {name:30s} {ms:7.3f} ms  ({ms - floor:+.3f} ms over the floor)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "variables": variables, "ms_per_call": milliseconds,
                       "date": time.strftime("%Y-%m-%d")}, f, indent=1)


if __name__ == "__main__":
    main()
