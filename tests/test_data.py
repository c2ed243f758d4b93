"""vit_keras.tools.data: the digits split, image folders with bad files, tfds (offline), pipelines."""

import os
import time

import numpy as np
from PIL import Image
import pytest

from vit_keras.tools import data


def test_digits_split_is_fixed_stratified_and_disjoint():
    first, second = data.digits_arrays(), data.digits_arrays()
    sizes = {split: len(first[split][1]) for split in data.SPLITS}
    all_labels = np.concatenate([first[split][1] for split in data.SPLITS])
    assert sizes == {"train": 1257, "val": 180, "test": 360}  # 1,797 real digits, 70/10/20
    for split in data.SPLITS:
        np.testing.assert_array_equal(first[split][0], second[split][0])
        # Stratified: each class's share of the split is its share of all digits, +- 2 images.
        counts = np.bincount(first[split][1], minlength=10)
        expected = np.bincount(all_labels, minlength=10) * sizes[split] / len(all_labels)
        assert np.abs(counts - expected).max() <= 2
    images = first["train"][0]
    assert images.dtype == np.uint8 and images.shape[1:] == (8, 8, 3) and images.max() == 255
    flat = {split: {row.tobytes() for row in first[split][0]} for split in data.SPLITS}
    assert not (flat["train"] & flat["test"])  # (real duplicates in digits would show up here)


def test_pipeline_gives_pixels_in_0_255_and_one_hot_labels():
    splits = data.load_splits("digits", log=lambda _: None)
    train = data.make_pipeline(splits, "train", image_size=16, batch_size=8, training=True)
    images, labels = next(iter(train))
    assert images.shape == (8, 16, 16, 3) and labels.shape == (8, 10)
    assert float(images.numpy().min()) >= 0 and 128 < float(images.numpy().max()) <= 255
    np.testing.assert_array_equal(labels.numpy().sum(-1), np.ones(8))
    test = data.make_pipeline(splits, "test", image_size=16, batch_size=100)
    assert sum(int(x.shape[0]) for x, _ in test) == 360  # evaluation keeps every example once


def test_evaluation_resize_matches_bilinear_upsampling_and_is_deterministic():
    splits = data.load_splits("digits", log=lambda _: None)
    a = next(iter(data.make_pipeline(splits, "val", image_size=16, batch_size=4)))[0].numpy()
    b = next(iter(data.make_pipeline(splits, "val", image_size=16, batch_size=4)))[0].numpy()
    np.testing.assert_array_equal(a, b)
    raw = data.digits_arrays()["val"][0][:4].astype("float32")
    np.testing.assert_allclose(a[:, ::2, ::2].mean(), raw.mean(), rtol=0.1)


def test_inception_crop_respects_the_area_range_and_is_a_function_of_its_seed():
    image = np.zeros((64, 64, 3), np.uint8)
    image[:32] = 255  # top half white: a crop's mean shows where it came from
    means = [float(data.inception_crop(image, 8, seed=[0, i], area_range=(0.05, 0.1)).numpy().mean())
             for i in range(30)]
    assert all(0 <= m <= 255 for m in means)
    # Small crops (<= 10% of the area) mostly fall wholly inside one half: 18 of these 30 seeds'
    # crops do (deterministic: stateless draws).
    assert sum(m in (0.0, 255.0) for m in means) >= 10
    again = [float(data.inception_crop(image, 8, seed=[0, i], area_range=(0.05, 0.1)).numpy().mean())
             for i in range(30)]
    assert again == means
    full = data.inception_crop(image, 64, seed=[0, 0], area_range=(1.0, 1.0),
                               aspect_ratio_range=(1.0, 1.0))
    np.testing.assert_allclose(full.numpy(), image.astype("float32"), atol=1e-3)


def _batches(splits, count, start_batch=0, seed=0):
    pipeline = data.make_pipeline(
        splits, "train", image_size=8, batch_size=100, training=True, seed=seed,
        start_batch=start_batch, augmentation=data.Augmentation(crop_area=(0.5, 1.0), flip=True))
    return [(x.numpy(), y.numpy().argmax(-1)) for x, y in pipeline.take(count)]


