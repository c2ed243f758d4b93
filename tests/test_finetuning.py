"""LoRA, the linear probe and rematerialisation (`vit_keras.tools.finetuning`), and the run's
checks of their flags."""

import contextlib
import errno
import json
import os

import keras
import numpy as np
import pytest

from vit_keras import errors
from vit_keras.tools import finetuning
from vit_keras.tools.runs import objectives, run_parts
from vit_keras.tools.runs.training import RunConfig

from conftest import (
    NEXT_BACKEND,
    TINY_CONFIG,
    randomize_weights,
    run_app,
    run_on_backend,
    tiny_data,
    tiny_model,
)

RANK = 2


def _trained(model, steps=3, learning_rate=0.05):
    """`model` after a few SGD steps on random data (every trainable weight moves)."""
    x, y = tiny_data(n=16, size=model.input_shape[1])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate),
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=steps // 2 + 1, verbose=0)
    return model


def _run_model(vit, config, log=lambda _: None):
    """The ViT a run of `config` trains, from `vit` (its parts' `adapt_model`)."""
    for part in run_parts.choose(config):
        vit = part.adapt_model(vit, log)
    return vit


def _values(model):
    return {weight.path: keras.ops.convert_to_numpy(weight).copy() for weight in model.weights}


def _random_adapters(model, seed=0):
    """`model` with random LoRA `B` (a trained one's may still be tiny), for exact checks."""
    rng = np.random.default_rng(seed)
    for layer in finetuning.lora_targets(model):
        layer.lora_kernel_b.assign(rng.normal(0, 0.1, layer.lora_kernel_b.shape))
    return model


@pytest.fixture
def lora_run(tiny_config):
    """A randomised tiny ViT, its weights, and a LoRA-enabled copy trained a few steps."""
    base = randomize_weights(tiny_model(tiny_config))
    before = _values(base)
    model = type(base).from_config(base.get_config())
    model.set_weights(base.get_weights())
    finetuning.enable_lora(model, RANK)
    return base, before, _trained(model)


def test_lora_training_changes_only_adapters_and_head(lora_run):
    _, before, model = lora_run
    after = _values(model)
    changed = {path for path in before if not np.array_equal(before[path], after[path])}
    assert changed and all(path.startswith("head/") for path in changed), sorted(changed)
    adapters = [path for path in after if "lora_kernel_b" in path]
    # B starts at zero; every adapter has learnt something.
    assert adapters and all(np.any(after[path] != 0) for path in adapters)


def test_lora_trains_only_adapters_head_and_optionally_layer_norms(tiny_config):
    model = finetuning.enable_lora(tiny_model(tiny_config), RANK, train_norms=True)
    names = {weight.path.split("/")[-1] for weight in model.trainable_weights}
    assert names == {"lora_kernel_a", "lora_kernel_b", "kernel", "bias", "gamma", "beta"}
    kernels = [w.path for w in model.trainable_weights if w.path.endswith(("/kernel", "/bias"))]
    assert kernels == ["head/kernel", "head/bias"]


def test_merged_projections_differ_from_the_base_by_rank_at_most_r(lora_run):
    base, before, model = lora_run
    _random_adapters(model)
    merged = _values(finetuning.merge_lora(model))
    for layer in finetuning.lora_targets(model):
        path = next(w.path for w in layer.weights if w.name == "kernel")
        difference = (merged[path] - before[path]).astype("float64")
        assert np.any(difference != 0), path
        if layer.name in ("query", "key", "value"):
            # (hidden, heads, head_dim): the hidden -> hidden map, all heads together (Keras'
            # own LoRA would give each head an update of rank R: heads * R in all).
            matrices = [difference.reshape(difference.shape[0], -1)]
        else:  # out (heads, head_dim, hidden) and the MLP: the kernel as inputs x outputs
            matrices = [difference.reshape(-1, difference.shape[-1])]
        # The merged kernel is float32: the sum's rounding adds noise of about eps32 * |kernel|
        # per entry, full-rank; singular values below a generous bound of it are that noise.
        noise = np.finfo(np.float32).eps * np.abs(before[path]).max() * max(difference.shape)
        ranks = [np.linalg.matrix_rank(matrix, tol=4 * noise) for matrix in matrices]
        assert max(ranks) <= RANK, (path, ranks)
        assert max(np.linalg.svd(matrix, compute_uv=False)[0] for matrix in matrices) > 100 * noise


