"""`RunConfig`: everything a training run needs (`training.run`), which is also the training
apps' flags (`config_flags.define_flags`), its fields grouped by concern: `data`, `model`,
`optimization`, `augmentation`, `finetuning`, `compute`, `processes`, `output`, and `seed`.

    config = RunConfig.of(dataset="cifar10", weights="ViT-B_16.npz", lora_rank=4)
    config.model.weights, config.finetuning.lora_rank    # "ViT-B_16.npz", 4
    config.replace(epochs=5).flags()["epochs"]           # 5
"""

import dataclasses

from vit_keras.tools.distributed import distribution as distribution_lib
from vit_keras.tools.runs import config_flags
from vit_keras.tools.runs import recipes as recipes_lib
from vit_keras.tools.runs.config_flags import option


@dataclasses.dataclass
class DataConfig:
    """What the run trains and evaluates on."""

    dataset: str = option(
        "digits", "digits (scikit-learn's bundled 8x8 digits, offline), folder:PATH (one "
        "sub-folder per class, or PATH/train + PATH/val [+ PATH/test]), or a tfds name "
        "(cifar10, cifar100, oxford_iiit_pet, oxford_flowers102, imagenet2012, ...).")
    data_dir: str = option(None, "tfds data directory (default ~/tensorflow_datasets).")
    download: bool = option(
        True, "Let tfds download and prepare a dataset that is not in --data_dir (needs the "
        "network; without it the run fails at once with instructions).")
    val_fraction: float = option(
        None, "Fraction of train held out as val when the dataset has no val split (default 0.1 "
        "for folders, 0.02 for tfds as vit_jax's train[98%:]).", bounds="(0, 1)")


@dataclasses.dataclass
class ModelConfig:
    """The ViT: its variant or weights, resolution, head and dropout rates."""

    model: str = option(
        None, "Variant (ViT-Ti/16, ViT-S/16, ViT-B/16, ViT-L/16, ... or the official spelling "
        "ViT-B_16; see vit_keras.VARIANTS) or ViT-digits. Default: ViT-digits on digits without "
        "--weights, ViT-B/16 otherwise; with a checkpoint file in --weights the file decides "
        "(--model then only checks it); a release name in --weights needs --model.")
    weights: str = option(
        None, "Pretrained weights: a published release by name (imagenet21k, "
        "imagenet21k+imagenet2012, augreg_in21k, augreg_in21k_ft_in1k, augreg_in1k; needs "
        "--model; the file nearest --image_size is downloaded once into $VIT_KERAS_HOME, default "
        "$KERAS_HOME/vit_keras; $VIT_KERAS_WEIGHTS_MIRROR names a mirror URL or folder), "
        "hf-hub:REPO_ID, any file vit_keras.load_pretrained reads (vit_jax .npz, timm "
        ".pth/.safetensors, a Hugging Face folder) or a .keras file. A new head is "
        "zero-initialised and position embeddings are resampled to --image_size.")
    normalization: str = option(
        None, "With --weights: how the weights' pixels were normalised in training, which the "
        "model then does itself: inception ((x - 127.5) / 127.5, the paper's), imagenet "
        "(ImageNet's mean and std: DeiT, DINOv2, MAE) or clip. Default: what the weights say "
        "(the release table, timm's config.json or model name, the Hugging Face image "
        "processor), else inception with a warning.", choices=("inception", "imagenet", "clip"))
    timm_architecture: str = option(
        None, "With --weights of a timm state dict: the timm model name (e.g. "
        "vit_base_patch16_clip_quickgelu_224.openai), which says what its keys cannot: CLIP's "
        "GELU, LayerNorm epsilon, heads, normalisation. Default: the architecture in timm's "
        "config.json beside the file.")
    classifier: str = option(
        None, "Class token or global average pooling (default: gap for ViT-digits, token "
        "otherwise; with --weights the checkpoint decides).", choices=("token", "gap"))
    image_size: int = option(None, "Training and evaluation resolution (recipe default: 384 "
                             "fine-tuning, 224 pre-training, 16 digits; with --weights on the "
                             "digits recipe, the weights' own).", bounds="[1, inf)")
    max_num_patches: int = option(
        None, "NaFlex: each image at its own aspect ratio, resized to at most this many patches "
        "(vit_keras.naflex_size) and padded, for a model of patch sequences (ViT(naflex=True)); "
        "training batches come in timm's sequence-length buckets up to this length "
        "(vit_keras.tools.data.naflex). Default: off, square images of --image_size.",
        bounds="[1, inf)")
    dropout: float = option(None, "Dropout rate (recipe default: 0.0 fine-tuning, 0.1 "
                            "otherwise).", bounds="[0, 1)")
    attention_dropout: float = option(0.0, "Dropout on the attention probabilities.", bounds="[0, 1)")
    drop_path_rate: float = option(0.0, "Stochastic depth of the last block.", bounds="[0, 1)")
    representation_size: int = option(
        None, "Width of a pre-logits layer (Dense + tanh) before the head (new models only; 0: "
        "none).", bounds="[0, inf)")


