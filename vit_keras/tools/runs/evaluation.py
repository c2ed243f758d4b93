"""A trained classifier's predictions on NumPy: its logits over a dataset, top-1/top-5 and
per-class accuracy, and the top-k classes of each image (apps/evaluate.py, apps/predict.py)."""

import warnings

import keras
import numpy as np

from vit_keras.model import ViT


def softmax(logits):
    """Probabilities `(n, classes)` float64 from logits `(n, classes)`."""
    logits = np.asarray(logits, dtype="float64")
    exp = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return exp / exp.sum(axis=-1, keepdims=True)


TOP_K = 5


def reports_top_k(num_classes):
    """Whether top-5 accuracy is reported (evaluate, a run's compiled metrics, its summary): with
    `TOP_K` classes or fewer every label is in the top 5, and 100% would read as a result."""
    return num_classes > TOP_K


def classification_report(logits, labels, class_names):
    """Top-1, top-5 (None unless `reports_top_k`) and per-class accuracy from logits
    `(n, classes)` and int labels `(n,)`."""
    logits, labels = np.asarray(logits), np.asarray(labels)
    ranked = np.argsort(-logits, axis=-1, kind="stable")
    correct = ranked[:, 0] == labels
    top5 = ((ranked[:, :TOP_K] == labels[:, None]).any(axis=-1).mean()
            if reports_top_k(logits.shape[-1]) else None)
    per_class = {}
    for index, name in enumerate(class_names):
        members = labels == index
        per_class[name] = {"accuracy": float(correct[members].mean()) if members.any() else None,
                           "count": int(members.sum())}
    return {"accuracy": float(correct.mean()),
            "top5_accuracy": None if top5 is None else float(top5),
            "count": int(len(labels)), "per_class": per_class}


def headline(report):
    """`accuracy 97.50%, top-5 99.90%` of a `classification_report` (top-5 where it has one)."""
    top5 = report["top5_accuracy"]
    return f"accuracy {100 * report['accuracy']:.2f}%" + (
        "" if top5 is None else f", top-5 {100 * top5:.2f}%")


def evaluate_model(model, dataset):
    """Runs `model` over a `make_pipeline` dataset; returns `(logits float32 (n, classes),
    int labels (n,))` as NumPy."""
    logits, labels = [], []
    for images, one_hot in dataset.as_numpy_iterator():
        logits.append(keras.ops.convert_to_numpy(model(images, training=False)))
        labels.append(one_hot.argmax(-1))
    return np.concatenate(logits).astype("float32"), np.concatenate(labels)


# `--quantize` of apps/predict.py and apps/evaluate.py: Keras' own weight quantization.
QUANTIZATIONS = ("none", "int8")


def quantized_copy(model, mode):
    """A copy of `model` (same config and weights) quantized by `keras.Model.quantize(mode)`, or
    `model` itself for `"none"`. `"int8"`: every Dense and EinsumDense (the encoder's projections
    and the head) keeps int8 kernels with one float scale per output channel, and quantizes its
    input per token as it runs; the patch embedding and LayerNorms stay float."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"Unknown quantization {mode!r}; expected one of {QUANTIZATIONS}.")
    if mode == "none":
        return model
    if isinstance(model, ViT):
        copy = model.rebuilt()
    else:  # a functional model (of an earlier vit_keras, or the user's own)
        copy = keras.Model.from_config(model.get_config())
        copy.set_weights(model.get_weights())
    with warnings.catch_warnings():  # one per layer without weights to quantize: noise
        warnings.filterwarnings("ignore", message=".*does not have a `quantize` method")
        copy.quantize(mode)
    return copy


def top_k_predictions(logits, class_names, k=5):
    """`[[(class name, probability), ...] per image]`, best first, from logits `(n, classes)`."""
    probabilities = softmax(logits)
    k = min(k, probabilities.shape[-1])
    ranked = np.argsort(-probabilities, axis=-1, kind="stable")[:, :k]
    return [[(class_names[i] if i < len(class_names) else str(i), float(p[i])) for i in row]
            for row, p in zip(ranked, probabilities)]
