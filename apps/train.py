r"""Trains a Vision Transformer from scratch with the paper's pre-training recipe, on any backend.

    python apps/train.py --backend jax                       # digits, offline, a small ViT
    python apps/train.py --backend jax --dataset imagenet2012 --data_dir ~/tensorflow_datasets \
        --model ViT-B/16 --batch_size 4096 --accum_steps 8 --mixed_precision bfloat16 \
        --distribution data_parallel

Defaults (the paper, section 4.1 and appendix B.1): AdamW β1 0.9, β2 0.999, weight decay 0.1,
lr 1e-3, 10k linear warm-up steps then linear decay, global-norm clipping 1.0, batch 4096,
dropout 0.1, 224 px. On the digits data the digits recipe applies (the same shape at digits
scale). Takes the same flags as apps/finetune.py (`--help` lists them); only --recipe defaults to
pretrain here, so --weights is an initialisation, not a switch to the fine-tuning recipe.
"""

import time

_STARTED = time.perf_counter()
import _backend

_backend.start_app()  # before keras is imported

from absl import app

import _common

# apps/finetune.py's flags; only --recipe defaults to the paper's pre-training recipe.
main = _common.training_app(
    "train", _STARTED, recipe="pretrain",
    recipe_help="Base recipe: pretrain (the paper's), digits (the default on the digits data), or "
                "finetune. The flags below override single values.")

if __name__ == "__main__":
    app.run(main, flags_parser=_backend.parse_flags)