@dataclasses.dataclass
class OptimizationConfig:
    """The recipe and the values of it a run overrides: optimizer, schedule, batches, loss."""

    recipe: str = option(
        "auto", "Base recipe: auto = digits on the digits data (with or without --weights), "
        "finetune with --weights elsewhere, pretrain otherwise. The flags below override single "
        "values.",
        choices=("auto", *recipes_lib.RECIPES))
    optimizer: str = option(None, "sgd (momentum, fine-tuning) or adamw (pre-training, digits).",
                            choices=("sgd", "adamw"))
    learning_rate: float = option(
        None, "Peak learning rate (recipe default: 0.03 fine-tuning, 1e-3 pre-training, 3e-3 "
        "digits).", bounds="(0, inf)")
    momentum: float = option(None, "SGD momentum (default 0.9).", bounds="[0, 1)")
    weight_decay: float = option(
        None, "Decoupled weight decay (default 0 fine-tuning, 0.1 pre-training and digits).",
        bounds="[0, inf)")
    grad_clip_norm: float = option(None, "Global-norm gradient clipping; 0 turns it off "
                                   "(default 1.0).", bounds="[0, inf)")
    warmup_steps: int = option(None, "Linear warm-up in optimizer updates (default 500 "
                               "fine-tuning, 10000 pre-training, 78 digits).", bounds="[0, inf)")
    decay: str = option(None, "Decay after the warm-up (default cosine fine-tuning, linear "
                        "pre-training).", choices=("cosine", "linear"))
    total_steps: int = option(
        None, "Optimizer updates in all (default 10000 fine-tuning); sets --epochs to "
        "ceil(total_steps * accum_steps / steps_per_epoch).", bounds="[1, inf)")
    epochs: int = option(None, "Epochs (default: from --total_steps; 30 on digits).", bounds="[1, inf)")
    steps_per_epoch: int = option(None, "Batches per epoch (default: training images // batch "
                                  "size).", bounds="[1, inf)")
    batch_size: int = option(None, "Global batch size (default 512 fine-tuning, 4096 "
                             "pre-training, 32 digits).", bounds="[1, inf)")
    tokens_per_batch: int = option(
        None, "With --max_num_patches: patches per training batch, padding included; a bucket "
        "of length L has tokens_per_batch // L images (default: --batch_size x "
        "--max_num_patches, so --batch_size is the longest bucket's).", bounds="[1, inf)")
    naflex_seq_lens: tuple = option(
        (), "With --max_num_patches: the training buckets' sequence lengths, each at most "
        "--max_num_patches (default: timm's 128,256,576,784,1024 scaled to --max_num_patches; "
        "one length gives batches of one size).")
    eval_batch_size: int = option(256, "Batch size of validation and test.", bounds="[1, inf)")
    accum_steps: int = option(1, "Gradient accumulation: batches averaged per update.",
                              bounds="[1, inf)")
    label_smoothing: float = option(None, "Label smoothing (default 0; 0.1 on digits).", bounds="[0, 1)")