def test_training_stream_is_a_function_of_seed_and_example_index():
    """What exact resumption needs: the same batches whatever TensorFlow's global seed and thread
    timing (crops and flips in a parallel map), and `start_batch` continues the stream."""
    import tensorflow as tf

    splits = data.load_splits("digits", log=lambda _: None)
    stream = _batches(splits, 15)  # 1,500 examples: pass 0 (1,257) and the start of pass 1
    tf.random.set_seed(123)
    for (x, y), (x2, y2) in zip(stream, _batches(splits, 15)):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
    for (x, y), (x2, y2) in zip(stream[11:], _batches(splits, 4, start_batch=11)):  # across passes
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
    labels = np.concatenate([y for _, y in stream])
    train_labels = data.digits_arrays()["train"][1]
    # Each pass is a permutation of the split, each in another order.
    np.testing.assert_array_equal(np.bincount(labels[:1257]), np.bincount(train_labels))
    assert not np.array_equal(labels[:243], labels[1257:1500])
    assert not np.array_equal(stream[0][0], _batches(splits, 1, seed=1)[0][0])
    with pytest.raises(ValueError, match="start_batch=3 is for training streams"):
        data.make_pipeline(splits, "val", image_size=8, batch_size=4, start_batch=3)


def test_mixup_and_cutmix_give_soft_labels_that_sum_to_one():
    splits = data.load_splits("digits", log=lambda _: None)
    augmentation = data.Augmentation(crop_area=(0.8, 1.0), flip=False, randaugment=(2, 0.5),
                                     mixup=0.8, cutmix=1.0)
    images, labels = next(iter(data.make_pipeline(
        splits, "train", image_size=16, batch_size=16, training=True, augmentation=augmentation)))
    labels = labels.numpy()
    np.testing.assert_allclose(labels.sum(-1), np.ones(16), atol=1e-5)
    # Some labels are mixed: all 16 stay one-hot only if each image is paired with one of its own
    # class by both MixUp and CutMix (random layers, so no fixed draw: a chance below 1e-10).
    assert (labels.max(-1) < 1).any()
    assert images.shape == (16, 16, 16, 3) and float(images.numpy().max()) <= 255


def test_mixup_of_white_images_stays_within_255(tmp_path):
    """MixUp's weighted mean of two 255s rounds to 255.00002 for some weights: the pipeline clips."""
    for name in ("cat", "dog"):
        os.makedirs(tmp_path / name)
        for index in range(16):
            Image.new("RGB", (8, 8), "white").save(tmp_path / name / f"{index}.png")
    splits = data.load_splits(f"folder:{tmp_path}", val_fraction=0.25, log=lambda _: None)
    pipeline = data.make_pipeline(splits, "train", image_size=8, batch_size=24, training=True,
                                  augmentation=data.Augmentation(flip=False, mixup=0.8))
    for images, _ in pipeline.take(4):
        pixels = images.numpy()
        assert pixels.max() <= 255.0  # an unclipped batch holds 255.00002s
        np.testing.assert_allclose(pixels, 255.0, rtol=1e-6)


