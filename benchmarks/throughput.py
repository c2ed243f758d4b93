"""Images/s of vit_keras against timm and keras-hub, measured side by side in one run.

    python benchmarks/throughput.py                # everything: about an hour on 2 quiet cores
    python benchmarks/throughput.py --models ViT-Ti/16 --implementations vit_keras-jax timm
    python benchmarks/throughput.py --modes train --rounds 3 --batch_size 8 --json out.json
    python benchmarks/throughput.py --models ViT-Ti/16 --modes train \
        --implementations timm vit_keras-jax vit_keras-jax-dp2   # also over 2 XLA CPU devices
    python benchmarks/throughput.py --models ViT-S/16 --modes inference --image_size 320 \
        --dynamic_built_size 224 --implementations timm timm-dynamic vit_keras-jax \
        vit_keras-jax-dynamic   # models of dynamic image size, built at 224, fed 320 px
    python benchmarks/throughput.py --models ViT-Ti/16 --modes train --rounds 3 \
        --implementations timm vit_keras-tensorflow vit_keras-jax \
        --commits main .       # a change measured before (main) and after (the checkout)
    python benchmarks/throughput.py --implementations vit_keras-jax --commits main . --models \
        '{"name": "DINOv3-Ti/16", "patch_size": 16, "hidden_size": 192, "mlp_dim": 768,
          "num_heads": 3, "num_layers": 12, "rope": "dinov3"}'   # a family's switches (vit_keras)

Each implementation (vit_keras and keras-hub's ViTBackbone on each Keras backend, timm eager and
with torch.compile) runs in its own process, and the processes alternate A B C A B C ... over
`--rounds` rounds so that drift in the machine's load hits all alike. Every process first measures
the fp32 matrix-multiply peak (a 2048³ matmul) through its own library, then times inference and a
training step (forward, loss, backward, SGD update) of each model on random images. Keras models
run `predict_on_batch` / `train_on_batch` with `jit_compile=True` on JAX and TensorFlow; on torch
they run eagerly (`vit_keras-torch`) or through torch.compile (`vit_keras-torch-jit`, Keras'
`jit_compile=True`: a minute or more of compiling per model and mode on 2 cores).

Reported per row: the median images/s over rounds, min-max, the ratio to timm eager, and the
achieved FLOP/s as a fraction of the peak measured in the same process, with the forward pass's
analytic FLOPs (see `forward_flops`) and x3 for a training step. The fraction is given twice: for
the mean rate of the timed steps, and for the fastest step, which is the same statistic as the
peak's (the fastest of 5 calls); each is the median over rounds. The 2048³ GEMM is a reference,
not a ceiling: a compiled model can exceed 100% of it. `--from_json` prints the table of an
earlier run's JSON again.

`--commits A B ...` measures the vit_keras implementations once per commit in the same run: each
commit is checked out into a temporary `git worktree` (`.` is the checkout itself, uncommitted
changes included) and its worker process imports vit_keras from there, so a change to the model is
measured before and after with the same worker, peers and machine state. Rows are then named
`vit_keras-jax@A`; timm and keras-hub run once per round. Peers are optional
(`pip install .[bench]`): a missing one is reported, not fatal. Writes a markdown table to stdout
and all measurements to `--json`. Not part of the test suite's pass/fail.
"""

import argparse
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("jax", "tensorflow", "torch")
# name -> (worker implementation, Keras backend or None, package it needs)
IMPLEMENTATIONS = {
    **{f"vit_keras-{b}": ("vit_keras", b, "keras") for b in BACKENDS},
    "vit_keras-torch-jit": ("vit_keras", "torch", "keras"),
    "timm": ("timm", None, "timm"),
    "timm-compile": ("timm_compile", None, "timm"),
    **{f"keras_hub-{b}": ("keras_hub", b, "keras_hub") for b in BACKENDS},
}
# A JAX implementation's name with "-dpN" (vit_keras-jax-dp2) splits the CPU into N XLA devices
# and runs each step data-parallel over them (Keras' DataParallel).
DATA_PARALLEL_SUFFIX = re.compile(r"-dp(\d+)$")
# "-dynamic" (vit_keras-jax-dynamic, timm-dynamic): the model of dynamic image size, built at
# --dynamic_built_size and fed --image_size (vit_keras' dynamic_image_size, timm's dynamic_img_size).
DYNAMIC_SUFFIX = "-dynamic"
# "@commit" (vit_keras-jax@b5fa52b): that commit's vit_keras, from a worktree (see --commits).
COMMIT_SEPARATOR = "@"
BASELINE = "timm"
# The ViT sizes of the paper (Ti and S from "How to train your ViT"), as vit_keras' variant table.
MODELS = {
    "ViT-Ti/16": dict(patch_size=16, hidden_size=192, mlp_dim=768, num_heads=3, num_layers=12),
    "ViT-S/16": dict(patch_size=16, hidden_size=384, mlp_dim=1536, num_heads=6, num_layers=12),
    "ViT-B/16": dict(patch_size=16, hidden_size=768, mlp_dim=3072, num_heads=12, num_layers=12),
}