@dataclasses.dataclass
class AugmentationConfig:
    """Train-time augmentation (`data.Augmentation`)."""

    crop_min_area: float = option(
        None, "Inception crop: smallest crop area fraction (default 0.05 as vit_jax; 0.8 on "
        "digits).", bounds="(0, 1]")
    flip: bool = option(None, "Random horizontal flip (default on; off on digits).")
    randaugment: str = option(
        None, "RandAugment as NUM_OPS,MAGNITUDE (e.g. 2,0.5; keras.layers.RandAugment).")
    mixup: float = option(0.0, "MixUp alpha (0: off; keras.layers.MixUp).", bounds="[0, inf)")
    cutmix: float = option(0.0, "CutMix factor (0: off; keras.layers.CutMix).", bounds="[0, inf)")


@dataclasses.dataclass
class FinetuningConfig:
    """What of the weights trains, and how (`run_parts`): LoRA, the linear probe, layer-wise
    learning-rate decay, the weights' EMA."""

    lora_rank: int = option(
        None, "LoRA rank R: adapters on the attention projections and the MLP of every block; "
        "all else frozen but the head. model.keras has them merged; adapters.npz holds them alone "
        "(finetuning.apply_adapters). 0 or none: off.", bounds="[0, inf)")
    lora_alpha: float = option(None, "LoRA scale numerator: updates are scaled by alpha / rank "
                               "(default: the rank, a scale of 1).", bounds="(0, inf)")
    lora_train_norms: bool = option(False, "With --lora_rank, train the LayerNorms too.")
    linear_probe: bool = option(
        False, "Linear evaluation: the encoder frozen and run as at inference (no dropout), only "
        "the head trained.")
    layer_decay: float = option(
        None, "Layer-wise learning-rate decay F in (0, 1] (BEiT/MAE, timm): block i of L at lr * "
        "F^(L-i), the embeddings at lr * F^(L+1), the head at lr (vit_keras.layer_decay). "
        "Default: off.", bounds="(0, 1]")
    ema_decay: float = option(
        None, "Exponential moving average of the weights with this decay in (0, 1), e.g. 0.999: "
        "validated each epoch (val_ema_*), and the run's model when it validates better than "
        "the raw weights (metrics.json's ema). Default: off.", bounds="(0, 1)")


@dataclasses.dataclass
class ComputeConfig:
    """Where and how the steps run: precision, compilation, rematerialisation, devices."""

    mixed_precision: str = option(
        "none", "Mixed precision policy (variables stay float32; float16 adds loss scaling).",
        choices=("none", "bfloat16", "float16"))
    jit_compile: bool = option(
        None, "XLA/jit compilation of the train step (default: on for jax and tensorflow, off "
        "for torch, where torch.compile of a ViT step takes minutes on CPU).")
    distribution: str = option(
        "none", "data_parallel: keras DataParallel over all local devices (jax) or "
        "tf.distribute.MirroredStrategy (tensorflow); model_parallel: keras ModelParallel "
        "sharding attention and MLP kernels (jax only); fsdp: every weight, its gradient and "
        "its optimizer state split over all devices with the batch (jax only; with "
        "--model_parallel_size, a 2-D mesh). torch has none.",
        choices=distribution_lib.DISTRIBUTIONS)
    model_parallel_size: int = option(
        None, "Devices on the mesh's model axis for model_parallel (default: all; with several "
        "processes, each process's own) and fsdp (default 1: all devices on the data axis).",
        bounds="[1, inf)")
    fsdp_min_bytes: int = option(
        0, "With --distribution fsdp, weights smaller than this many bytes stay whole on every "
        "device (big_vision uses 4 MiB on large meshes); 0 splits every weight that has an "
        "axis the device count divides.", bounds="[0, inf)")
    remat: bool = option(
        False, "Recompute each encoder block in the backward pass instead of storing its "
        "activations: less memory for a slower step (larger --batch_size fits).")


