"""What a training run optimises. `training.run` trains every objective with one loop (run folder,
resumption, several processes, TensorBoard); an `Objective` says what differs:

- its recipes (`recipes`, `choose_recipe`) and the run-config flags that do not apply to it
  (`left_out_flags`) or whose help names other defaults (`flag_overrides`);
- the images it trains on (`training_splits`) and the split `fit` validates on (`validation_split`);
- the model it trains, built from the run's ViT (`build_model`), and its loss (`compile`);
- what it measures at the end (`evaluate`: the metrics.json fields before the common ones), the
  options it records (`options`: metrics.json's `config.objective`) and the app's summary.

`Classification` is supervised training (apps/finetune.py, apps/train.py); `MaskedPatchPrediction`
is the paper's self-supervised pre-training (section 4.6, apps/pretrain.py). An objective's own
options are `config_flags.option` fields: the flags of the app that runs it.
"""

import dataclasses

from vit_keras import errors
from vit_keras.tools.runs import recipes as recipes_lib
from vit_keras.tools.runs.config_flags import option
from vit_keras.training import fewshot
from vit_keras.training import masked_patch_prediction as mpp


class ObjectiveOptionError(errors.UserError, ValueError):
    """An objective's option names something that does not exist (a split, a shot count)."""


class Objective:
    """The objective seam of `training.run`; subclasses fill it in (see the module docstring)."""

    recipes = {}                # --recipe name → recipes.Recipe
    validation_split = None     # the split `fit` validates on after each epoch, or None
    trains_a_classifier = False  # LoRA and the linear probe fine-tune a classifier alone
    evaluation = "the final evaluation"   # what a run resumed after its training does (the log)
    left_out_flags = ()         # RunConfig fields that are no flags of this objective's app
    flag_overrides = {}         # RunConfig field → {"help": ..., "choices": ...} for its app

    def choose_recipe(self, config):
        """The base `recipes.Recipe` of a run (`config.recipe`, or the objective's choice for
        "auto") and why it was chosen (a sentence for the log)."""
        recipe = config.optimization.recipe
        if recipe == "auto":
            return self.auto_recipe(config)
        if recipe not in self.recipes:
            raise ValueError(f"Unknown recipe {recipe!r}; expected auto or one of "
                             f"{sorted(self.recipes)}.")
        return self.recipes[recipe], f"recipe {recipe} (--recipe)"

    def auto_recipe(self, config):
        raise NotImplementedError

    def training_splits(self, splits):
        """`data.Splits` whose "train" split is what the run trains on."""
        return splits

    def build_model(self, vit, seed):
        """The model `fit` trains, from the run's ViT `build_run_model` built."""
        return vit

    def compile(self, model, optimizer, recipe, jit_compile):
        raise NotImplementedError

    def describe(self, model):
        """What the run trains, for its log line."""
        return model.name

    def evaluate(self, model, splits, pipeline, history):
        """The end-of-run metrics (a dict). `pipeline(split, whole_batches=False)` gives a
        split's evaluation batches; with `whole_batches`, padded to whole batches with zero
        sample weights when the run has several processes (for `model.evaluate`). `history`:
        the rows of history.csv."""
        raise NotImplementedError

    def options(self):
        """The objective's options for metrics.json's `config.objective`, or `None`."""
        return dataclasses.asdict(self) if dataclasses.is_dataclass(self) else None

    def summary(self, metrics):
        """The app's printout of a run's metrics."""
        raise NotImplementedError


def _percent(value):
    return "-" if value is None else f"{100 * value:.2f}%"


