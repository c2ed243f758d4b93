"""The `cudnn` attention kernel on a GPU, at every token count ViT uses: does cuDNN run it fused in
both directions, how fast, and does it compute what XLA's unfused attention computes?

    KERAS_BACKEND=jax python benchmarks/gpu_attention.py [--batch 64] [--json out.json]

For each token count (ViT-B/16 at 224, 256, 384 and 512 px; ViT-B/32 at 224 and 256 px; with a
distillation token; with 4 registers) and each padding multiple, one jitted forward and backward
of `vit_keras.model.attention.PaddedAttention("cudnn")` (bfloat16, heads of 64) against XLA's attention
at the unpadded count: milliseconds per call, the cuDNN fused-attention calls in the compiled
step (two when forward and backward are both fused), and the largest difference of the output
and the q, k, v gradients relative to the largest value. Also prints which kernel
`choose_attention` picks on this device. Runs on CPU too (XLA only: nothing to compare).
"""

import argparse
import json
import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from vit_keras.model import attention  # noqa: E402

TOKENS = (197, 257, 577, 1025, 50, 65, 198, 201)


def _step(function):
    def loss(q, k, v, cotangent):
        return jnp.sum(function(q, k, v).astype(jnp.float32) * cotangent)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _timed(step, arguments, repeats):
    result = step(*arguments)
    jax.block_until_ready(result)
    start = time.perf_counter()
    for _ in range(repeats):
        result = step(*arguments)
    jax.block_until_ready(result)
    return (time.perf_counter() - start) / repeats * 1e3, result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--multiples", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    on_gpu = jax.devices()[0].platform == "gpu"
    chosen = attention.choose_attention("bfloat16", 64).name
    print(f"device {jax.devices()[0].device_kind}; choose_attention(bfloat16, heads of 64) = "
          f"{chosen}; jax {jax.__version__}", flush=True)
    rows = []
    for tokens in args.tokens:
        rng = np.random.default_rng(tokens)
        shape = (args.batch, tokens, args.heads, 64)
        q, k, v, cotangent = (jnp.asarray(rng.normal(0, 1, shape), jnp.bfloat16)
                              for _ in range(4))
        xla_step = _step(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                      implementation="xla"))
        xla_ms, (_, reference) = _timed(xla_step, (q, k, v, cotangent), args.repeats)
        reference_out = np.asarray(jax.nn.dot_product_attention(q, k, v, implementation="xla"),
                                   np.float32)
        row = {"tokens": tokens, "xla_ms": round(xla_ms, 3), "padded": {}}
        for multiple in (args.multiples if on_gpu else []):
            attention.PAD_MULTIPLE = multiple
            kernel = attention.PaddedAttention("cudnn")
            padded = -(-tokens // multiple) * multiple

            def padded_attention(q, k, v, kernel=kernel, padded=padded, tokens=tokens):
                q, k, v = (jnp.pad(t, ((0, 0), (0, padded - tokens), (0, 0), (0, 0)))
                           for t in (q, k, v))
                return kernel.attend(q, k, v, valid_tokens=tokens)[:, :tokens]
            step = _step(padded_attention)
            try:
                ms, (_, gradients) = _timed(step, (q, k, v, cotangent), args.repeats)
                fused = step.lower(q, k, v, cotangent).compile().as_text().count("__cudnn$fmha")
                out = np.asarray(padded_attention(q, k, v), np.float32)
                differences = [float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(
                    (out, *(np.asarray(g, np.float32) for g in gradients)),
                    (reference_out, *(np.asarray(g, np.float32) for g in reference)))]
                row["padded"][multiple] = {"ms": round(ms, 3), "fused_calls": fused,
                                           "speedup": round(xla_ms / ms, 2),
                                           "max_relative_difference": max(differences)}
            except Exception as error:  # noqa: BLE001  (a refusal is a result here)
                row["padded"][multiple] = {"error": f"{type(error).__name__}: {error}"[:200]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "chosen": chosen, "batch": args.batch, "heads": args.heads,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
