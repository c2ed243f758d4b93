"""GFLOP/s of each matrix product of a ViT block's training step, on all cores and on one.

    python benchmarks/products.py                         # ViT-Ti/16, batch 8: JAX and torch
    python benchmarks/products.py --models ViT-S/16 --libraries jax torch tensorflow

Why the JAX training step of a narrow ViT trails timm's: the attention products are batched
matrix products (one per image and head), and a library that multiplies them on one core leaves
the other idle for that part of the step. Each (library, cores) pair runs in its own process, its
CPU affinity set before the library is imported, so "1 core" is the library's speed on one core.
A product that runs as fast on all cores as on one is not parallelised. Equations are in einsum
notation (t: batch x tokens, b: batch x heads); the backward pass reuses these layouts
(dP = dO·Vᵀ is q·kᵀ's, dQ = dS·K is p·v's, dK = dSᵀ·Q is dV's). Each figure is 2·(the product
of the index sizes) over the median of `--repeats` calls; the table gives the median over
`--rounds` rounds, in which the processes alternate so that drift in the machine's load hits all
alike. Not part of the test suite's pass/fail.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

from throughput import MODELS, parse_model
from throughput_worker import time_calls

LIBRARIES = ("jax", "torch", "tensorflow")


def products(config, batch_size, image_size):
    """(name, einsum equation, {index: size}) of each product of one block, forward and backward."""
    d, heads = config["hidden_size"], config["num_heads"]
    tokens = (image_size // config["patch_size"]) ** 2 + 1
    rows, per_head = {"t": batch_size * tokens}, {"b": batch_size * heads, "q": tokens, "k": tokens}
    return [
        ("q, k, v projection", "td,dn->tn", {**rows, "d": d, "n": 3 * d}),
        ("q·kᵀ (and dP = dO·Vᵀ)", "bqd,bkd->bqk", {**per_head, "d": d // heads}),
        ("p·v (and dQ = dS·K)", "bqk,bkd->bqd", {**per_head, "d": d // heads}),
        ("dV = Pᵀ·dO (and dK)", "bqk,bqd->bkd", {**per_head, "d": d // heads}),
        ("output projection", "td,dn->tn", {**rows, "d": d, "n": d}),
        ("MLP in", "td,dn->tn", {**rows, "d": d, "n": config["mlp_dim"]}),
        ("MLP out", "tn,nd->td", {**rows, "d": d, "n": config["mlp_dim"]}),
        ("MLP-in weight gradient", "td,tn->dn", {**rows, "d": d, "n": config["mlp_dim"]}),
    ]


def flops(sizes):
    return 2 * math.prod(sizes.values())


def measure(library, product_list, repeats):
    """FLOP/s of each product through `library` (median of `repeats` calls after 3 warm-ups)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(0)
    if library == "jax":
        import jax  # pylint: disable=import-outside-toplevel
        import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

        def compile_product(equation):
            product = jax.jit(lambda a, b: jnp.einsum(equation, a, b))
            return lambda a, b: product(a, b).block_until_ready()
        to_tensor = jax.device_put
    elif library == "torch":
        import torch  # pylint: disable=import-outside-toplevel

        def compile_product(equation):
            return lambda a, b: torch.einsum(equation, a, b)
        to_tensor = torch.from_numpy
    else:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        def compile_product(equation):
            product = tf.function(lambda a, b: tf.einsum(equation, a, b), jit_compile=True)
            return lambda a, b: product(a, b).numpy()  # waits for the result
        to_tensor = tf.constant
    results = []
    for _, equation, sizes in product_list:
        operands = [to_tensor(rng.standard_normal([sizes[i] for i in spec], dtype=np.float32))
                    for spec in equation.split("->")[0].split(",")]
        call = compile_product(equation)
        _, times, _ = time_calls(lambda: call(*operands), warmup=3, steps=repeats)
        results.append(flops(sizes) / statistics.median(times))
    return results


def run_worker(library, cores, product_list, repeats):
    """Measures in a fresh process pinned to the first `cores` CPUs; None if it failed."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", library,
               "--products", json.dumps(product_list), "--repeats", str(repeats)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run(command, env=env, capture_output=True, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, range(cores)))
    if result.returncode:
        print(f"{library} on {cores} core(s) failed: {result.stderr.strip()[-500:]}",
              file=sys.stderr)
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["ViT-Ti/16"],
                        help=f"names from {list(MODELS)} or JSON dicts of ViTConfig fields")
    parser.add_argument("--libraries", nargs="+", default=["jax", "torch"], choices=LIBRARIES)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per product")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="where to write the measurements")
    parser.add_argument("--worker", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--products", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, json.loads(args.products), args.repeats)))
        return

    if not hasattr(os, "sched_setaffinity"):
        parser.error("pinning a process to one core needs os.sched_setaffinity (Linux)")
    all_cores = len(os.sched_getaffinity(0))
    columns = [(library, cores) for library in args.libraries for cores in (all_cores, 1)]
    report = {"cpus": all_cores, "batch_size": args.batch_size, "models": {}}
    for text in args.models:
        config = parse_model(text)
        product_list = products(config, args.batch_size, args.image_size)
        rounds = [{f"{library} x{cores}": run_worker(library, cores, product_list, args.repeats)
                   for library, cores in columns} for _ in range(args.rounds)]
        measured = {column: None if any(r[column] is None for r in rounds) else
                    [statistics.median(rates) for rates in zip(*(r[column] for r in rounds))]
                    for column in rounds[0]}
        report["models"][config["name"]] = {"products": product_list, "rounds": rounds,
                                            "flops_per_s": measured}
        print(f"\n{config['name']}, batch {args.batch_size}, float32: GFLOP/s on {all_cores} "
              f"cores / 1 core (median of {args.rounds} rounds)\n")
        print("| product | einsum | sizes | " + " | ".join(args.libraries) + " |")
        print("|---|---|---|" + "---:|" * len(args.libraries))
        for index, (name, equation, sizes) in enumerate(product_list):
            cells = []
            for library in args.libraries:
                pair = [measured[f"{library} x{cores}"] for cores in (all_cores, 1)]
                cells.append(" / ".join("failed" if rates is None else f"{rates[index] / 1e9:.0f}"
                                        for rates in pair))
            shape = "×".join(str(size) for size in sizes.values())
            print(f"| {name} | `{equation}` | {shape} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if any(rates is None for model in report["models"].values()
           for rates in model["flops_per_s"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
