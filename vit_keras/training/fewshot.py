"""Few-shot linear evaluation of frozen features, the metric behind most of the paper's ablations.

The closed-form probe follows big_vision's `evaluators/fewshot_lsr.py` (the evaluator of the
paper's authors): the `shots` training examples per class are whitened with their own mean and
standard deviation (`std + 1e-5`), a constant bias feature of 100 is appended (large, so the
bias is almost unregularised), and an L2-regularised least-squares regression (`l2_reg`, 2**10
as in big_vision's configs) maps them onto one-hot targets rescaled to {-1, 1}; the predicted class
of a test example is the argmax of its regression outputs. The `shots` examples of each class are
the first of a permutation drawn by `numpy.random.default_rng(seed)` per class, as there.

`logistic_probe` is the alternative: a softmax layer on the same whitened features trained with
Keras (full-batch Adam).

    features = extract_features(model, images)          # (n, features), frozen pre-logits
    results = evaluate(train_x, train_y, test_x, test_y, shots=(1, 5, 10, 25), seeds=3)

The arithmetic is NumPy (float64); only feature extraction and the logistic probe run Keras.
"""

import keras
import numpy as np

from vit_keras import model as model_lib
from vit_keras.model import failed_calls
from vit_keras.training import masked_patch_prediction

BIAS_CONSTANT = 100.0
L2_REG = 2.0 ** 10
SHOTS = (1, 5, 10, 25)
PROBES = ("lsr", "logistic")


def feature_extractor(model):
    """A `keras.Model` on `model.input` giving its frozen pre-logits features `(batch, features)`.

    For a classifier, the input of its `head` (the pooled representation, after `pre_logits` if
    the model has one; for DeiT distilled, the mean of its two heads' inputs, what it gives
    without its top); for a model without a head, its output; for a masked-patch-prediction
    pre-training model, its encoder's pooled output (`masked_patch_prediction.pretrained_encoder`).
    """
    if masked_patch_prediction.is_pretraining_model(model):
        return masked_patch_prediction.pretrained_encoder(model)
    try:
        vit = model_lib.ViT.of(model)
    except ValueError:  # not a ViT: its output, if it is features
        if len(model.output.shape) != 2:
            raise ValueError(
                f"Model {model.name!r} is no vit_keras ViT and its output has shape "
                f"{model.output.shape}, not (batch, features); expected a vit_keras classifier, a "
                f"model built with include_top=False or a pre-training model.") from None
        return model
    if not vit.heads:
        return vit
    # DeiT distilled: the mean of its two heads' inputs (timm's pre-logits).
    inputs = [head.input for head in vit.heads]
    features = inputs[0] if len(inputs) == 1 else keras.layers.Average()(inputs)
    return failed_calls.FailSafeModel(vit.input, features)


def extract_features(model, images, batch_size=256):
    """Frozen pre-logits features of `images` `(n, height, width, channels)` → float32 `(n, d)`."""
    extractor = feature_extractor(model)
    chunks = [np.asarray(extractor.predict_on_batch(images[start:start + batch_size]))
              for start in range(0, len(images), batch_size)]
    return np.concatenate(chunks).astype("float32")


def dataset_features(model, batches):
    """Frozen pre-logits features and int labels of `(images, one-hot labels)` batches (e.g. a
    `vit_keras.tools.data.make_pipeline` dataset's `as_numpy_iterator()`).

    Returns `(features float32 (n, d), labels int (n,))`.
    """
    extractor = feature_extractor(model)
    features, labels = [], []
    for images, one_hot in batches:
        features.append(np.asarray(extractor.predict_on_batch(images), dtype="float32"))
        labels.append(np.asarray(one_hot).argmax(-1))
    return np.concatenate(features), np.concatenate(labels)


def sample_shots(labels, shots, seed, num_classes=None):
    """Indices of `shots` examples per class: the first of a per-class permutation drawn from
    `numpy.random.default_rng(seed)` (big_vision's order), so more shots extend fewer.

    Raises `ValueError` when a class has fewer than `shots` examples.
    """
    labels = np.asarray(labels)
    num_classes = int(labels.max()) + 1 if num_classes is None else num_classes
    rng = np.random.default_rng(seed)
    per_class = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
    short = {c: len(indices) for c, indices in enumerate(per_class) if len(indices) < shots}
    if short:
        raise ValueError(f"{shots} shots per class asked for, but classes {sorted(short)} have "
                         f"only {sorted(set(short.values()))} training examples; use fewer "
                         f"shots.")
    return np.concatenate([indices[:shots] for indices in per_class])


def whiten(train, test):
    """Both arrays standardised with `train`'s mean and `std + 1e-5`, a bias feature of
    `BIAS_CONSTANT` appended: `(n, d)` → `(n, d + 1)` float64."""
    train, test = np.asarray(train, np.float64), np.asarray(test, np.float64)
    mean = train.mean(axis=0, keepdims=True)
    std = train.std(axis=0, keepdims=True) + 1e-5
    return [np.pad((x - mean) / std, ((0, 0), (0, 1)), constant_values=BIAS_CONSTANT)
            for x in (train, test)]