@dataclasses.dataclass
class Classification(Objective):
    """Supervised classification: the ViT itself, softmax cross-entropy on one-hot labels with
    the recipe's label smoothing, validated on val after every epoch, scored on val and test."""

    recipes = recipes_lib.RECIPES
    validation_split = "val"
    trains_a_classifier = True

    def auto_recipe(self, config):
        dataset, weights = config.data.dataset, config.model.weights
        own = recipes_lib.dataset_recipe(self.recipes, dataset)  # the digits'
        if own is not None:
            if weights:
                return own, f"fine-tuning {weights} on the {dataset} with the {own.name} recipe"
            return own, (f"no pretrained weights given (--weights): training from scratch with "
                         f"the {own.name} recipe (the paper's pre-training recipe at {dataset} "
                         f"scale)")
        if weights:
            return recipes_lib.FINETUNE_RECIPE, (f"fine-tuning {weights} with vit_jax's "
                                                 "fine-tuning recipe")
        return recipes_lib.PRETRAIN_RECIPE, ("no pretrained weights given (--weights): training "
                                             "from scratch with the paper's pre-training recipe")

    def compile(self, model, optimizer, recipe, jit_compile):
        recipes_lib.compile_model(model, optimizer, recipe.label_smoothing, jit_compile)

    def evaluate(self, model, splits, pipeline, history):
        results = {split: model.evaluate(pipeline(split, whole_batches=True), verbose=0,
                                         return_dict=True) for split in ("val", "test")}
        last = history[-1] if history else {}
        return {
            "test_accuracy": results["test"]["accuracy"],
            "test_top5_accuracy": results["test"].get("top5_accuracy"),
            "test_loss": results["test"]["loss"],
            "val_accuracy": results["val"]["accuracy"],
            "val_top5_accuracy": results["val"].get("top5_accuracy"),
            "val_loss": results["val"]["loss"],
            "train_loss": last.get("loss"),
            "train_accuracy": last.get("accuracy"),
        }

    def options(self):
        return None  # metrics.json of a classification run has no `config.objective`

    def summary(self, metrics):
        """A markdown table of the run's headline numbers."""
        rows = [("test accuracy", _percent(metrics["test_accuracy"])),
                ("test top-5 accuracy", _percent(metrics.get("test_top5_accuracy"))),
                ("val accuracy", _percent(metrics["val_accuracy"])),
                ("test loss", f"{metrics['test_loss']:.4f}"),
                ("train loss (last epoch)", "-" if metrics.get("train_loss") is None
                 else f"{metrics['train_loss']:.4f}"),
                ("training images/s", "-" if not metrics.get("images_per_second")
                 else f"{metrics['images_per_second']:.1f}"),
                ("epochs", str(metrics["epochs"]) + (
                    f" (resumed after {metrics['resumed_from_epoch']})"
                    if metrics.get("resumed_from_epoch") else "")),
                ("wall time", f"{metrics['wall_time_s']:.1f} s"),
                ("backend", metrics["config"]["backend"])]
        width = max(len(name) for name, _ in rows)
        lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
        return "\n".join(lines)


# apps/pretrain.py's help of the run-config flags whose classification help names fine-tuning
# defaults.
_MPP_FLAG_HELP = {
    "recipe": ("Base recipe: auto = mpp_digits on the digits data, mpp (the paper's, appendix "
               "B.1.2) otherwise. The flags below override single values."),
    "weights": ("Initial weights of the ViT, as apps/finetune.py takes them (a release name with "
                "--model, hf-hub:REPO_ID, a checkpoint file or a .keras file); position "
                "embeddings are resampled to --image_size, and the MPP head is new."),
    "optimizer": "adamw (the MPP recipes: Adam without weight decay) or sgd (with --momentum).",
    "momentum": "SGD momentum, with --optimizer sgd (default 0.9).",
    "learning_rate": "Peak learning rate (recipe default: 2e-4 mpp, 1e-3 mpp_digits).",
    "weight_decay": "Decoupled weight decay (default 0: the paper names none for MPP).",
    "warmup_steps": ("Linear warm-up in optimizer updates (default 10000 mpp, 100 "
                     "mpp_digits)."),
    "decay": "Decay after the warm-up (default cosine).",
    "total_steps": ("Optimizer updates in all (default 1000000 mpp; mpp_digits counts epochs); "
                    "sets --epochs to ceil(total_steps * accum_steps / steps_per_epoch)."),
    "epochs": "Epochs (default: from --total_steps; 60 on the digits, mpp_digits).",
    "batch_size": "Global batch size (default 4096 mpp, 64 mpp_digits).",
    "image_size": "Training and evaluation resolution (recipe default: 224 mpp, 16 mpp_digits).",
    "dropout": "Dropout rate (recipe default: 0.0).",
    "eval_batch_size": "Batch size of the few-shot evaluation's feature extraction.",
}