def test_a_lora_models_weights_file_keeps_its_adapters(lora_run, tmp_path):
    """The run's backup is a weights file: read into the LoRA model rebuilt from the flags, it
    gives back the frozen kernels and the adapters as they were (Keras' own saving writes merged
    kernels and zeroes A and B on reading, where LoRA's gradients are zero)."""
    _, _, model = lora_run
    _random_adapters(model)
    path = str(tmp_path / "backup.weights.h5")
    model.save_weights(path)
    rebuilt = finetuning.enable_lora(type(model).from_config(model.get_config()), RANK)
    rebuilt.load_weights(path)
    for saved, restored in zip(model.weights, rebuilt.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(restored),
                                      keras.ops.convert_to_numpy(saved), err_msg=saved.path)
    assert any("lora_kernel_a" in weight.path for weight in rebuilt.weights)


def test_merged_kernels_equal_base_plus_the_scaled_low_rank_product(lora_run):
    _, before, model = lora_run
    _random_adapters(model)
    merged = _values(finetuning.merge_lora(model))
    for layer in finetuning.lora_targets(model):
        path = next(w.path for w in layer.weights if w.name == "kernel")
        a = keras.ops.convert_to_numpy(layer.lora_kernel_a).astype("float64")
        b = keras.ops.convert_to_numpy(layer.lora_kernel_b).astype("float64")
        expected = before[path] + (layer.lora_alpha / layer.lora_rank) * np.tensordot(a, b, 1)
        # One float32 rounding of the sum: relative 1e-6 of the kernel's values.
        np.testing.assert_allclose(merged[path], expected, rtol=1e-6, atol=1e-7)


def test_merged_model_is_plain_and_computes_what_the_lora_model_does(lora_run):
    model = _random_adapters(lora_run[2])
    merged = finetuning.merge_lora(model)
    assert not any(layer.lora_enabled for layer in finetuning.lora_targets(merged))
    x, _ = tiny_data(n=4)
    np.testing.assert_allclose(merged.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-4, atol=1e-5)


def test_adapters_applied_to_the_base_give_the_merged_model(lora_run, tmp_path):
    base, before, model = lora_run
    path = finetuning.save_adapters(model, str(tmp_path / "adapters.npz"))
    rebuilt = finetuning.apply_adapters(base, path)
    assert rebuilt is not base  # the guide's promise: a new model, the base left as it was
    unchanged = _values(base)
    assert all(np.array_equal(unchanged[key], before[key]) for key in before)
    expected, found = _values(finetuning.merge_lora(model)), _values(rebuilt)
    assert expected.keys() == found.keys()
    for key in expected:
        np.testing.assert_array_equal(found[key], expected[key])
    stored = np.load(path)
    assert sum(stored[k].size for k in stored.files if not k.startswith("__")) == \
        finetuning.trainable_parameters(model)


def test_adapters_that_fill_the_disk_leave_the_file_they_replace(lora_run, tmp_path, monkeypatch):
    _, _, model = lora_run
    path = finetuning.save_adapters(model, str(tmp_path / "adapters.npz"))
    with open(path, "rb") as f:
        before = f.read()

    def fills_the_disk(file, **arrays):
        with contextlib.ExitStack() as stack:
            if isinstance(file, str):
                file = stack.enter_context(open(file, "wb"))
            file.write(before[:100])  # part of a file, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(finetuning.np, "savez", fills_the_disk)
    with pytest.raises(OSError, match="No space left"):
        finetuning.save_adapters(model, path)
    with open(path, "rb") as f:
        assert f.read() == before
    assert os.listdir(tmp_path) == ["adapters.npz"]  # no temporary file left


def test_adapters_refuse_a_base_of_another_shape(lora_run, tmp_path, tiny_config):
    _, _, model = lora_run
    path = finetuning.save_adapters(model, str(tmp_path / "adapters.npz"))
    with pytest.raises(finetuning.AdaptersError, match="number of classes"):
        finetuning.apply_adapters(tiny_model(tiny_config, num_classes=5), path)


# A hostile or damaged adapters.npz: each is refused with one AdaptersError line, before any
# weight is applied. Each case edits the arrays of a whole file the run wrote.
def _set(key, value):
    def edit(arrays):
        arrays[key] = value
    return edit


