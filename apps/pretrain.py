r"""Self-supervised pre-training by masked patch prediction (the paper's section 4.6), any backend.

    python apps/pretrain.py --backend jax                 # digits, offline, a few minutes
    python apps/finetune.py --backend jax \
        --weights saved_models/pretrain_digits_ViT-digits/model.keras   # digits recipe, 16 px
    python apps/fewshot.py --backend jax --model saved_models/pretrain_digits_ViT-digits/model.keras
    python apps/pretrain.py --backend jax --dataset imagenet2012 --data_dir ~/tensorflow_datasets \
        --model ViT-B/16 --accum_steps 8 --mixed_precision bfloat16 --fewshot_shots ""

Of each image's patch embeddings 50% are corrupted (80% of those replaced by a learnable [mask]
embedding, 10% by another patch's embedding, 10% kept), and a linear head on each corrupted
patch's output token predicts its 3-bit mean colour (512 classes; `--target` selects the paper's
ablation targets instead). The corruption runs inside the compiled train step
(`vit_keras.masked_patch_prediction`); the labels of the dataset are never read.

Recipe `mpp` (the paper, appendix B.1.2): Adam (no weight decay), base lr 2e-4, 10k warm-up steps,
cosine decay, batch 4096, 1M steps, inception crop and horizontal flip, global-norm clipping 1,
no dropout, 224 px. On the digits data the default is `mpp_digits`, the same shape at digits
scale. Every value can be overridden by its flag, as in apps/finetune.py, whose dataset, model
and compute flags this app shares.

The run folder OUTPUT_DIR/RUN_NAME/ holds model.keras (a vit_keras ViT with the [mask] embedding
and the MPP head; apps/finetune.py --weights takes it, dropping both and zero-initialising a new
head), metrics.json (loss history and the few-shot accuracy of the frozen features,
`--fewshot_shots`), flags.txt, class_names.json, history.csv, logs/. The same command resumes an
interrupted run from its last completed epoch (or at the few-shot evaluation if training had
ended), leaves a finished run as it is (--overwrite starts it over), and stops at once if another
process is running in the folder.
"""

import time

_STARTED = time.perf_counter()
import _backend  # noqa: E402

_backend.start_app()  # before keras is imported

import dataclasses  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import _common  # noqa: E402
from vit_keras import masked_patch_prediction as mpp  # noqa: E402
from vit_keras.tools import config_flags, recipes, training  # noqa: E402

# The paper, appendix B.1.2: "Adam, with a base learning rate of 2e-4, warmup of 10k steps and
# cosine learning rate decay", batch 4096, 1M steps. It names no weight decay for MPP: none here.
MPP_RECIPE = recipes.Recipe(
    name="mpp", optimizer="adamw", learning_rate=2e-4, weight_decay=0.0, warmup_steps=10_000,
    decay="cosine", total_steps=1_000_000, batch_size=4096, image_size=224, grad_clip_norm=1.0,
    dropout=0.0, zero_head=False)
# The same shape at digits scale (16 px, 4x4 patches: 16 tokens per image).
MPP_DIGITS_RECIPE = dataclasses.replace(
    MPP_RECIPE, name="mpp_digits", learning_rate=1e-3, warmup_steps=100, total_steps=None,
    epochs=60, batch_size=64, image_size=16)
MPP_RECIPES = {"mpp": MPP_RECIPE, "mpp_digits": MPP_DIGITS_RECIPE}

_FLAG_MODULE = _backend.flag_module(0)  # absl's name for this app: its flags go to flags.txt
config_flags.define_flags(training.RunConfig, module_name=_FLAG_MODULE)
flags.FLAGS.__delattr__("recipe")  # RunConfig's lists the supervised recipes; these are MPP's
flags.DEFINE_enum("recipe", "auto", ["auto", *MPP_RECIPES],
                  "Base recipe: mpp (the paper's), mpp_digits (the default on the digits data); "
                  "the flags below override single values.", module_name=_FLAG_MODULE)
