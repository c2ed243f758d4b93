r"""Fine-tunes (or, without --weights, trains) a Vision Transformer with model.fit on any backend.

    python apps/finetune.py --backend jax                  # the offline default: digits, from scratch
    python apps/finetune.py --backend torch --dataset cifar10 --data_dir ~/tensorflow_datasets \
        --weights ViT-B_16.npz --image_size 384 --batch_size 512
    python apps/finetune.py --backend tensorflow --dataset folder:/data/flowers \
        --weights ViT-B_16.npz --image_size 224 --batch_size 32 --epochs 5

With --weights the defaults are vit_jax's fine-tuning recipe (SGD momentum 0.9, global-norm clipping
1.0, 500 warm-up steps then cosine decay, lr 0.03, no weight decay, batch 512, 10k steps, 384 px,
zero-initialised head, position embeddings resampled to --image_size). Without --weights the model
starts from scratch: on digits with the digits recipe, elsewhere with the paper's pre-training
recipe (see apps/train.py). Every recipe value can be overridden by its flag.

Outputs go to OUTPUT_DIR/RUN_NAME/: model.keras, metrics.json, flags.txt, class_names.json,
history.csv, training_curves.png, logs/ (TensorBoard). The same command run again after a crash or
SIGKILL resumes from the last completed epoch (backup/).
"""

import os
import sys
import time

_STARTED = time.perf_counter()
_APPS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_APPS))  # run from a checkout
sys.path.insert(0, _APPS)
import _backend  # noqa: E402

_backend.start_app()  # before keras is imported

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

APP_NAME = "finetune"

# --- data
flags.DEFINE_string("dataset", "digits",
                    "digits (scikit-learn's bundled 8x8 digits, offline), folder:PATH (one "
                    "sub-folder per class, or PATH/train + PATH/val [+ PATH/test]), or a tfds name "
                    "(cifar10, cifar100, oxford_iiit_pet, oxford_flowers102, imagenet2012, ...).")
flags.DEFINE_string("data_dir", None, "tfds data directory (default ~/tensorflow_datasets).")
flags.DEFINE_boolean("download", True,
                     "Let tfds download and prepare a dataset that is not in --data_dir (needs "
                     "the network; without it the run fails at once with instructions).")
flags.DEFINE_float("val_fraction", None,
                   "Fraction of train held out as val when the dataset has no val split "
                   "(default 0.1 for folders, 0.02 for tfds as vit_jax's train[98%:]).")
# --- model
flags.DEFINE_string("model", None,
                    "Variant (ViT-Ti/16, ViT-S/16, ViT-B/16, ViT-L/16, ...; see "
                    "vit_keras.VARIANTS) or ViT-digits. Default: ViT-digits on digits without "
                    "--weights, ViT-B/16 otherwise; with --weights the checkpoint decides.")
flags.DEFINE_string("weights", None,
                    "Pretrained weights: any file vit_keras.load_pretrained reads (vit_jax .npz, "
                    "timm .pth/.safetensors, a Hugging Face folder) or a .keras file. A new head "
                    "is zero-initialised and position embeddings are resampled to --image_size.")
flags.DEFINE_enum("classifier", None, ["token", "gap"],
                  "Class token or global average pooling (default: gap for ViT-digits, token "
                  "otherwise; with --weights the checkpoint decides).")
flags.DEFINE_integer("image_size", None, "Training and evaluation resolution (recipe default: 384 "
                     "fine-tuning, 224 pre-training, 16 digits).")
flags.DEFINE_float("dropout", None, "Dropout rate (recipe default: 0.0 fine-tuning, 0.1 otherwise).")
flags.DEFINE_float("attention_dropout", 0.0, "Dropout on the attention probabilities.")
flags.DEFINE_float("drop_path_rate", 0.0, "Stochastic depth of the last block.")
flags.DEFINE_integer("representation_size", None,
                     "Width of a pre-logits layer (Dense + tanh) before the head (new models only).")
# --- recipe
flags.DEFINE_enum("recipe", "auto", ["auto", "finetune", "pretrain", "digits"],
                  "Base recipe: auto = finetune with --weights, digits on the digits data, "
                  "pretrain otherwise. The flags below override single values.")
flags.DEFINE_enum("optimizer", None, ["sgd", "adamw"],
                  "sgd (momentum, fine-tuning) or adamw (pre-training, digits).")
flags.DEFINE_float("learning_rate", None,
                   "Peak learning rate (recipe default: 0.03 fine-tuning, 1e-3 pre-training, 3e-3 "
                   "digits).")
flags.DEFINE_float("momentum", None, "SGD momentum (default 0.9).")
flags.DEFINE_float("weight_decay", None,
                   "Decoupled weight decay (default 0 fine-tuning, 0.1 pre-training and digits).")
flags.DEFINE_float("grad_clip_norm", None, "Global-norm gradient clipping; 0 turns it off "
                   "(default 1.0).")
