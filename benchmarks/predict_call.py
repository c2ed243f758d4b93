"""What one `predict_on_batch` call costs beyond its forward pass, on JAX (issue 59).

Per call, median milliseconds of: Keras' own `predict_on_batch` (`keras.Model.predict_on_batch`,
which passes every variable through its step and assigns each back), `ViT.predict_on_batch`
(`vit_keras.model.jax_predict`), and the floor both are held to: one jitted `stateless_call`
whose logits are copied to NumPy. The three alternate call by call, so that the machine's drift
reaches each alike. A small image keeps the forward pass short, so that what is measured is the
calls' overhead, which depends on the number of variables, not on the image size.

    KERAS_BACKEND=jax python benchmarks/predict_call.py --model ViT-B/16 --image_size 32 \\
        --batch_size 1 --calls 300 [--json FILE]
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")


def measure(model_name, image_size, batch_size, calls, dtype_policy):
    """`{way: median ms per call}` and the model's variable count."""
    import jax
    import keras
    import numpy as np

    import vit_keras

    if keras.backend.backend() != "jax":
        sys.exit("predict_call.py measures the JAX backend: run it with KERAS_BACKEND=jax")
    keras.config.set_dtype_policy(dtype_policy)
    model = vit_keras.build_model(model_name, image_size=image_size, num_classes=1000)
    model.compile(jit_compile=True)
    x = jax.device_put(np.random.default_rng(0).uniform(
        0, 255, (batch_size, image_size, image_size, 3)).astype("float32"))
    forward = jax.jit(lambda t, n, x: model.stateless_call(t, n, x, training=False)[0])

    def stateless():
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        return np.asarray(forward(trainable, non_trainable, x))

    ways = {"keras predict_on_batch": lambda: keras.Model.predict_on_batch(model, x),
            "vit_keras predict_on_batch": lambda: model.predict_on_batch(x),
            "jitted stateless_call": stateless}
    for call in ways.values():  # compile and warm up
        for _ in range(5):
            call()
    times = {name: [] for name in ways}
    for _ in range(calls):
        for name, call in ways.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}, len(model.weights)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ViT-B/16")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--dtype_policy", default="float32", help="e.g. mixed_bfloat16")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    milliseconds, variables = measure(args.model, args.image_size, args.batch_size, args.calls,
                                      args.dtype_policy)
    floor = milliseconds["jitted stateless_call"]
    print(f"{args.model} ({args.dtype_policy}), {variables} variables, batch {args.batch_size} "
          f"of {args.image_size} px, "
          f"median of {args.calls} calls each, alternating:")
    for name, ms in milliseconds.items():
        print(f"  {name:28s} {ms:7.3f} ms  ({ms - floor:+.3f} ms over the jitted call)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "variables": variables, "ms_per_call": milliseconds,
                       "date": time.strftime("%Y-%m-%d")}, f, indent=1)


if __name__ == "__main__":
    main()
