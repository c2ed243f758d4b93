"""One implementation, one process: measures the fp32 GEMM peak and the images/s of each model.

Run by `benchmarks/throughput.py`, once per implementation and round; it is not meant to be run by
hand. The Keras backend comes from `KERAS_BACKEND`, set by the parent before this process starts.
Prints one JSON object on its last line of stdout.
"""

import argparse
import json
import os
import resource
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# torch (timm, Keras' torch backend) pulls in triton when installed; importing triton after
# TensorFlow (keras-hub always imports it) segfaults the process. Nothing here needs triton.
sys.modules.setdefault("triton", None)

if os.environ.get("KERAS_BACKEND") == "jax" and "vit_keras" in sys.argv:
    # As the apps start on JAX: glibc keeps freed memory, set before NumPy starts any thread.
    # The settings are this checkout's, for every measured commit alike; the module is loaded by
    # its path, as apps/_backend.py does, but without putting this checkout on sys.path, where
    # it would shadow the measured commit's vit_keras (PYTHONPATH, see throughput.py --commits).
    import importlib.util  # noqa: E402

    _spec = importlib.util.spec_from_file_location(
        "_vit_keras_host_memory", os.path.join(REPO, "vit_keras", "host_memory.py"))
    _host_memory = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_host_memory)
    _host_memory.keep_freed_host_memory()

import numpy as np  # noqa: E402

GEMM_SIZE = 2048


def time_calls(step, warmup, steps):
    """Seconds of the first call (compile included), of each timed call, and the process's minor
    page faults per timed call."""
    started = time.perf_counter()
    step()
    first = time.perf_counter() - started
    for _ in range(max(warmup - 1, 0)):
        step()
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return first, times, faults / steps