def _first_adapter(arrays):
    return next(key for key in arrays if key.endswith("lora_kernel_b"))


def _nan_adapter(arrays):
    key = _first_adapter(arrays)
    arrays[key] = np.full_like(arrays[key], np.nan)


def _keep_only_rank_and_alpha(arrays):
    for key in [key for key in arrays if not key.startswith("__")]:
        del arrays[key]


def _drop_half(arrays):
    for key in [key for key in arrays if not key.startswith("__")][::2]:
        del arrays[key]


def _strings_for_an_adapter(arrays):
    key = _first_adapter(arrays)
    arrays[key] = np.full(arrays[key].shape, "x")


HOSTILE_ADAPTERS = {
    "nan_adapter": (_nan_adapter, "NaN or infinite"),
    "nan_alpha": (_set("__lora_alpha__", np.asarray(np.nan)), "alpha nan is not a finite"),
    "inf_alpha": (_set("__lora_alpha__", np.asarray(np.inf)), "alpha inf is not a finite"),
    "only_rank_and_alpha": (_keep_only_rank_and_alpha, "is incomplete"),
    "half_the_file": (_drop_half, "is incomplete"),
    "no_alpha": (lambda arrays: arrays.pop("__lora_alpha__"), "no __lora_alpha__ in it"),
    "rank_not_one_number": (_set("__lora_rank__", np.asarray([2, 2])), "not one whole number"),
    "rank_zero": (_set("__lora_rank__", np.asarray(0)), "rank 0 is not a positive rank"),
    # The arrays are of rank 2: refused from their headers, before LoRA of rank 10^9 (256 GB of
    # adapters for this tiny model) is allocated.
    "rank_of_a_billion": (_set("__lora_rank__", np.asarray(10 ** 9)), "at the file's LoRA rank"),
    "strings_for_an_adapter": (_strings_for_an_adapter, "not floating point"),
}


@pytest.fixture(scope="module")
def adapters_file(tmp_path_factory):
    """A randomised tiny ViT, its weights, and the adapters.npz of a LoRA copy of it (random
    adapters and head: no training needed to be refused)."""
    base = randomize_weights(tiny_model(dict(TINY_CONFIG)))
    model = type(base).from_config(base.get_config())
    model.set_weights(base.get_weights())
    _random_adapters(finetuning.enable_lora(model, RANK))
    path = str(tmp_path_factory.mktemp("adapters") / "adapters.npz")
    return base, _values(base), finetuning.save_adapters(model, path)


@pytest.mark.parametrize("case", list(HOSTILE_ADAPTERS))
def test_a_hostile_adapters_file_is_refused_in_one_line(adapters_file, tmp_path, case):
    base, before, saved = adapters_file
    with np.load(saved) as stored:
        arrays = dict(stored)
    path = str(tmp_path / "adapters.npz")
    edit, message = HOSTILE_ADAPTERS[case]
    edit(arrays)
    np.savez(path, **arrays)
    with pytest.raises(errors.AdaptersError, match=message) as raised:
        finetuning.apply_adapters(base, path)
    assert "\n" not in str(raised.value) and "adapters.npz" in str(raised.value)
    assert isinstance(raised.value, errors.UserError)
    assert _values(base).keys() == before.keys()  # the base model is left as it was
    for key, value in _values(base).items():
        np.testing.assert_array_equal(value, before[key])


@pytest.mark.parametrize("content", [None, b"not an archive", b"PK\x03\x04 truncated"])
def test_a_missing_or_unreadable_adapters_file_is_refused_in_one_line(adapters_file, tmp_path,
                                                                      content):
    path = tmp_path / "adapters.npz"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(errors.AdaptersError) as raised:
        finetuning.apply_adapters(adapters_file[0], str(path))
    assert "\n" not in str(raised.value) and "adapters.npz" in str(raised.value)


def test_per_epoch_checkpoint_of_a_lora_run_is_the_merged_plain_model(lora_run, tmp_path):
    model = _random_adapters(lora_run[2])
    checkpoint = run_parts.MergedModelCheckpoint(str(tmp_path / "model.keras"))
    checkpoint.set_model(model)
    checkpoint.on_epoch_end(0)
    saved = keras.saving.load_model(str(tmp_path / "model.keras"))
    assert not any(layer.lora_enabled for layer in finetuning.lora_targets(saved))
    x, _ = tiny_data(n=4)
    np.testing.assert_allclose(saved.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-4, atol=1e-5)


