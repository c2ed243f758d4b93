r"""Fine-tunes (or, without --weights, trains) a Vision Transformer with model.fit on any backend.

    python apps/finetune.py --backend jax                  # the offline default: digits, from scratch
    python apps/finetune.py --backend torch --dataset cifar10 --data_dir ~/tensorflow_datasets \
        --weights ViT-B_16.npz --image_size 384 --batch_size 512
    python apps/finetune.py --backend tensorflow --dataset folder:/data/flowers \
        --weights ViT-B_16.npz --image_size 224 --batch_size 32 --epochs 5
    python apps/finetune.py --backend jax --dataset cifar10 --model ViT-S/16 \
        --weights augreg_in21k --image_size 224 --batch_size 128

--weights takes a checkpoint file (the file decides the architecture; --model only checks it), a
`.keras` file, `hf-hub:REPO_ID`, or a published release by name (imagenet21k,
imagenet21k+imagenet2012, augreg_in21k, augreg_in21k_ft_in1k, augreg_in1k; see
`vit_keras.list_weights()`), which needs --model: the release's file nearest --image_size is
downloaded once into $VIT_KERAS_HOME (default $KERAS_HOME/vit_keras); without network access set
VIT_KERAS_WEIGHTS_MIRROR to a URL or folder holding the bucket's paths, or the run stops at once
with status 2 and says where to place the file.

With --weights the defaults are vit_jax's fine-tuning recipe (SGD momentum 0.9, global-norm clipping
1.0, 500 warm-up steps then cosine decay, lr 0.03, no weight decay, batch 512, 10k steps, 384 px,
zero-initialised head, position embeddings resampled to --image_size); on the digits data, the
digits recipe at the weights' own image size. Without --weights the model starts from scratch: on
digits with the digits recipe, elsewhere with the paper's pre-training recipe (see apps/train.py).
Every recipe value can be overridden by its flag. A configuration whose training step cannot fit
in memory is refused before the first step, with the estimate.

Outputs go to OUTPUT_DIR/RUN_NAME/: model.keras, metrics.json, flags.txt (the app's flags, usable
as --flagfile, --backend included), class_names.json, history.csv, training_curves.png, logs/
(TensorBoard). The same command run again after a crash or SIGKILL resumes from the last completed
epoch (backup/), or at the final evaluation if training had ended; run again after the run
finished, it says the run is complete and changes nothing (--overwrite starts it over). A second
process into a folder in use stops at once, naming the first.
"""

import time

_STARTED = time.perf_counter()
import _backend

_backend.start_app()  # before keras is imported

from absl import app

import _common

# The flags are vit_keras.tools.runs.run_config.RunConfig's fields.
main = _common.training_app("finetune", _STARTED)

if __name__ == "__main__":
    app.run(main, flags_parser=_backend.parse_flags)