def least_squares_scores(train_features, train_labels, test_features, num_classes,
                         l2_reg=L2_REG):
    """The regression outputs `(n_test, num_classes)` of the L2-regularised least squares fitted
    on whitened `train_features` `(n, d)` against {-1, 1} one-hot `train_labels` `(n,)`.

    Solved through the eigendecomposition of the smaller Gram matrix, as big_vision does:
    `(XᵀX + λI)⁻¹ Xᵀ Y` when n ≥ d + 1, `Xᵀ (XXᵀ + λI)⁻¹ Y` otherwise (the same weights).
    """
    x, x_test = whiten(train_features, test_features)
    y = 2.0 * np.eye(num_classes)[np.asarray(train_labels)] - 1.0
    if len(x) >= x.shape[1]:
        eigs, q = np.linalg.eigh(x.T @ x)
        lhs, rhs = q, q.T @ (x.T @ y)
    else:
        eigs, q = np.linalg.eigh(x @ x.T)
        lhs, rhs = x.T @ q, q.T @ y
    weights = (lhs / (eigs + l2_reg)[None, :]) @ rhs
    return x_test @ weights


def least_squares_accuracy(train_features, train_labels, test_features, test_labels, num_classes,
                           l2_reg=L2_REG):
    """Test accuracy of `least_squares_scores`' argmax."""
    scores = least_squares_scores(train_features, train_labels, test_features, num_classes, l2_reg)
    return float(np.mean(scores.argmax(axis=1) == np.asarray(test_labels)))


def logistic_probe(train_features, train_labels, test_features, test_labels, num_classes,
                   steps=300, learning_rate=0.01, l2_reg=1e-4):
    """Test accuracy of a softmax layer trained with Keras on the whitened features.

    Full-batch Adam for `steps` updates, a zero-initialised kernel (so the result depends only on
    the data, not on a random initialisation) and an L2 penalty `l2_reg` on the kernel. The bias
    feature of `whiten` is left out: the layer has a bias of its own.
    """
    x, x_test = (a[:, :-1].astype("float32") for a in whiten(train_features, test_features))
    y = np.eye(num_classes, dtype="float32")[np.asarray(train_labels)]
    inputs = keras.Input((x.shape[1],))
    outputs = keras.layers.Dense(num_classes, kernel_initializer="zeros",
                                 kernel_regularizer=keras.regularizers.L2(l2_reg))(inputs)
    probe = keras.Model(inputs, outputs)
    probe.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    # One epoch over `steps` copies of the whole set: `steps` full-batch updates without the cost
    # of starting an epoch per update.
    probe.fit(np.tile(x, (steps, 1)), np.tile(y, (steps, 1)), batch_size=len(x), epochs=1,
              shuffle=False, verbose=0)
    predictions = np.asarray(probe.predict_on_batch(x_test)).argmax(axis=1)
    return float(np.mean(predictions == np.asarray(test_labels)))


def evaluate(train_features, train_labels, test_features, test_labels, *, shots=SHOTS, seeds=3,
             num_classes=None, l2_reg=L2_REG, probe="lsr"):
    """Few-shot accuracy for each shot count, over `seeds` draws of the training examples.

    Args:
      train_features: `(n_train, d)`, the pool the shots are drawn from.
      train_labels: `(n_train,)` int class indices.
      test_features: `(n_test, d)`.
      test_labels: `(n_test,)` int class indices.
      shots: examples per class, each count evaluated on its own.
      seeds: draws `0 .. seeds - 1` of the examples (`sample_shots`).
      num_classes: default: one more than the largest label.
      l2_reg: the least-squares regularisation (`probe="lsr"`).
      probe: `"lsr"` (closed-form least squares) or `"logistic"` (`logistic_probe`).

    Returns:
      `{shots: {"accuracies": [one per seed], "mean": ..., "std": ...}}`; `std` is the
      population standard deviation over seeds.
    """
    if probe not in PROBES:
        raise ValueError(f"Unknown probe {probe!r}; expected one of {PROBES}.")
    train_labels, test_labels = np.asarray(train_labels), np.asarray(test_labels)
    if num_classes is None:
        num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    results = {}
    for count in shots:
        accuracies = []
        for seed in range(seeds):
            chosen = sample_shots(train_labels, count, seed, num_classes)
            args = (np.asarray(train_features)[chosen], train_labels[chosen], test_features,
                    test_labels, num_classes)
            accuracies.append(least_squares_accuracy(*args, l2_reg=l2_reg) if probe == "lsr"
                              else logistic_probe(*args))
        results[int(count)] = {"accuracies": accuracies, "mean": float(np.mean(accuracies)),
                               "std": float(np.std(accuracies))}
    return results


def results_table(results):
    """`evaluate`'s results as a markdown table: shots, mean ± sd over seeds, each seed's."""
    lines = ["| shots per class | accuracy (mean ± sd over seeds) | per seed |", "|---|---|---|"]
    for count, row in results.items():
        lines.append(f"| {count} | {100 * row['mean']:.2f}% ± {100 * row['std']:.2f} | "
                     f"{', '.join(f'{100 * a:.1f}' for a in row['accuracies'])} |")
    return "\n".join(lines)