def _write_folder(root, classes=("cat", "dog"), per_class=4, size=12):
    rng = np.random.default_rng(0)
    for name in classes:
        os.makedirs(os.path.join(root, name), exist_ok=True)
        for index in range(per_class):
            pixels = rng.integers(0, 255, (size, size + index, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(root, name, f"{index}.png"))


def _write_unreadable_files(root):
    """Beside `_write_folder`'s PNGs: two JPEGs per class, and five files no pipeline can use.

    Returns `{path: what the decoder (or the listing) says about it}` for the five."""
    rng = np.random.default_rng(1)
    for name in ("cat", "dog"):
        for index in range(2):
            pixels = rng.integers(0, 255, (10, 14, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(root, name, f"photo{index}.jpg"), quality=95)
    pixels = rng.integers(0, 255, (10, 10, 3), dtype=np.uint8)
    bad = {os.path.join(root, "cat", "scan.tif"): "not an image file name",
           os.path.join(root, "dog", "scan.jpg"): "Unknown image file format",  # a TIFF inside
           os.path.join(root, "cat", "empty.jpg"): "Input is empty",
           os.path.join(root, "dog", "notes.png"): "Unknown image file format",
           os.path.join(root, "cat", "cut.jpg"): "Invalid JPEG data"}
    Image.fromarray(pixels).save(os.path.join(root, "cat", "scan.tif"))
    Image.fromarray(pixels).save(os.path.join(root, "dog", "scan.jpg"), format="TIFF")
    open(os.path.join(root, "cat", "empty.jpg"), "wb").close()
    with open(os.path.join(root, "dog", "notes.png"), "w") as f:
        f.write("not an image")
    with open(os.path.join(root, "cat", "photo0.jpg"), "rb") as f:
        whole = f.read()
    with open(os.path.join(root, "cat", "cut.jpg"), "wb") as f:
        f.write(whole[:len(whole) // 2])  # a valid header, then the data stops
    return bad


def test_image_folder_is_listed_without_reading_a_file(tmp_path, monkeypatch):
    """Loading a folder lists it: the files are opened only where a pipeline reads them."""
    _write_folder(str(tmp_path))
    bad = _write_unreadable_files(str(tmp_path))

    def no_reading(*args, **kwargs):
        raise AssertionError("a file was decoded while the folder was listed")

    monkeypatch.setattr(data, "decode_image_file", no_reading)
    monkeypatch.setattr(Image, "open", no_reading)
    splits = data.load_splits(f"folder:{tmp_path}", val_fraction=0.25, log=lambda _: None)
    # 8 PNGs, 4 JPEGs and the 4 unreadable files with image names: all listed, none read yet.
    assert splits.num_examples["train"] + splits.num_examples["val"] == 16
    # Only a file name can be refused before reading: the TIFF named .tif.
    assert [path for path, _ in splits.skipped_files] == [str(tmp_path / "cat" / "scan.tif")]
    assert all(path in bad for path, _ in splits.skipped_files)


def test_image_folder_skips_unreadable_files_where_they_are_read_and_names_them(tmp_path):
    """A TIFF (named .tif, and inside a .jpg), an empty .jpg, a text .png and a truncated JPEG:
    the pipelines read past them, give every readable image in order, and name each bad one
    with the decoder's reason, as they meet it."""
    _write_folder(str(tmp_path))
    bad = _write_unreadable_files(str(tmp_path))
    logged = []
    splits = data.load_splits(f"folder:{tmp_path}", val_fraction=0.25, log=logged.append)
    listed = {split: [path.decode() for path, _ in splits.encoded_source(split).as_numpy_iterator()]
              for split in ("train", "val")}
    readable = {split: [path for path in listed[split] if path not in bad] for split in listed}
    assert len(readable["train"]) + len(readable["val"]) == 12
    for split in ("train", "val"):
        images = [image for image, _ in splits.source(split).as_numpy_iterator()]
        assert len(images) == len(readable[split])
        for image, path in zip(images, readable[split]):
            with Image.open(path) as original:
                expected = np.asarray(original.convert("RGB"))
            assert image.shape == expected.shape
            if path.endswith(".png"):  # lossless: the same pixels (JPEG decoders may round apart)
                np.testing.assert_array_equal(image, expected)
    train = data.make_pipeline(splits, "train", image_size=8, batch_size=2, repeat=False,
                               drop_remainder=False, training=True)
    assert sum(int(x.shape[0]) for x, _ in train) == len(readable["train"])
    reasons = dict(splits.skipped_files)
    assert sorted(reasons) == sorted(bad)
    for path, reason in bad.items():
        assert reason in reasons[path], (path, reasons[path])
        assert any(path in line for line in logged), path


@pytest.mark.parametrize("files_per_task", [1, 2, 3, 32])
def test_decoder_names_every_refused_file_wherever_it_falls_in_its_task(tmp_path, monkeypatch,
                                                                        files_per_task):
    """Refused files at a task's start and end, several in a row, and a whole task of them: the
    decoder keeps the order of the others and names each refused one."""
    monkeypatch.setattr(data, "_FILES_PER_TASK", files_per_task)
    good = []
    for index in range(6):
        good.append(str(tmp_path / f"{index}.png"))
        Image.new("RGB", (index + 1, 2), (index, 0, 0)).save(good[-1])  # width: which image
    bad = [str(tmp_path / f"bad{index}.png") for index in range(6)]
    for path in bad:
        open(path, "wb").close()
    order = [bad[0], good[0], good[1], bad[1], bad[2], bad[3], good[2], good[3], bad[4], good[4],
             good[5], bad[5]]
    unreadable = data.UnreadableFiles(log=lambda _: None)
    dataset = _paths_dataset(order)
    widths = [image.shape[1] for image, _ in unreadable.decode(dataset).as_numpy_iterator()]
    assert widths == [1, 2, 3, 4, 5, 6]
    assert unreadable.paths() == sorted(bad)
    keyed = unreadable.decode(dataset.enumerate(100), keyed=True)
    assert [int(key) for key, _ in keyed.as_numpy_iterator()] == [
        100 + order.index(path) for path in good]


def _paths_dataset(paths):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(
        (tf.constant(paths), tf.range(len(paths), dtype=tf.int32)))


def _folder_with_splits(root, per_class=5):
    """`root/train` (with three unreadable files) and `root/val`, all PNG: exact pixels."""
    _write_folder(os.path.join(root, "train"), per_class=per_class)
    _write_folder(os.path.join(root, "val"), per_class=2)
    open(os.path.join(root, "train", "cat", "empty.png"), "wb").close()
    open(os.path.join(root, "train", "dog", "zero.jpg"), "wb").close()
    with open(os.path.join(root, "train", "dog", "notes.png"), "w") as f:
        f.write("not an image")


def _folder_batches(root, record, count, start_batch=0, resume=False):
    splits = data.load_splits(f"folder:{root}", log=lambda _: None)
    splits.record_unreadable(str(record), resume=resume)
    return _batches_of(splits, count, start_batch)


def _batches_of(splits, count, start_batch):
    pipeline = data.make_pipeline(
        splits, "train", image_size=8, batch_size=3, training=True, start_batch=start_batch,
        augmentation=data.Augmentation(crop_area=(0.5, 1.0), flip=True))
    return [(x.numpy(), y.numpy().argmax(-1)) for x, y in pipeline.take(count)]


def test_resumed_folder_stream_skips_the_recorded_files_and_continues_exactly(tmp_path):
    """10 readable and 3 unreadable training files: a run resumed from a batch sees the batches
    the uninterrupted run saw, because it reads back the record of the files already skipped."""
    _folder_with_splits(str(tmp_path / "images"))
    record = tmp_path / "skipped_files.txt"
    stream = _folder_batches(tmp_path / "images", record, 12)  # 36 examples: 3.6 passes of 10
    recorded = data.read_unreadable_record(str(record))
    assert sorted(os.path.basename(path) for path, _ in recorded) == [
        "empty.png", "notes.png", "zero.jpg"]
    # Every pass holds each readable image once (readable: 5 per class).
    labels = np.concatenate([y for _, y in stream])
    np.testing.assert_array_equal(np.bincount(labels[:30]), [15, 15])
    for start in (5, 9):  # in the second pass, across the third pass's start
        resumed = _folder_batches(tmp_path / "images", record, 12 - start, start, resume=True)
        for (x, y), (x2, y2) in zip(stream[start:], resumed, strict=True):
            np.testing.assert_array_equal(x, x2)
            np.testing.assert_array_equal(y, y2)


def test_resumed_folder_stream_is_exact_with_the_record_of_a_run_killed_in_its_first_pass(
        tmp_path):
    """A run killed early has recorded only the unreadable files it met; those are the ones
    before its last batch, and all that resuming from that batch needs."""
    _folder_with_splits(str(tmp_path / "images"), per_class=12)
    stream = _folder_batches(tmp_path / "images", tmp_path / "whole.txt", 8)
    early = tmp_path / "early.txt"
    _folder_batches(tmp_path / "images", early, 2)  # read 2 batches (and what tf.data prefetched)
    for (x, y), (x2, y2) in zip(stream[2:], _folder_batches(tmp_path / "images", early, 6, 2,
                                                              resume=True), strict=True):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)


def test_a_fresh_run_replaces_an_old_record(tmp_path):
    _folder_with_splits(str(tmp_path / "images"))
    record = tmp_path / "skipped_files.txt"
    record.write_text("/gone/fixed.jpg\tInput is empty.\n")
    _folder_batches(tmp_path / "images", record, 4)
    files = [os.path.basename(path) for path, _ in data.read_unreadable_record(str(record))]
    assert sorted(files) == ["empty.png", "notes.png", "zero.jpg"]


@pytest.mark.slow
@pytest.mark.backend_independent("torch")  # the folder is read by tf.data on every backend
def test_finetune_app_trains_on_a_folder_with_unreadable_files_and_names_them(tmp_path):
    """The app starts without decoding the folder, trains, and names the skipped files in its
    output and in the run folder (skipped_files.txt, and their count in metrics.json)."""
    import json

    from conftest import run_app

    _write_folder(str(tmp_path / "images"), per_class=6)
    bad = _write_unreadable_files(str(tmp_path / "images"))
    result = run_app("finetune.py", f"--dataset=folder:{tmp_path / 'images'}",
                     "--model=ViT-digits", "--image_size=8", "--batch_size=4", "--epochs=1",
                     "--verbose=2", f"--output_dir={tmp_path / 'runs'}", "--run_name=run")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for path in bad:
        assert path in result.stdout, path
    assert "Skipped 5 unreadable file(s)" in result.stdout
    run = tmp_path / "runs" / "run"
    assert sorted(path for path, _ in data.read_unreadable_record(str(run / "skipped_files.txt"))
                  ) == sorted(bad)
    with open(run / "metrics.json") as f:
        assert json.load(f)["skipped_files"] == 5


def test_image_folder_with_train_and_val_subfolders(tmp_path):
    _write_folder(str(tmp_path / "train"), per_class=3)
    _write_folder(str(tmp_path / "val"), per_class=2)
    notes = []
    splits = data.load_splits(f"folder:{tmp_path}", log=notes.append)
    assert splits.num_examples == {"train": 6, "val": 4, "test": 4}
    assert any("test metrics are computed on val" in note for note in notes)


def test_missing_folder_error_says_what_layout_is_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="one sub-folder per class"):
        data.load_splits(f"folder:{tmp_path / 'nope'}")


# Files no pipeline can read, known by their name: each plants some in a class folder and
# returns `{path: (the reason given, the name as the output shows it)}`.
def _loop(folder):
    os.symlink("b.png", os.path.join(folder, "a.png"))
    os.symlink("a.png", os.path.join(folder, "b.png"))
    return {os.path.join(folder, name): ("Too many levels of symbolic links",
                                         os.path.join(folder, name)) for name in ("a.png", "b.png")}


def _dangling_link(folder):
    os.symlink("gone.png", os.path.join(folder, "moved.png"))
    return {os.path.join(folder, "moved.png"): ("a symbolic link to nothing",
                                                os.path.join(folder, "moved.png"))}


def _name_not_utf8(folder):
    path = os.fsencode(folder) + b"/caf\xe9.png"  # a Latin-1 name: not UTF-8
    with open(path, "wb") as f:
        Image.new("RGB", (4, 4)).save(f, format="PNG")
    return {os.fsdecode(path): ("its name is not UTF-8", os.path.join(folder, "caf\\xe9.png"))}


@pytest.mark.parametrize("plant", [_loop, _dangling_link, _name_not_utf8])
def test_a_file_unreadable_by_its_name_is_skipped_and_named_and_the_rest_trains(tmp_path, plant):
    _write_folder(str(tmp_path), per_class=3)
    planted = plant(str(tmp_path / "cat"))
    logged = []
    splits = data.load_splits(f"folder:{tmp_path}", val_fraction=0.34, log=logged.append)
    reasons = dict(splits.skipped_files)
    assert sorted(reasons) == sorted(planted)
    for path, (reason, shown) in planted.items():
        assert reason in reasons[path]
        assert f"Skipped {shown}: {reasons[path].rstrip('.')}." in logged
    train = data.make_pipeline(splits, "train", image_size=8, batch_size=2, repeat=False,
                               drop_remainder=False, training=True)
    assert sum(int(x.shape[0]) for x, _ in train) == splits.num_examples["train"] == 4


def test_an_rgba_webp_is_read_as_its_rgb_pixels(tmp_path):
    """WebP's decoder refuses to give 3 channels of a 4-channel image: read as stored, then made
    RGB, alpha dropped, as PNG's own decoder does."""
    _write_folder(str(tmp_path), per_class=2)
    pixels = np.random.default_rng(0).integers(0, 255, (6, 5, 4), dtype=np.uint8)
    Image.fromarray(pixels, "RGBA").save(tmp_path / "cat" / "alpha.webp", lossless=True)
    Image.fromarray(pixels, "RGBA").save(tmp_path / "dog" / "alpha.png")
    splits = data.load_splits(f"folder:{tmp_path}", val_fraction=0.01, log=lambda _: None)
    images = {path.decode(): image for split in ("train", "val") for (path, _), (image, _) in zip(
        splits.encoded_source(split).as_numpy_iterator(),
        splits.source(split).as_numpy_iterator(), strict=True)}
    assert splits.skipped_files == []
    np.testing.assert_array_equal(images[str(tmp_path / "cat" / "alpha.webp")], pixels[..., :3])
    np.testing.assert_array_equal(images[str(tmp_path / "dog" / "alpha.png")], pixels[..., :3])


def test_a_folder_of_one_class_is_refused_naming_it(tmp_path):
    _write_folder(str(tmp_path), classes=("cat",))
    os.makedirs(tmp_path / "dog")  # an empty class folder is no second class
    with pytest.raises(data.TooFewClassesError,
                       match=r"train split's usable image files are of class 'cat' only \(class "
                             r"folders: cat, dog\)"):
        data.load_splits(f"folder:{tmp_path}", log=lambda _: None)


def test_a_val_folder_of_one_class_is_refused_before_any_training(tmp_path):
    _write_folder(str(tmp_path / "train"))
    _write_folder(str(tmp_path / "val"), classes=("dog",))
    with pytest.raises(data.TooFewClassesError,
                       match="val split's usable image files are of class 'dog' only"):
        data.load_splits(f"folder:{tmp_path}", log=lambda _: None)


def test_an_empty_class_folder_stays_a_class_with_a_warning(tmp_path, caplog):
    _write_folder(str(tmp_path), classes=("cat", "dog"))
    os.makedirs(tmp_path / "emu")
    with caplog.at_level("WARNING", logger="vit_keras"):
        splits = data.load_splits(f"folder:{tmp_path}", log=lambda _: None)
    assert splits.class_names == ["cat", "dog", "emu"]
    assert [record.getMessage() for record in caplog.records] == [
        f"{tmp_path / 'emu'} has no image files: it stays class 2 of 3, but no training image is "
        f"of it."]


def test_a_class_whose_files_all_turn_out_unreadable_is_refused_once_they_are_read(tmp_path):
    _write_folder(str(tmp_path), classes=("cat",), per_class=4)
    os.makedirs(tmp_path / "dog")
    for index in range(4):
        (tmp_path / "dog" / f"{index}.png").write_text("not an image")
    splits = data.load_splits(f"folder:{tmp_path}", val_fraction=0.25, log=lambda _: None)
    splits.check_readable_classes()  # nothing read yet: every file may be an image
    for _ in splits.source("train"):
        pass
    with pytest.raises(data.TooFewClassesError, match="of class 'cat' only"):
        splits.check_readable_classes()


@pytest.mark.slow
@pytest.mark.backend_independent("tensorflow")  # the folder is read by tf.data on every backend
def test_a_run_on_a_class_of_unreadable_files_ends_in_one_error_and_is_not_kept(tmp_path):
    """Trained on one class, a run would score 100%: it stops before metrics.json is written."""
    from conftest import run_app

    _write_folder(str(tmp_path / "images"), classes=("cat",), per_class=6)
    os.makedirs(tmp_path / "images" / "dog")
    for index in range(4):
        (tmp_path / "images" / "dog" / f"{index}.jpg").write_bytes(b"")
    result = run_app("finetune.py", f"--dataset=folder:{tmp_path / 'images'}",
                     "--model=ViT-digits", "--image_size=8", "--batch_size=4", "--epochs=1",
                     f"--output_dir={tmp_path / 'runs'}", "--run_name=run")
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "of class 'cat' only" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs" / "run" / "metrics.json").exists()


def test_resume_is_exact_when_unreadable_file_names_hold_a_newline_or_a_tab(tmp_path):
    """The record names each file in JSON: a name with a newline, a tab or a byte that is not
    UTF-8 reads back as it is, so a resumed run leaves out the same files."""
    images = tmp_path / "images"
    _folder_with_splits(str(images))
    odd = [str(images / "train" / "cat" / "two\nlines.png"),
           str(images / "train" / "dog" / "tab\tbed.jpg"),
           str(images / "train" / "dog" / "tab\tand\nnewline.png")]
    for path in odd:
        open(path, "wb").close()
    latin1 = os.fsencode(images / "train" / "cat") + b"/\xe9t\xe9.png"
    open(latin1, "wb").close()
    record = tmp_path / "skipped_files.txt"
    stream = _folder_batches(images, record, 12)
    recorded = dict(data.read_unreadable_record(str(record)))
    assert set(odd) | {os.fsdecode(latin1)} <= set(recorded)
    assert len(recorded) == 7  # and the three of _folder_with_splits
    for start in (5, 9):
        resumed = _folder_batches(images, record, 12 - start, start, resume=True)
        for (x, y), (x2, y2) in zip(stream[start:], resumed, strict=True):
            np.testing.assert_array_equal(x, x2)
            np.testing.assert_array_equal(y, y2)


def test_a_record_of_the_earlier_tab_separated_format_still_resumes(tmp_path):
    _folder_with_splits(str(tmp_path / "images"))
    stream = _folder_batches(tmp_path / "images", tmp_path / "new.txt", 8)
    old = tmp_path / "old.txt"  # what the version before JSON lines wrote
    old.write_text("# Files of the image folder that were skipped, one per line: path<TAB>reason. "
                   "A resumed run skips the same ones.\n" + "".join(
                       f"{path}\t{reason}\n" for path, reason in
                       data.read_unreadable_record(str(tmp_path / "new.txt"))))
    assert data.read_unreadable_record(str(old)) == data.read_unreadable_record(
        str(tmp_path / "new.txt"))
    for (x, y), (x2, y2) in zip(stream[5:], _folder_batches(tmp_path / "images", old, 3, 5,
                                                             resume=True), strict=True):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)


@pytest.mark.slow
@pytest.mark.backend_independent("tensorflow")  # images are read by TensorFlow on every backend
def test_predict_reads_an_rgba_webp_and_names_a_file_whose_name_is_not_utf8(tmp_path,
                                                                           tiny_config):
    """One `ERROR:` line naming the file as it can be printed, where TensorFlow's conversion of
    the name ended the app with a traceback naming no file; the WebP is not among the files it
    cannot read."""
    from conftest import run_app, tiny_model

    model = str(tmp_path / "model.keras")
    tiny_model(tiny_config, num_classes=3, size=8).save(model)
    pixels = np.random.default_rng(0).integers(0, 255, (9, 7, 4), dtype=np.uint8)
    webp = str(tmp_path / "alpha.webp")
    Image.fromarray(pixels, "RGBA").save(webp, lossless=True)
    latin1 = os.fsencode(tmp_path) + b"/caf\xe9.png"
    with open(latin1, "wb") as f:
        Image.new("RGB", (8, 8)).save(f, format="PNG")
    result = run_app("predict.py", "--model", model, webp, os.fsdecode(latin1))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"ERROR: Cannot read 1 of the 2 image files: {tmp_path}/caf\\xe9.png (its name is not "
        f"UTF-8, which TensorFlow's file names are; rename it)."]