def forward_flops(config, image_size, num_classes=1000, channels=3):
    """Multiply-add FLOPs (2 per MAC) of one image's forward pass; elementwise ops not counted.

    With N = (image_size / patch)², T = N + 1 tokens, D hidden, M mlp_dim, L layers:
        2·N·p²·C·D                       patch embedding
      + L·(2·T·4·D² + 2·2·T²·D + 2·2·T·D·M)   q, k, v, out projections; QKᵀ and AV; the MLP
      + 2·D·classes                      head
    """
    p, d, m = config["patch_size"], config["hidden_size"], config["mlp_dim"]
    n = (image_size // p) ** 2
    t = n + 1
    per_layer = 2 * t * 4 * d * d + 2 * 2 * t * t * d + 2 * 2 * t * d * m
    return 2 * n * p * p * channels * d + config["num_layers"] * per_layer + 2 * d * num_classes


def parse_model(text):
    """A variant name from MODELS, or a JSON dict of ViTConfig fields with a "name": the sizes,
    and for vit_keras alone any switch (`{"name": "rope-Ti/16", ..., "rope": "dinov3"}`)."""
    if text in MODELS:
        return {"name": text, **MODELS[text]}
    config = json.loads(text)
    return {"name": config.get("name", "custom"), **{k: config[k] for k in MODELS["ViT-Ti/16"]},
            **{k: v for k, v in config.items() if k not in MODELS["ViT-Ti/16"] and k != "name"}}


def split_commit(implementation):
    """("vit_keras-jax", "b5fa52b") for "vit_keras-jax@b5fa52b"; (implementation, None) without."""
    name, _, commit = implementation.partition(COMMIT_SEPARATOR)
    return name, commit or None


def split_devices(implementation):
    """("vit_keras-jax", 2) for "vit_keras-jax-dp2"; (implementation, 1) without the suffix; a
    "-dynamic" or "@commit" suffix is dropped too (see `DYNAMIC_SUFFIX`, `split_commit`)."""
    implementation = split_commit(implementation)[0].removesuffix(DYNAMIC_SUFFIX)
    match = DATA_PARALLEL_SUFFIX.search(implementation)
    if not match:
        return implementation, 1
    return implementation[:match.start()], int(match.group(1))


def missing_package(implementation):
    package = IMPLEMENTATIONS[split_devices(implementation)[0]][2]
    return None if importlib.util.find_spec(package) else package


def checkout(commit, parent):
    """A directory holding `commit`'s tree: the checkout itself for ".", else a new detached
    `git worktree` under `parent` (removed by `remove_checkouts`)."""
    if commit == ".":
        return REPO
    path = os.path.join(parent, re.sub(r"[^A-Za-z0-9._-]", "_", commit))
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "--force", path, commit],
                   check=True, capture_output=True, text=True)
    return path


def remove_checkouts(paths):
    for path in paths.values():
        if path != REPO:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", path],
                           capture_output=True, check=False)