SAVED_MERGED = """
import keras, numpy as np
import vit_keras
model = keras.saving.load_model(ARGS["path"])
assert not any(getattr(l, "lora_enabled", False) for l in model._flatten_layers())
x = np.random.default_rng(0).uniform(0, 255, (2, 8, 8, 3)).astype("float32")
print(json.dumps(np.asarray(model.predict(x, verbose=0)).tolist()))
"""


@pytest.mark.slow
def test_merged_model_saved_here_loads_on_the_next_backend(lora_run, tmp_path):
    _, _, model = lora_run
    path = str(tmp_path / "model.keras")
    finetuning.merge_lora(model).save(path)
    x = np.random.default_rng(0).uniform(0, 255, (2, 8, 8, 3)).astype("float32")
    expected = model.predict(x, verbose=0)
    found = run_on_backend(NEXT_BACKEND, SAVED_MERGED, path=path)
    np.testing.assert_allclose(found, expected, rtol=1e-4, atol=1e-5)


def test_linear_probe_leaves_every_encoder_weight_unchanged(tiny_config):
    model = randomize_weights(tiny_model(tiny_config))
    probe = finetuning.linear_probe_model(model)
    before = _values(probe)
    after = _values(_trained(probe))
    changed = sorted(path for path in before if not np.array_equal(before[path], after[path]))
    assert changed == ["head/bias", "head/kernel"]


def test_linear_probe_encoder_computes_as_at_inference(tiny_config):
    from vit_keras import build_model

    model = randomize_weights(build_model(tiny_config, image_size=8, num_classes=3, dropout=0.5,
                                          drop_path_rate=0.5))
    probe = finetuning.linear_probe_model(model)
    x, _ = tiny_data(n=4)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(probe(x, training=True)),
                               keras.ops.convert_to_numpy(model(x, training=False)),
                               rtol=1e-5, atol=1e-6)
    assert finetuning.trainable_parameters(probe) == 32 * 3 + 3


@pytest.fixture(scope="module")
def distilled_deit(tmp_path_factory):
    """A DeiT distilled timm checkpoint of 7 classes (random, every parameter non-zero) at 32 px:
    `build_model_from_checkpoint` of it with 3 classes gives two new zero-initialised heads that
    the model averages, as fine-tuning a published DeiT on a new dataset does."""
    torch = pytest.importorskip("torch")
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    deit = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=32,
                             patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=7)
    with torch.no_grad():
        for parameter in deit.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    path = str(tmp_path_factory.mktemp("deit") / "deit_distilled.pth")
    torch.save(deit.state_dict(), path)
    return path


def _distilled_run_model(path, **flags):
    from vit_keras import build_model_from_checkpoint

    vit = build_model_from_checkpoint(path, num_classes=3, num_heads=2,
                                      timm_architecture="deit_tiny_distilled_patch16_224")
    assert [layer.name for layer in vit.layers][-3:] == ["head", "head_dist", "distilled_average"]
    return _run_model(vit, RunConfig.of(weights=path, **flags))


@pytest.mark.slow
@pytest.mark.parametrize("flags", [{"linear_probe": True}, {"lora_rank": RANK}],
                         ids=["linear_probe", "lora"])
def test_fine_tuning_a_distilled_deit_trains_both_of_its_heads(distilled_deit, flags):
    """The model averages `head` and `head_dist`: a new head_dist left frozen at zero would halve
    every logit of the saved model for good."""
    model = _distilled_run_model(distilled_deit, **flags)
    trained = {weight.path for weight in model.trainable_weights}
    assert {"head/kernel", "head_dist/kernel"} <= trained
    before = _values(model)
    after = _values(_trained(model))
    for head in ("head", "head_dist"):
        assert np.any(after[f"{head}/kernel"] != 0), head  # both learnt from their zero start
        assert not np.array_equal(after[f"{head}/bias"], before[f"{head}/bias"]), head