flags.DEFINE_integer("warmup_steps", None, "Linear warm-up in optimizer updates (default 500 "
                     "fine-tuning, 10000 pre-training, 78 digits).")
flags.DEFINE_enum("decay", None, ["cosine", "linear"],
                  "Decay after the warm-up (default cosine fine-tuning, linear pre-training).")
flags.DEFINE_integer("total_steps", None,
                     "Optimizer updates in all (default 10000 fine-tuning); sets --epochs to "
                     "ceil(total_steps * accum_steps / steps_per_epoch).")
flags.DEFINE_integer("epochs", None, "Epochs (default: from --total_steps; 30 on digits).")
flags.DEFINE_integer("steps_per_epoch", None,
                     "Batches per epoch (default: training images // batch size).")
flags.DEFINE_integer("batch_size", None, "Global batch size (default 512 fine-tuning, 4096 "
                     "pre-training, 32 digits).")
flags.DEFINE_integer("eval_batch_size", 256, "Batch size of validation and test.")
flags.DEFINE_integer("accum_steps", 1, "Gradient accumulation: batches averaged per update.")
flags.DEFINE_float("label_smoothing", None, "Label smoothing (default 0; 0.1 on digits).")
# --- augmentation
flags.DEFINE_float("crop_min_area", None,
                   "Inception crop: smallest crop area fraction (default 0.05 as vit_jax; 0.8 on "
                   "digits).")
flags.DEFINE_boolean("flip", None, "Random horizontal flip (default on; off on digits).")
flags.DEFINE_string("randaugment", None,
                    "RandAugment as NUM_OPS,MAGNITUDE (e.g. 2,0.5; keras.layers.RandAugment).")
flags.DEFINE_float("mixup", 0.0, "MixUp alpha (0: off; keras.layers.MixUp).")
flags.DEFINE_float("cutmix", 0.0, "CutMix factor (0: off; keras.layers.CutMix).")
# --- compute
flags.DEFINE_enum("mixed_precision", "none", ["none", "bfloat16", "float16"],
                  "Mixed precision policy (variables stay float32; float16 adds loss scaling).")
flags.DEFINE_boolean("jit_compile", None,
                     "XLA/jit compilation of the train step (default: on for jax and tensorflow, "
                     "off for torch, where torch.compile of a ViT step takes minutes on CPU).")
flags.DEFINE_enum("distribution", "none", ["none", "data_parallel", "model_parallel"],
                  "data_parallel: keras DataParallel over all local devices (jax) or "
                  "tf.distribute.MirroredStrategy (tensorflow); model_parallel: keras "
                  "ModelParallel sharding attention and MLP kernels (jax only). torch has neither.")
flags.DEFINE_integer("model_parallel_size", None,
                     "Devices on the mesh's model axis for model_parallel (default: all).")
# --- run
flags.DEFINE_string("output_dir", "saved_models", "Where run folders are written.")
flags.DEFINE_string("run_name", None,
                    "Run folder name (default APP_DATASET_MODEL); the same name resumes the run.")
flags.DEFINE_integer("seed", 0, "Seed of the initialisation, the data order and the splits.")
flags.DEFINE_integer("verbose", 1, "Keras fit verbosity: 1 progress bars, 2 one line per epoch.")
FLAGS = flags.FLAGS

_RUN_FIELDS = (
    "dataset", "data_dir", "download", "val_fraction", "model", "weights", "classifier",
    "image_size", "dropout", "attention_dropout", "drop_path_rate", "representation_size",
    "recipe", "optimizer", "learning_rate", "momentum", "weight_decay", "grad_clip_norm",
    "warmup_steps", "decay", "total_steps", "epochs", "steps_per_epoch", "batch_size",
    "eval_batch_size", "accum_steps", "label_smoothing", "crop_min_area", "flip", "randaugment",
    "mixup", "cutmix", "mixed_precision", "jit_compile", "distribution", "model_parallel_size",
    "output_dir", "run_name", "seed", "verbose")


def run_config():
    """The flags as a `vit_keras.tools.training.RunConfig`."""
    from vit_keras.tools import training

    return training.RunConfig(**{name: FLAGS[name].value for name in _RUN_FIELDS},
                              flags_text=FLAGS.flags_into_string())


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    from vit_keras.tools import callbacks, data, training
    from vit_keras.tools.run_folder import RunFolder

    try:
        metrics = training.run(run_config(), app=APP_NAME, started=_STARTED)
    except (data.DatasetNotPreparedError, callbacks.NonFiniteLossError) as error:
        print(f"\nERROR: {error}", file=sys.stderr)
        return 2
    print()
    print(training.metrics_table(metrics))
    print(f"\nSaved model: {metrics['model_path']}")
    print(f"Metrics:     {RunFolder.of_model(metrics['model_path']).metrics}")
    return 0


if __name__ == "__main__":
    app.run(main)