@dataclasses.dataclass
class MaskedPatchPrediction(Objective):
    """Masked patch prediction (`vit_keras.masked_patch_prediction`): the ViT with a [mask]
    embedding and an MPP head, its loss inside the model (compiled with `loss=None`), trained on
    the images of `pretrain_splits` pooled (labels unused) without validation, and scored by the
    few-shot linear accuracy of its frozen features (train split → test split)."""

    target: str = option("mean_colour", "What each corrupted patch predicts: mean_colour (3-bit "
                         "mean colour, 512 classes, the paper's), downsampled_colour (3-bit "
                         "colours of a 4x4 grid, 16 x 512), pixels (L2 regression on the "
                         "patch's normalised pixels).", choices=mpp.TARGETS)
    corruption_rate: float = option(0.5, "Fraction of each image's patches corrupted.",
                                    bounds="(0, 1]")
    mask_fraction: float = option(0.8, "Of the corrupted: replaced by the [mask] embedding.",
                                  bounds="[0, 1]")
    random_fraction: float = option(0.1, "Of the corrupted: replaced by another patch's "
                                    "embedding (the rest is kept).", bounds="[0, 1]")
    pretrain_splits: tuple = option(("train",), "Splits whose images are pre-trained on (labels "
                                    "unused), e.g. train,val,test for all digits images.")
    fewshot_shots: tuple = option((1, 5, 10, 25), "Few-shot linear evaluation of the frozen "
                                  "features after training (train split → test split): "
                                  "examples per class, each count on its own; empty: none.")
    fewshot_seeds: int = option(3, "Draws of the few-shot training examples.", bounds="[1, inf)")

    recipes = recipes_lib.MPP_RECIPES
    evaluation = "the few-shot evaluation"
    # No labels are learnt: no label smoothing, MixUp or CutMix; the pre-logits layer sits after
    # the pooling, which MPP does not train.
    left_out_flags = ("label_smoothing", "mixup", "cutmix", "representation_size")
    flag_overrides = {name: {"help": text} for name, text in _MPP_FLAG_HELP.items()}
    flag_overrides["recipe"]["choices"] = ("auto", *recipes_lib.MPP_RECIPES)

    def __post_init__(self):
        self.pretrain_splits = tuple(self.pretrain_splits)
        try:
            self.fewshot_shots = tuple(int(shots) for shots in self.fewshot_shots)
            if min(self.fewshot_shots, default=1) < 1:
                raise ValueError
        except ValueError:
            raise ObjectiveOptionError(
                f"--fewshot_shots takes positive whole numbers of examples per class (e.g. "
                f"1,5,10,25) or nothing; got {','.join(map(str, self.fewshot_shots))!r}.") from None
        if self.mask_fraction + self.random_fraction > 1:
            raise ObjectiveOptionError(
                f"--mask_fraction {self.mask_fraction} + --random_fraction {self.random_fraction} "
                f"exceed 1: they are fractions of the same corrupted patches.")

    def auto_recipe(self, config):
        recipe = recipes_lib.dataset_recipe(self.recipes, config.data.dataset) or self.recipes["mpp"]
        return recipe, f"recipe {recipe.name}"

    def training_splits(self, splits):
        """`splits` whose "train" source is the images of `pretrain_splits`, one after the other."""
        unknown = sorted(set(self.pretrain_splits) - set(splits.sources))
        if unknown or not self.pretrain_splits:
            raise ObjectiveOptionError(
                f"--pretrain_splits {','.join(self.pretrain_splits)}: {splits.name} has no split "
                f"{unknown or repr('')}; it has {sorted(splits.sources)}.")
        sources = [splits.sources[name] for name in self.pretrain_splits]

        def pooled():
            dataset = sources[0]()
            for source in sources[1:]:
                dataset = dataset.concatenate(source())
            return dataset

        count = sum(splits.num_examples[name] for name in self.pretrain_splits)
        return dataclasses.replace(splits, num_examples={**splits.num_examples, "train": count},
                                   sources={**splits.sources, "train": pooled})

    def build_model(self, vit, seed):
        return mpp.build_pretraining_model(
            vit, target=self.target, corruption_rate=self.corruption_rate,
            mask_fraction=self.mask_fraction, random_fraction=self.random_fraction, seed=seed)

    def compile(self, model, optimizer, recipe, jit_compile):
        model.compile(optimizer=optimizer, loss=None,  # the model adds its loss (add_loss)
                      jit_compile=recipes_lib.use_jit_compile() if jit_compile is None
                      else jit_compile)
        recipes_lib.portable_compile_config(model, keep_jit_compile=jit_compile is not None)

    def describe(self, model):
        return f"masked patch prediction ({self.target}) with {model.name}"

    def evaluate(self, model, splits, pipeline, history):
        few_shot = None
        if self.fewshot_shots:
            features = {split: fewshot.dataset_features(model, pipeline(split).as_numpy_iterator())
                        for split in ("train", "test")}
            few_shot = fewshot.evaluate(*features["train"], *features["test"],
                                        shots=self.fewshot_shots, seeds=self.fewshot_seeds,
                                        num_classes=splits.num_classes)
        return {"train_loss": history[-1]["loss"] if history else None, "fewshot": few_shot}

    def summary(self, metrics):
        loss, speed = metrics.get("train_loss"), metrics.get("images_per_second")
        text = (f"Masked patch prediction loss (last epoch): "
                f"{'-' if loss is None else f'{loss:.4f}'}; {metrics['epochs']} "
                f"epoch{'' if metrics['epochs'] == 1 else 's'} in "
                f"{metrics['fit_time_s']:.0f} s" + (f" ({speed:.0f} images/s)" if speed else "")
                + f", backend {metrics['config']['backend']}.")
        if metrics.get("fewshot"):
            text += (f"\n\nFew-shot linear accuracy of the frozen features "
                     f"({metrics['config']['dataset']} test):\n\n"
                     + fewshot.results_table(metrics["fewshot"]))
        return text