def _forbid_downloads(monkeypatch):
    """Fails the test if tfds starts downloading: the fast failure must come before any fetch."""
    import tensorflow_datasets as tfds

    def download_and_prepare(*args, **kwargs):
        raise AssertionError("tfds tried to download")

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", download_and_prepare)


# The time bounds below separate failing fast from hanging: both failures took 0.44 to 0.98 s in 5
# fresh processes (tfds imported inside, a training run busy on the other core), while a download
# attempt without network hangs for minutes of retries.
def test_unprepared_tfds_dataset_without_network_fails_fast_with_instructions(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setattr(data, "network_reachable", lambda *args, **kwargs: False)
    _forbid_downloads(monkeypatch)
    started = time.perf_counter()
    with pytest.raises(data.DatasetNotPreparedError) as error:
        data.load_splits("cifar10", data_dir=str(tmp_path))
    assert time.perf_counter() - started < 60
    message = str(error.value)
    assert "not prepared" in message and "network is unreachable" in message
    assert "download_and_prepare" in message and str(tmp_path) in message


def test_unprepared_tfds_dataset_with_download_off_fails_fast(tmp_path, monkeypatch):
    _forbid_downloads(monkeypatch)
    started = time.perf_counter()
    with pytest.raises(data.DatasetNotPreparedError, match="downloading is off"):
        data.load_splits("cifar10", data_dir=str(tmp_path), download=False)
    assert time.perf_counter() - started < 60


def test_network_probe_gives_up_within_its_timeout():
    """The probe's thread is joined with the timeout, so 1 s bounds it whatever the network does
    (0.00 to 0.01 s in 5 runs without a route; 1 s where connecting waits); 3 s leaves 2 s for a
    busy machine to schedule the thread."""
    started = time.perf_counter()
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never routed, so the connection cannot open.
    assert data.network_reachable("192.0.2.1", 9, timeout=1.0) is False
    assert time.perf_counter() - started < 3


def test_prepared_tfds_dataset_loads_with_vit_jax_splits(tmp_path):
    import tensorflow_datasets as tfds

    class VitKerasTinyImages(tfds.core.GeneratorBasedBuilder):
        """Six 10x10 images in 3 classes, written to a temporary data_dir (no network)."""

        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(10, 10, 3)),
                "label": tfds.features.ClassLabel(names=["a", "b", "c"])}),
                supervised_keys=("image", "label"))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(50), "test": self._generate_examples(6)}

        def _generate_examples(self, count):
            rng = np.random.default_rng(count)
            for index in range(count):
                yield index, {"image": rng.integers(0, 255, (10, 10, 3), dtype=np.uint8),
                              "label": index % 3}

    VitKerasTinyImages(data_dir=str(tmp_path)).download_and_prepare()
    splits = data.load_splits("vit_keras_tiny_images", data_dir=str(tmp_path),
                              log=lambda _: None)
    assert splits.class_names == ["a", "b", "c"]
    assert splits.num_examples == {"train": 49, "val": 1, "test": 6}  # train[:98%] / train[98%:]
    images, labels = next(iter(data.make_pipeline(splits, "test", image_size=8, batch_size=6)))
    assert images.shape == (6, 8, 8, 3) and labels.shape == (6, 3)