flags.DEFINE_enum("target", "mean_colour", list(mpp.TARGETS),
                  "What each corrupted patch predicts: mean_colour (3-bit mean colour, 512 "
                  "classes, the paper's), downsampled_colour (3-bit colours of a 4x4 grid, "
                  "16 x 512), pixels (L2 regression on the patch's normalised pixels).")
flags.DEFINE_float("corruption_rate", 0.5, "Fraction of each image's patches corrupted.")
flags.DEFINE_float("mask_fraction", 0.8, "Of the corrupted: replaced by the [mask] embedding.")
flags.DEFINE_float("random_fraction", 0.1, "Of the corrupted: replaced by another patch's "
                   "embedding (the rest is kept).")
flags.DEFINE_list("pretrain_splits", ["train"], "Splits whose images are pre-trained on "
                  "(labels unused), e.g. train,val,test for all digits images.")
flags.DEFINE_list("fewshot_shots", ["1", "5", "10", "25"], "Few-shot linear evaluation of the "
                  "frozen features after training (train split → test split); empty: none.")
flags.DEFINE_integer("fewshot_seeds", 3, "Draws of the few-shot training examples.")
FLAGS = flags.FLAGS


def resolve_recipe(config):
    """The base MPP recipe with every explicitly given field replaced, and why it was chosen."""
    name = config.recipe
    if name == "auto":
        name = "mpp_digits" if config.dataset == "digits" else "mpp"
    overrides = {field: getattr(config, field) for field in (
        "optimizer", "learning_rate", "momentum", "weight_decay", "grad_clip_norm",
        "warmup_steps", "decay", "total_steps", "epochs", "batch_size", "image_size",
        "label_smoothing", "dropout") if getattr(config, field) is not None}
    if config.total_steps is not None and config.epochs is None:
        overrides["epochs"] = None
    return dataclasses.replace(MPP_RECIPES[name], **overrides), f"recipe {name}"


def pretraining_pool(splits, names):
    """`splits` whose "train" source is the images of the splits `names` (labels unused)."""
    unknown = sorted(set(names) - set(splits.sources))
    if unknown:
        raise app.UsageError(f"--pretrain_splits {','.join(names)}: {splits.name} has no split "
                             f"{unknown}; it has {sorted(splits.sources)}.")
    sources = [splits.sources[name] for name in names]

    def merged():
        ds = sources[0]()
        for source in sources[1:]:
            ds = ds.concatenate(source())
        return ds

    return dataclasses.replace(
        splits, num_examples={**splits.num_examples,
                              "train": sum(splits.num_examples[n] for n in names)},
        sources={**splits.sources, "train": merged})


def read_history(path):
    """history.csv's rows without the `val_loss` column Keras' CSVLogger fills with NA when a
    fit has no validation data (MPP has none: outside training nothing is corrupted)."""
    import csv

    with open(path) as f:
        rows = {int(row["epoch"]): {"epoch": int(row["epoch"]), "loss": float(row["loss"])}
                for row in csv.DictReader(f) if row.get("epoch") not in (None, "", "epoch")}
    return [rows[epoch] for epoch in sorted(rows)]


def run(config, log=print):
    """One pre-training run; returns its metrics (also written to metrics.json).

    The run folder behaves as `training.run`'s: a finished run (its metrics.json) is left as it
    is unless `config.overwrite`, another process in the folder is refused, and an unfinished
    run resumes from its last completed epoch, or at the few-shot evaluation when training had
    ended."""
    from vit_keras.tools.run_folder import RunFolder

    run_name = config.run_name or training.default_run_name(config, "pretrain")
    folder = RunFolder(os.path.join(config.output_dir, run_name))
    with folder.locked():
        finished = training.finished_run(folder, config.overwrite, log=log)
        if finished is not None:
            return finished
        return _pretrain(config, folder, run_name, log)