@dataclasses.dataclass
class ProcessesConfig:
    """Several cooperating processes (docs/distributed.md)."""

    coordinator_address: str = option(
        None, "HOST:PORT of process 0, which every process of a multi-process run (jax) connects "
        "to; a comma-separated list of all processes' addresses is accepted, its first is used. "
        "Default $KERAS_DISTRIBUTION_JOB_ADDRESSES.")
    num_processes: int = option(
        None, "Processes in the run, jax only (default $KERAS_DISTRIBUTION_NUM_PROCESSES, else "
        "1); 0 lets JAX detect them (Cloud TPU pod slice, SLURM, Open MPI). --batch_size stays "
        "the global batch; process 0 alone writes the run folder, which must be on a "
        "filesystem every process reads, for resuming.", bounds="[0, inf)")
    process_id: int = option(
        None, "This process's number, 0 to num_processes - 1 (default "
        "$KERAS_DISTRIBUTION_PROCESS_ID).", bounds="[0, inf)")
    peer_timeout: int = option(
        distribution_lib.DEFAULT_PEER_TIMEOUT, "Seconds without a heartbeat from another "
        "process after which the others stop with an error, and that every process waits for the "
        "others to join at the start (multi-process runs).", bounds="[1, inf)")


@dataclasses.dataclass
class OutputConfig:
    """The run folder and what the run prints."""

    output_dir: str = option("saved_models", "Where run folders are written.")
    run_name: str = option(
        None, "Run folder name, one folder inside --output_dir (default "
        "APP_DATASET_MODEL[_METHOD]_BACKEND, e.g. finetune_digits_ViT-digits_jax); the same name "
        "resumes an unfinished run and leaves a finished one (its metrics.json) as it is. A run "
        "into a folder whose flags.txt records other flags is refused.")
    overwrite: bool = option(
        False, "Start the run over: delete what the run folder holds (a finished run's model and "
        "metrics, an unfinished run's backup) and train afresh; a folder holding anything a run "
        "does not write is refused, nothing deleted. Never written to flags.txt.")
    verbose: int = option(1, "Keras fit verbosity: 0 silent, 1 progress bars, 2 one line per "
                          "epoch.", bounds="[0, 2]")


def _group(config_class):
    return dataclasses.field(default_factory=config_class)


@dataclasses.dataclass
class RunConfig:
    """Everything a training run needs, grouped by concern; `None` means "the recipe's (or the
    dataset's) default".

    Each field declared with `option`, in whichever group, is also the training apps' flag of
    the same name, default and help (`config_flags.define_flags`); `training.resolve_recipe`
    turns the values into a recipe. Build one from flag names with `RunConfig.of(dataset="cifar10",
    epochs=5)` (what the apps' `config_flags.from_flags` does) and change one with
    `config.replace(lora_rank=4)`; `config.flags()` gives `{flag: value}` back.
    """

    data: DataConfig = _group(DataConfig)
    model: ModelConfig = _group(ModelConfig)
    optimization: OptimizationConfig = _group(OptimizationConfig)
    augmentation: AugmentationConfig = _group(AugmentationConfig)
    finetuning: FinetuningConfig = _group(FinetuningConfig)
    compute: ComputeConfig = _group(ComputeConfig)
    processes: ProcessesConfig = _group(ProcessesConfig)
    output: OutputConfig = _group(OutputConfig)
    seed: int = option(0, "Seed of the initialisation, the data order and the splits.",
                       bounds="[0, 4294967295]")  # NumPy's seeds are 32-bit
    flags_text: str = None          # written to flags.txt (the app's --flagfile); not a flag

    @classmethod
    def of(cls, **flags):
        """A `RunConfig` with the options named by their flags set, the others at their
        defaults (`config_flags.build`)."""
        return config_flags.build(cls, **flags)

    def replace(self, **flags):
        """A copy with the options named by their flags replaced (`config_flags.replace`)."""
        return config_flags.replace(self, **flags)

    def flags(self):
        """`{flag name: value}` of every option, in declaration order (`config_flags.flat`)."""
        return config_flags.flat(self)