@pytest.mark.slow
def test_adapters_of_a_distilled_deit_carry_both_heads(distilled_deit, tmp_path):
    model = _trained(_distilled_run_model(distilled_deit, lora_rank=RANK))
    path = finetuning.save_adapters(model, str(tmp_path / "adapters.npz"))
    with np.load(path) as stored:
        assert {"head/kernel", "head_dist/kernel"} <= set(stored.files)
    from vit_keras import build_model_from_checkpoint

    base = build_model_from_checkpoint(distilled_deit, num_classes=3, num_heads=2,
                                       timm_architecture="deit_tiny_distilled_patch16_224")
    x, _ = tiny_data(n=4, size=32)
    np.testing.assert_allclose(finetuning.apply_adapters(base, path).predict(x, verbose=0),
                               model.predict(x, verbose=0), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("flags", [{"linear_probe": True}, {"lora_rank": RANK}],
                         ids=["linear_probe", "lora"])
def test_lora_or_a_linear_probe_of_a_random_encoder_warns(tiny_config, flags):
    lines = []
    _run_model(tiny_model(tiny_config), RunConfig.of(**flags), log=lines.append)
    warnings = [line for line in lines if line.startswith("Warning:")]
    assert len(warnings) == 1 and "without --weights" in warnings[0], lines
    assert "randomly initialised" in warnings[0]
    lines.clear()
    _run_model(tiny_model(tiny_config), RunConfig.of(
        weights="pretrained.npz", **flags), log=lines.append)
    assert not [line for line in lines if line.startswith("Warning:")], lines


def test_a_lora_rank_whose_adapters_outnumber_the_kernels_they_adapt_warns(tiny_config):
    # The tiny ViT's adapted kernels hold 16,384 weights; each rank adds 896 adapter weights, so
    # from rank 19 up LoRA trains more than full fine-tuning of them would. Rank 32 trains 28,672,
    # more than the whole model's 19,011.
    def warnings(rank):
        lines = []
        _run_model(tiny_model(tiny_config), RunConfig.of(
            weights="pretrained.npz", lora_rank=rank), log=lines.append)
        return [line for line in lines if line.startswith("Warning:")]

    (warning,) = warnings(32)
    assert "rank 32 trains 28,672 adapter weights" in warning
    assert "16,384 weights of the kernels they adapt" in warning and "19,011" in warning
    assert "a rank below 19" in warning
    assert not warnings(18)


def _loss_and_gradients(model, x, y):
    """The loss and the gradients of the trainable weights, by the backend's own autodiff."""
    loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        trainable = [v.value for v in model.trainable_variables]
        others = [v.value for v in model.non_trainable_variables]

        def compute(trainable):
            logits, _ = model.stateless_call(trainable, others, x, training=True)
            return loss_fn(y, logits)

        loss, grads = jax.jit(jax.value_and_grad(compute))(trainable)
    elif backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
    else:
        model.zero_grad()
        loss = loss_fn(y, model(x, training=True))
        loss.backward()
        grads = [v.value.grad for v in model.trainable_variables]
    return (float(keras.ops.convert_to_numpy(loss)),
            [keras.ops.convert_to_numpy(g) for g in grads])


def test_remat_gives_the_same_loss_and_gradients(tiny_config):
    model = randomize_weights(tiny_model(tiny_config))
    remat = type(model).from_config(model.get_config())
    remat.set_weights(model.get_weights())
    finetuning.rematerialize(remat)
    assert [getattr(b, "rematerialized", False) for b in remat.blocks] == [True] * 2
    x, y = tiny_data(n=4)
    loss, grads = _loss_and_gradients(model, x, y)
    remat_loss, remat_grads = _loss_and_gradients(remat, x, y)
    # The same arithmetic, recomputed: equal up to float32 rounding of a reordered graph.
    assert remat_loss == pytest.approx(loss, rel=1e-6)
    assert len(grads) == len(remat_grads) == len(model.trainable_variables)
    for grad, remat_grad in zip(grads, remat_grads):
        np.testing.assert_allclose(remat_grad, grad, rtol=1e-5, atol=1e-6)


def test_remat_and_lora_train_together_with_dropout_and_drop_path(tiny_config):
    from vit_keras import build_model

    # Random draws inside a recomputed block: their generator's state leaves the remat.
    model = build_model(tiny_config, image_size=8, num_classes=3, dropout=0.1,
                        drop_path_rate=0.1)
    model = finetuning.enable_lora(finetuning.rematerialize(model), RANK)
    before = _values(model)
    after = _values(_trained(model))
    assert any(not np.array_equal(before[p], after[p]) for p in before if "lora_kernel_b" in p)


def test_run_model_of_linear_probe_with_remat_is_both(tiny_config):
    config = RunConfig.of(linear_probe=True, remat=True)
    model = _run_model(tiny_model(tiny_config), config)
    assert all(getattr(b, "rematerialized", False) for b in model.blocks)
    assert [w.path for w in model.trainable_weights] == ["head/kernel", "head/bias"]


@pytest.mark.parametrize("flags, message", [
    ({"linear_probe": True, "lora_rank": 4}, "choose one"),
    ({"lora_alpha": 8.0}, "needs --lora_rank"),
    ({"lora_rank": -1}, "positive rank"),
    ({"lora_rank": 4, "lora_alpha": 0.0}, "must be positive"),
    ({"lora_train_norms": True}, "needs --lora_rank"),
    ({"linear_probe": True, "drop_path_rate": 0.1}, "drop --drop_path_rate"),
])
def test_nonsense_flag_combinations_are_refused_in_one_line(flags, message):
    with pytest.raises(finetuning.FinetuningOptionError, match=message) as raised:
        finetuning.check_options(RunConfig.of(**flags))
    assert "\n" not in str(raised.value)


def test_lora_and_linear_probe_are_refused_for_masked_patch_prediction():
    objective = objectives.MaskedPatchPrediction()
    for flags in ({"lora_rank": 4}, {"linear_probe": True}):
        with pytest.raises(finetuning.FinetuningOptionError, match="MaskedPatchPrediction"):
            finetuning.check_options(RunConfig.of(**flags), objective)
    finetuning.check_options(RunConfig.of(remat=True), objective)


@pytest.mark.slow
# The run folder's resume, flags.txt and rerun checks are the same on every backend, and a LoRA
# model's weights and adapters round trip on each backend in the tests above (not slow): one pass.
@pytest.mark.backend_independent("torch")
def test_lora_run_resumes_saves_a_plain_model_and_adapters_and_reruns_complete(tmp_path):
    """apps/finetune.py --lora_rank 4 on the digits, killed once its training ended: the same
    command resumes it (the backup of the LoRA model loads into the LoRA model rebuilt from the
    flags), flags.txt records the LoRA flags, its flagfile finds the run complete; model.keras
    is plain and evaluates with apps/evaluate.py --quantize int8."""
    args = ["--image_size", "8", "--batch_size", "16", "--steps_per_epoch", "3", "--verbose", "2",
            "--epochs", "2", "--lora_rank", "4", "--lora_alpha", "8", "--output_dir",
            str(tmp_path), "--run_name", "lora"]
    killed = run_app("finetune.py", *args, kill_after_training=tmp_path / "lora")
    assert killed.returncode == -9, killed.stderr[-3000:]
    first = run_app("finetune.py", *args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "Resuming" in first.stdout + first.stderr
    run_dir = tmp_path / "lora"
    flags_text = (run_dir / "flags.txt").read_text()
    assert "--lora_rank=4" in flags_text and "--lora_alpha=8.0" in flags_text
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["config"]["run"]["lora_rank"] == 4
    assert 0 < metrics["trainable_parameters"] < metrics["config"]["num_parameters"]
    assert f"({metrics['trainable_parameters']:,} trained)" in first.stdout + first.stderr
    stored = np.load(run_dir / "adapters.npz")
    assert int(stored["__lora_rank__"]) == 4
    # The resumed run restored its adapters from the backup: what it trained is in them.
    assert all(np.any(stored[key] != 0) for key in stored if "lora_kernel" in key)
    again = run_app("finetune.py", "--flagfile", str(run_dir / "flags.txt"))
    assert again.returncode == 0 and "is complete" in again.stdout + again.stderr
    check = run_on_backend(keras.backend.backend(), """
        import keras, vit_keras
        model = keras.saving.load_model(ARGS["path"])
        print(json.dumps([getattr(l, "lora_enabled", False) for l in model._flatten_layers()]))
        """, path=str(run_dir / "model.keras"))
    assert not any(check)
    evaluated = run_app("evaluate.py", "--model", str(run_dir / "model.keras"), "--quantize",
                        "int8", "--json", str(tmp_path / "eval.json"))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["quantized"]["mode"] == "int8" and 0 <= report["quantized"]["accuracy"] <= 1