def run_worker(implementation, configs, args, checkouts=None):
    base, devices = split_devices(implementation)
    worker, backend, _ = IMPLEMENTATIONS[base]
    commit = split_commit(implementation)[1]
    source = checkouts[commit] if commit else REPO
    command = [sys.executable, os.path.join(REPO, "benchmarks", "throughput_worker.py"),
               "--implementation", worker, "--configs", json.dumps(configs),
               "--batch_size", str(args.batch_size), "--image_size", str(args.image_size),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--dtype", args.dtype,
               "--modes", *args.modes] + (["--torch_jit"] if base == "vit_keras-torch-jit" else [])
    if implementation.endswith(DYNAMIC_SUFFIX):
        command += ["--dynamic_built_size", str(args.dynamic_built_size or args.image_size)]
    # The worker is always this checkout's; the vit_keras it imports is the commit's.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": source}
    if backend:
        env["KERAS_BACKEND"] = backend
    if devices > 1:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={devices}").strip()
        command.append("--data_parallel")
    load = os.getloadavg()[0]
    started = time.perf_counter()
    try:
        result = subprocess.run(command, env=env, cwd=source, capture_output=True, text=True,
                                timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    sys.stderr.write(result.stderr if args.verbose else "".join(
        line + "\n" for line in result.stderr.splitlines() if line.startswith("  ")))
    if result.returncode:
        return {"error": f"exit {result.returncode}: " + result.stderr.strip()[-1500:]}
    output = json.loads(result.stdout.strip().splitlines()[-1])
    measured = {run.get("source") for run in output.get("runs", ())} - {None}
    if measured and not all(os.path.samefile(path, source) for path in measured):
        # A wrong comparison is worse than none: the process imported another vit_keras.
        return {"error": f"imported vit_keras from {sorted(measured)}, not from {source}"}
    output.update(load_before=load, load_after=os.getloadavg()[0],
                  process_s=time.perf_counter() - started)
    return output


def summarize(rounds, configs, args):
    """One row per (model, mode, implementation) with medians over rounds."""
    flops = {c["name"]: forward_flops(c, args.image_size) for c in configs}
    rows = []
    for config in configs:
        for mode in args.modes:
            for implementation in args.implementations:
                rates, fractions, best_fractions, firsts, errors = [], [], [], [], []
                for outputs in rounds:
                    output = outputs.get(implementation)
                    if output is None:
                        continue
                    if "error" in output:
                        errors.append(output["error"])
                        continue
                    for run in output["runs"]:
                        if run["model"] == config["name"] and run["mode"] == mode:
                            rates.append(run["images_per_s"])
                            per_image = flops[config["name"]] * (3 if mode == "train" else 1)
                            peak = output["peak_flops"]
                            fractions.append(run["images_per_s"] * per_image / peak)
                            fastest = run["batch_size"] / min(run["step_s"])
                            best_fractions.append(fastest * per_image / peak)
                            firsts.append(run["first_call_s"])
                row = {"model": config["name"], "mode": mode, "implementation": implementation,
                       "batch_size": args.batch_size, "images_per_s": rates,
                       "fraction_of_peak": fractions, "best_step_fraction_of_peak": best_fractions,
                       "first_call_s": firsts, "errors": errors}
                if rates:
                    row.update(median=statistics.median(rates), min=min(rates), max=max(rates),
                               median_fraction_of_peak=statistics.median(fractions),
                               median_best_step_fraction_of_peak=statistics.median(best_fractions))
                rows.append(row)
    for row in rows:
        baseline = next((r for r in rows if r["model"] == row["model"] and r["mode"] == row["mode"]
                         and r["implementation"] == BASELINE and "median" in r), None)
        if baseline and "median" in row:
            row["ratio_to_timm"] = row["median"] / baseline["median"]
    return rows


def markdown(rows, peaks, missing, loads, args):
    lines = [f"Batch {args.batch_size}, {args.image_size}x{args.image_size}, {args.dtype}, "
             f"{args.rounds} round(s) x {args.steps} timed steps (after {args.warmup} warm-up); "
             f"{os.cpu_count()} CPUs, 1-min load average {min(loads, default=0):.1f}-"
             f"{max(loads, default=0):.1f} during the run.",
             "", "| model | mode | implementation | images/s (median) | min-max | x timm eager "
             "| % of GEMM peak: all steps / best step | first call (s) |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "median" not in row:
            reason = row["errors"][0].splitlines()[-1][:80] if row["errors"] else "not run"
            lines.append(f"| {row['model']} | {row['mode']} | {row['implementation']} | "
                         f"failed: {reason} | | | | |")
            continue
        ratio = f"{row['ratio_to_timm']:.2f}" if "ratio_to_timm" in row else "-"
        lines.append(
            f"| {row['model']} | {row['mode']} | {row['implementation']} | {row['median']:.2f} | "
            f"{row['min']:.2f}-{row['max']:.2f} | {ratio} | "
            f"{100 * row['median_fraction_of_peak']:.0f}% / "
            f"{100 * row['median_best_step_fraction_of_peak']:.0f}% | "
            f"{statistics.median(row['first_call_s']):.0f} |")
    lines.append("")
    lines.append("fp32 GEMM peak (2048³, best of 5, median over processes): " + ", ".join(
        f"{lib} {statistics.median(v) / 1e9:.0f} GFLOP/s" for lib, v in sorted(peaks.items())))
    for implementation, package in missing.items():
        lines.append(f"{implementation}: not measured, `{package}` is not installed "
                     f"(`pip install .[bench]`).")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS),
                        help=f"names from {list(MODELS)} or JSON dicts of ViTConfig fields")
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS),
                        help=f"any of {list(IMPLEMENTATIONS)}; 'vit_keras' and 'keras_hub' "
                             "expand to every backend; a JAX one with -dpN (vit_keras-jax-dp2) "
                             "runs data-parallel over N XLA CPU devices; -dynamic "
                             "(vit_keras-torch-dynamic, timm-dynamic) the model of dynamic image "
                             "size")
    parser.add_argument("--modes", nargs="+", default=["inference", "train"],
                        choices=["inference", "train"])
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--dynamic_built_size", type=int, default=None,
                        help="image size the '-dynamic' implementations are built for (they are "
                             "fed --image_size); default: --image_size")
    parser.add_argument("--commits", nargs="+", metavar="REV",
                        help="measure the vit_keras implementations at each of these git "
                             "revisions in the same run ('.' is the checkout, uncommitted "
                             "changes included); rows are named vit_keras-jax@REV")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compile included)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "mixed_bfloat16"],
                        help="Keras dtype policy; timm uses torch.autocast for mixed_bfloat16")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    parser.add_argument("--json", default="throughput.json", help="where to write all results")
    parser.add_argument("--verbose", action="store_true", help="show the workers' stderr")
    parser.add_argument("--from_json", metavar="PATH",
                        help="measure nothing: print the table of an earlier run's JSON again")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            earlier = json.load(f)
        vars(args).update(earlier["settings"])
        configs = [parse_model(text) for text in args.models]
        _, table, _, _ = report_table(earlier["rounds"], configs, earlier["missing"], args)
        print(table)
        return

    expanded = []
    for name in args.implementations:
        names = [f"{name}-{b}" for b in BACKENDS] if name in ("vit_keras", "keras_hub") else [name]
        for item in names:
            base, devices = split_devices(item)
            if base not in IMPLEMENTATIONS:
                parser.error(f"Unknown implementation {item!r}; expected {list(IMPLEMENTATIONS)}.")
            if item.endswith(DYNAMIC_SUFFIX) and base.startswith("keras_hub"):
                parser.error(f"{item!r}: keras-hub's ViT has no dynamic image size.")
            if devices > 1 and IMPLEMENTATIONS[base][1] != "jax":
                parser.error(f"{item!r}: -dpN needs a JAX implementation; {base} is not one.")
            if devices < 1 or args.batch_size % devices:
                parser.error(f"{item!r}: {devices} devices must be at least 1 and divide "
                             f"--batch_size {args.batch_size}.")
            if args.commits and base.startswith("vit_keras"):
                expanded.extend(f"{item}{COMMIT_SEPARATOR}{commit}" for commit in args.commits)
            else:
                expanded.append(item)
    args.implementations = expanded
    configs = [parse_model(text) for text in args.models]
    missing = {i: missing_package(i) for i in args.implementations if missing_package(i)}
    runnable = [i for i in args.implementations if i not in missing]

    with tempfile.TemporaryDirectory(prefix="vit_keras-commits-") as parent:
        checkouts = {commit: checkout(commit, parent) for commit in args.commits or ()}
        try:
            rounds = []
            for index in range(args.rounds):
                outputs = {}
                for implementation in runnable:
                    print(f"round {index + 1}/{args.rounds}: {implementation}", file=sys.stderr,
                          flush=True)
                    outputs[implementation] = run_worker(implementation, configs, args, checkouts)
                    if "error" in outputs[implementation]:
                        print(f"  failed: {outputs[implementation]['error'][-300:]}",
                              file=sys.stderr)
                rounds.append(outputs)
                write_report(rounds, configs, missing, args, final=index + 1 == args.rounds)
        finally:
            remove_checkouts(checkouts)


def report_table(rounds, configs, missing, args):
    """The rows, GEMM peaks, load averages and markdown table of the rounds measured so far."""
    rows = summarize(rounds, configs, args)
    peaks = {}
    for outputs in rounds:
        for output in outputs.values():
            if "peak_flops" in output:
                peaks.setdefault(output["library"], []).append(output["peak_flops"])
    loads = [o[key] for outputs in rounds for o in outputs.values()
             for key in ("load_before", "load_after") if key in o]
    return rows, markdown(rows, peaks, missing, loads, args), peaks, loads


def write_report(rounds, configs, missing, args, final):
    """Prints the table (when `final`) and writes everything measured so far to `--json`."""
    rows, table, peaks, loads = report_table(rounds, configs, missing, args)
    if final:
        print(table)
    report = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_1min": [min(loads), max(loads)] if loads else None},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "from_json")},
        "complete": final,
        "flops_formula": forward_flops.__doc__.strip(),
        "forward_gflops_per_image": {c["name"]: forward_flops(c, args.image_size) / 1e9
                                     for c in configs},
        "gemm_peak_flops": peaks, "missing": missing, "rows": rows, "rounds": rounds,
        "markdown": table,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)

if __name__ == "__main__":
    main()