def test_batch_augmentations_stay_float32_under_mixed_precision():
    import keras

    keras.config.set_dtype_policy("mixed_bfloat16")  # conftest restores float32 afterwards
    splits = data.load_splits("digits", log=lambda _: None)
    augmentation = data.Augmentation(flip=False, randaugment=(1, 0.3), mixup=0.2, cutmix=1.0)
    images, labels = next(iter(data.make_pipeline(
        splits, "train", image_size=8, batch_size=8, training=True, augmentation=augmentation)))
    assert images.dtype.name == "float32" and labels.dtype.name == "float32"


# (timm pretrained config, image height and width): a crop fraction of 0.9 and of 1.0, bicubic,
# from a landscape and a portrait image whose sides leave odd margins to the centre crop.
TIMM_EVAL_CASES = [("eva02_small_patch14_224.mim_in22k", (301, 417)),
                   ("vit_base_patch16_384.augreg_in21k_ft_in1k", (517, 389)),
                   ("deit_small_patch16_224.fb_in1k", (160, 203))]


@pytest.mark.backend_independent  # tf.image against PIL: no Keras backend
@pytest.mark.parametrize("name, shape", TIMM_EVAL_CASES)
def test_eval_resize_equals_timms_eval_transform(name, shape, tmp_path):
    timm = pytest.importorskip("timm")
    from timm.data import create_transform, resolve_data_config

    config = resolve_data_config(pretrained_cfg=timm.models.get_pretrained_cfg(name).to_dict())
    rng = np.random.default_rng(0)
    # A smooth image: on noise, two resamplers' roundings differ most.
    small = rng.integers(0, 256, (shape[0] // 8 + 1, shape[1] // 8 + 1, 3), dtype=np.uint8)
    Image.fromarray(small).resize(shape[::-1], Image.BILINEAR).save(tmp_path / "image.png")
    expected = create_transform(**config)(Image.open(tmp_path / "image.png").convert("RGB"))
    mean, std = (np.array(config[k], np.float32)[:, None, None] for k in ("mean", "std"))
    expected = ((expected.numpy() * std + mean) * 255).transpose(1, 2, 0)
    size = config["input_size"][1]
    found = data.load_image_files([str(tmp_path / "image.png")], size,
                                  eval_crop=(config["crop_pct"], config["interpolation"]))[0]
    assert found.shape == expected.shape
    # PIL rounds to uint8 after each of its two passes, TensorFlow keeps floats: measured within
    # 1.1 levels of 255, 0.31 on average (the image squashed to the size, uncropped: 51 to 55).
    difference = np.abs(found - expected)
    assert difference.max() < 1.5 and difference.mean() < 0.5, difference.max()
