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

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import finetune  # noqa: E402  (selects the backend and defines every flag)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

flags.adopt_module_key_flags(finetune)  # `--help` lists every flag

finetune.APP_NAME = "train"
finetune.FLAGS.set_default("recipe", "pretrain")
finetune.FLAGS["recipe"].help = (
    "Base recipe: pretrain (the paper's), digits (the default on the digits data), or finetune. "
    "The flags below override single values.")


def main(argv):
    # The digits data keeps its own recipe unless --recipe is given explicitly.
    if finetune.FLAGS.dataset == "digits" and not finetune.FLAGS["recipe"].present:
        finetune.FLAGS.recipe = "digits"
    return finetune.main(argv)


if __name__ == "__main__":
    app.run(main)
