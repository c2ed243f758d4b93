r"""Self-supervised pre-training by masked patch prediction (the paper's section 4.6), any backend.

    python apps/pretrain.py --backend jax                 # digits, offline, a few minutes
    python apps/finetune.py --backend jax \
        --weights saved_models/pretrain_digits_ViT-digits_jax/model.keras   # digits recipe, 16 px
    python apps/fewshot.py --backend jax --model saved_models/pretrain_digits_ViT-digits_jax/model.keras
    python apps/pretrain.py --backend jax --dataset imagenet2012 --data_dir ~/tensorflow_datasets \
        --model ViT-B/16 --accum_steps 8 --mixed_precision bfloat16 --fewshot_shots ""

Of each image's patch embeddings 50% are corrupted (80% of those replaced by a learnable [mask]
embedding, 10% by another patch's embedding, 10% kept), and a linear head on each corrupted
patch's output token predicts its 3-bit mean colour (512 classes; `--target` selects the paper's
ablation targets instead). The corruption runs inside the compiled train step
(`vit_keras.training.masked_patch_prediction`); the labels of the dataset are never read.

Recipe `mpp` (the paper, appendix B.1.2): Adam (no weight decay), base lr 2e-4, 10k warm-up steps,
cosine decay, batch 4096, 1M steps, inception crop and horizontal flip, global-norm clipping 1,
no dropout, 224 px. On the digits data the default is `mpp_digits`, the same shape at digits
scale. Every value can be overridden by its flag, as in apps/finetune.py, whose dataset, model,
compute and several-process flags this app shares (not those of labels: --label_smoothing,
--mixup, --cutmix, nor --representation_size, a layer MPP would not train).

The run folder OUTPUT_DIR/RUN_NAME/ holds model.keras (a vit_keras ViT with the [mask] embedding
and the MPP head; apps/finetune.py --weights takes it, dropping both and zero-initialising a new
head), metrics.json (loss history and the few-shot accuracy of the frozen features,
`--fewshot_shots`), flags.txt, class_names.json, history.csv, training_curves.png, logs/
(TensorBoard). The same command resumes an interrupted run from its last completed epoch (or at
the few-shot evaluation if training had ended), leaves a finished run as it is (--overwrite starts
it over), and stops at once if another process is running in the folder. Several JAX processes
train one run as in apps/finetune.py (docs/distributed.md).
"""

import time

_STARTED = time.perf_counter()
import _backend

_backend.start_app()  # before keras is imported

from absl import app

from vit_keras.tools.runs import objectives

import _common

# The flags are vit_keras.tools.runs.run_config.RunConfig's fields that apply to masked patch
# prediction, and vit_keras.tools.runs.objectives.MaskedPatchPrediction's.
main = _common.training_app("pretrain", _STARTED, objective=objectives.MaskedPatchPrediction)

if __name__ == "__main__":
    app.run(main, flags_parser=_backend.parse_flags)