def gemm_peak(library, size=GEMM_SIZE, repeats=5):
    """Best fp32 FLOP/s of a `size`³ matrix multiply through `library` (jax, tensorflow, torch)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((size, size), dtype=np.float32) for _ in range(2))
    if library == "jax":
        import jax  # pylint: disable=import-outside-toplevel
        a, b = jax.device_put(a), jax.device_put(b)
        matmul = jax.jit(lambda x, y: x @ y)
        call = lambda: matmul(a, b).block_until_ready()  # noqa: E731
    elif library == "tensorflow":
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        a, b = tf.constant(a), tf.constant(b)
        call = lambda: tf.matmul(a, b)  # noqa: E731  (eager CPU ops return when done)
    else:
        import torch  # pylint: disable=import-outside-toplevel
        a, b = torch.from_numpy(a), torch.from_numpy(b)
        call = lambda: torch.mm(a, b)  # noqa: E731
    _, times, _ = time_calls(call, warmup=2, steps=repeats)
    return 2 * size ** 3 / min(times)


def _data(batch_size, image_size):
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (batch_size, image_size, image_size, 3)).astype("float32")
    labels = rng.integers(0, 1000, (batch_size,)).astype("int32")
    return images, labels


def keras_steps(implementation, config, args):
    """The inference and training steps of a vit_keras or keras-hub model, and how to compile each."""
    import keras  # pylint: disable=import-outside-toplevel

    keras.utils.clear_session()  # before the policy: clearing the session resets it to float32
    keras.config.set_dtype_policy(args.dtype)
    keras.utils.set_random_seed(0)
    devices = 1
    # Each step's batch split over the process's XLA devices (JAX only). Keras' API, not
    # vit_keras.tools.distributed.distribution: a keras-hub process imports nothing of vit_keras.
    if args.data_parallel:
        local_devices = keras.distribution.list_devices()
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=local_devices))
        devices = len(local_devices)
    source = None
    if implementation == "vit_keras":
        import vit_keras  # pylint: disable=import-outside-toplevel
        from vit_keras import build_model  # pylint: disable=import-outside-toplevel
        source = os.path.dirname(os.path.dirname(os.path.abspath(vit_keras.__file__)))
        # Only arguments every measured commit's build_model takes (see throughput.py --commits).
        if args.dynamic_built_size is None:
            model = build_model(config, num_classes=1000, image_size=args.image_size)
        else:
            model = build_model(config, num_classes=1000, dynamic_image_size=True,
                                image_size=args.dynamic_built_size)
    else:
        import keras_hub  # pylint: disable=import-outside-toplevel
        backbone = keras_hub.models.ViTBackbone(
            image_shape=(args.image_size, args.image_size, 3), patch_size=config["patch_size"],
            num_layers=config["num_layers"], num_heads=config["num_heads"],
            hidden_dim=config["hidden_size"], mlp_dim=config["mlp_dim"])
        images = keras.Input((args.image_size, args.image_size, 3))
        features = backbone(images)[:, 0]
        model = keras.Model(images, keras.layers.Dense(1000, dtype="float32")(features))
    images, labels = _data(args.batch_size, args.image_size)
    jit = keras.backend.backend() != "torch" or args.torch_jit
    steps = {"inference": lambda: model.predict_on_batch(images),
             "train": lambda: model.train_on_batch(images, labels)}

    def prepare(mode):
        if mode == "inference":
            model.compile(jit_compile=jit)
        else:
            model.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=jit,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    return steps, prepare, {"jit_compile": jit, "dtype": model.dtype_policy.name,
                            "devices": devices, "dynamic_built_size": args.dynamic_built_size,
                            "source": source}


def timm_steps(config, args, compiled):
    from timm.models.vision_transformer import VisionTransformer  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel

    switches = sorted(set(config) - {"name", "patch_size", "hidden_size", "mlp_dim", "num_heads",
                                     "num_layers"})
    if switches:
        raise SystemExit(f"The timm baseline builds the paper's ViT; {config['name']} sets "
                         f"{switches} (measure it against vit_keras commits, --commits).")
    torch.manual_seed(0)
    dynamic = args.dynamic_built_size is not None
    model = VisionTransformer(
        img_size=args.dynamic_built_size if dynamic else args.image_size,
        patch_size=config["patch_size"], embed_dim=config["hidden_size"],
        depth=config["num_layers"], num_heads=config["num_heads"],
        mlp_ratio=config["mlp_dim"] / config["hidden_size"], num_classes=1000,
        dynamic_img_size=dynamic)
    images, labels = _data(args.batch_size, args.image_size)
    images = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    labels = torch.from_numpy(labels).long()
    network = torch.compile(model) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    autocast = args.dtype == "mixed_bfloat16"

    def inference():
        with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            return network(images)

    def train():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = loss_fn(network(images), labels)
        loss.backward()
        optimizer.step()
        return loss.item()

    def prepare(mode):
        model.train(mode == "train")

    steps = {"inference": inference, "train": train}
    return steps, prepare, {"compiled": compiled, "dtype": args.dtype,
                            "dynamic_built_size": args.dynamic_built_size}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--implementation", required=True,
                        choices=["vit_keras", "keras_hub", "timm", "timm_compile"])
    parser.add_argument("--configs", required=True, help="JSON list of ViTConfig field dicts")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["inference", "train"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--torch_jit", action="store_true")
    parser.add_argument("--data_parallel", action="store_true")
    parser.add_argument("--dynamic_built_size", type=int, default=None,
                        help="build the model of dynamic image size at this size")
    args = parser.parse_args()

    if args.implementation.startswith("timm"):
        library = "torch"
    else:
        import keras  # pylint: disable=import-outside-toplevel
        library = keras.backend.backend()
    result = {"implementation": args.implementation, "library": library,
              "peak_flops": gemm_peak(library), "runs": []}
    print(f"  {library} fp32 GEMM peak: {result['peak_flops'] / 1e9:.1f} GFLOP/s", file=sys.stderr,
          flush=True)
    for config in json.loads(args.configs):
        if args.implementation.startswith("timm"):
            steps, prepare, info = timm_steps(config, args, args.implementation == "timm_compile")
        else:
            steps, prepare, info = keras_steps(args.implementation, config, args)
        for mode in args.modes:
            prepare(mode)
            first, times, faults = time_calls(steps[mode], args.warmup, args.steps)
            result["runs"].append({
                "model": config["name"], "mode": mode, "batch_size": args.batch_size,
                "first_call_s": first, "step_s": times,
                "images_per_s": args.batch_size * len(times) / sum(times),
                # A step that maps its scratch memory afresh each time (see vit_keras.model.xla_cpu)
                # shows here whatever the machine's load, unlike its time.
                "page_faults_per_step": faults, **info})
            print(f"  {args.implementation}/{library} {config['name']} {mode}: "
                  f"{result['runs'][-1]['images_per_s']:.2f} images/s", file=sys.stderr,
                  flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