def _pretrain(config, folder, run_name, log):
    import keras

    from vit_keras import fewshot
    from vit_keras.tools import callbacks as callbacks_lib
    from vit_keras.tools import data

    recipe, reason = resolve_recipe(config)
    folder.write_flags(config.flags_text)
    keras.utils.set_random_seed(config.seed)
    splits = data.load_splits(config.dataset, data_dir=config.data_dir,
                              val_fraction=config.val_fraction, download=config.download,
                              seed=config.seed, log=log)
    folder.write_class_names(splits.class_names)
    pool = pretraining_pool(splits, FLAGS.pretrain_splits)
    training.set_precision(config.mixed_precision)
    accum = max(1, int(config.accum_steps or 1))
    steps_per_epoch = config.steps_per_epoch or max(1, pool.num_examples["train"] //
                                                    recipe.batch_size)
    epochs = recipe.epochs or max(1, math.ceil(recipe.total_steps * accum / steps_per_epoch))
    # Kept after fit (deleted once metrics.json is written): a run killed during its few-shot
    # evaluation resumes there.
    backup = callbacks_lib.AtomicBackupAndRestore(folder.backup, seed=config.seed,
                                                  delete_checkpoint=False)
    resume_epoch = backup.resume_epoch
    trained = resume_epoch >= epochs
    train_ds = data.make_pipeline(pool, "train", image_size=recipe.image_size,
                                  batch_size=recipe.batch_size, training=True,
                                  augmentation=training.augmentation_for(config),
                                  seed=config.seed,
                                  start_batch=resume_epoch * steps_per_epoch)
    from vit_keras.tools import distribution as distribution_lib

    jit_compile = recipes.use_jit_compile() if config.jit_compile is None else config.jit_compile
    if config.distribution == "data_parallel" and keras.backend.backend() == "tensorflow":
        jit_compile = False  # as training.run: TensorFlow's XLA cannot place mirrored variables
    with distribution_lib.distribution_scope(config.distribution, config.model_parallel_size):
        vit = training.build_run_model(config, recipe, splits.num_classes, log=log)
        model = mpp.build_pretraining_model(
            vit, target=FLAGS.target, corruption_rate=FLAGS.corruption_rate,
            mask_fraction=FLAGS.mask_fraction, random_fraction=FLAGS.random_fraction,
            seed=config.seed)
        optimizer = recipes.make_optimizer(
            recipe, max(1, epochs * steps_per_epoch // accum), accum)
        model.compile(optimizer=optimizer, loss=None, jit_compile=jit_compile)
    # Loadable on every backend, which chooses its own jit_compile unless the user did.
    recipes.portable_compile_config(model, keep_jit_compile=config.jit_compile is not None)
    replicas = (distribution_lib.num_replicas(config.distribution)
                if config.distribution != "none" else 1)
    if not trained:
        training.check_activation_memory(model, recipe.batch_size // replicas, recipe.image_size)
    throughput = callbacks_lib.Throughput(recipe.batch_size, steps_per_epoch)
    log(f"{reason}. Run {run_name}: masked patch prediction ({FLAGS.target}) on "
        f"{pool.num_examples['train']} {config.dataset} images, {model.count_params():,} "
        f"parameters, image size {recipe.image_size}, batch {recipe.batch_size}, {epochs} epochs "
        f"of {steps_per_epoch} steps, {recipe.optimizer} lr {recipe.learning_rate:g}, backend "
        f"{keras.backend.backend()}.")
    if trained:
        log(f"Resuming {folder.path}: its training ended (epoch {resume_epoch} of {epochs}) "
            f"before the few-shot evaluation; evaluating the backed-up model.")
        backup.restore(model)
        fit_seconds = 0.0
    else:
        if resume_epoch:
            log(f"Resuming {folder.path} from its backup after epoch {resume_epoch} of "
                f"{epochs}.")
        nan_guard = callbacks_lib.StopOnNaN()
        backup.guard = nan_guard
        checkpoint = callbacks_lib.AtomicModelCheckpoint(folder.model)
        checkpoint.guard = nan_guard
        fit_started = time.perf_counter()
        model.fit(train_ds, epochs=epochs, steps_per_epoch=steps_per_epoch,
                  verbose=config.verbose,
                  callbacks=[nan_guard, throughput,
                             keras.callbacks.CSVLogger(folder.history, append=True),
                             checkpoint, backup], shuffle=False)
        fit_seconds = time.perf_counter() - fit_started
        if nan_guard.bad_step:
            folder.remove_backup()  # the next run starts afresh
            raise callbacks_lib.NonFiniteLossError(
                f"The pre-training loss became {nan_guard.bad_step[2]}; lower --learning_rate "
                f"(now {recipe.learning_rate:g}) or lengthen --warmup_steps.")
        if os.environ.get(training.KILL_AFTER_TRAINING) == "1":
            os.kill(os.getpid(), signal.SIGKILL)
    folder.save_model(model)
    history = read_history(folder.history)
    shots = [int(s) for s in FLAGS.fewshot_shots]
    few_shot = None
    if shots:
        features = {split: fewshot.dataset_features(model, data.make_pipeline(
            splits, split, image_size=recipe.image_size, batch_size=config.eval_batch_size
        ).as_numpy_iterator()) for split in ("train", "test")}
        few_shot = fewshot.evaluate(*features["train"], *features["test"], shots=shots,
                                    seeds=FLAGS.fewshot_seeds, num_classes=splits.num_classes)
    metrics = {
        "train_loss": history[-1]["loss"] if history else None,
        "fewshot": few_shot,
        "images_per_second": throughput.images_per_second(),
        "wall_time_s": time.perf_counter() - _STARTED,
        "fit_time_s": fit_seconds,
        "epochs": epochs,
        "resumed_from_epoch": resume_epoch,
        "num_examples": pool.num_examples,
        "history": history,
        "model_path": folder.model,
        "config": {
            "backend": keras.backend.backend(), "keras_version": keras.__version__,
            "run_name": run_name, "dataset": config.dataset,
            "recipe": dataclasses.asdict(recipe), "recipe_reason": reason,
            "run": {k: v for k, v in dataclasses.asdict(config).items() if k != "flags_text"},
            "objective": {"target": FLAGS.target, "corruption_rate": FLAGS.corruption_rate,
                          "mask_fraction": FLAGS.mask_fraction,
                          "random_fraction": FLAGS.random_fraction,
                          "pretrain_splits": list(FLAGS.pretrain_splits)},
            "model_name": model.name, "num_parameters": model.count_params(),
            "steps_per_epoch": steps_per_epoch, "accum_steps": accum,
            "augmentation": dataclasses.asdict(training.augmentation_for(config)),
            "jit_compile": model.jit_compile,
            "dtype_policy": keras.config.dtype_policy().name,
        },
    }
    folder.write_metrics(metrics)  # last: from now on the folder holds a finished run
    folder.remove_backup()
    training.set_precision("none")
    return metrics


@_common.exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    from vit_keras.tools.run_folder import RunFolder

    config = config_flags.from_flags(training.RunConfig,
                                     flags_text=_common.run_flags_text(_FLAG_MODULE))
    processes = config.num_processes
    if processes is None:
        processes = int(os.environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES") or 1)
    if processes != 1 or config.coordinator_address:
        # Its run loop has none of training.run's process coordination (collective saving,
        # sharded evaluation, agreeing on the epoch to resume from).
        raise app.UsageError("apps/pretrain.py runs in one process; --num_processes and "
                             "--coordinator_address are for apps/finetune.py and apps/train.py. "
                             "Use --distribution data_parallel over one process's devices.")
    metrics = run(config)
    speed = metrics["images_per_second"]
    print(f"\nMasked patch prediction loss (last epoch): {metrics['train_loss']:.4f}; "
          f"{metrics['epochs']} epochs in {metrics['fit_time_s']:.0f} s"
          + (f" ({speed:.0f} images/s)" if speed else "")
          + f", backend {metrics['config']['backend']}.")
    if metrics["fewshot"]:
        print(f"\nFew-shot linear accuracy of the frozen features ({config.dataset} test):\n")
        from vit_keras import fewshot

        print(fewshot.results_table(metrics["fewshot"]))
    print(f"\n{'Model:' if metrics.get('already_complete') else 'Saved model:'} "
          f"{metrics['model_path']}")
    print(f"Metrics:     {RunFolder.of_model(metrics['model_path']).metrics}")
    return 0


if __name__ == "__main__":
    app.run(main)
