"""Measures what an image-folder dataset costs before training and per image: listing a large
folder (`load_splits("folder:...")`, which opens no file), and decoding with the pipeline's
name-reporting decoder against a plain `tf.io.decode_image` map.

    python benchmarks/folder_listing.py                        # 100,000 files in a temporary folder
    python benchmarks/folder_listing.py --files 1000000 --decode_images 4000 --json listing.json

The folder is made cheaply: `--files` hard links (ten classes) to a few 500x375 JPEG photos
(scikit-image's), so it takes no more disk than the photos. Listing is timed `--rounds` times
(the first round also fills the OS's directory cache; the table gives the fastest and the
slowest). Decoding runs each pipeline over the first `--decode_images` files, alternating them
`--rounds` times, and reports process CPU time per image (tf.data uses every core, so wall time
would hide the work). The former start-up check (PIL's verify and load of every file, on one
core) is timed on the same files for comparison. Not part of the test suite.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

PHOTO_SIZE = (500, 375)  # width, height: a typical ImageNet photo


def make_folder(root, files, classes=10):
    """`root/class_k/NNNNNNN.jpg`: `files` hard links to five JPEG photos."""
    import numpy as np
    from PIL import Image
    from skimage import data as photos

    sources = []
    for index, name in enumerate(("astronaut", "coffee", "chelsea", "rocket", "camera")):
        pixels = np.asarray(getattr(photos, name)())
        path = os.path.join(root, f"photo{index}.jpg")
        Image.fromarray(pixels).convert("RGB").resize(PHOTO_SIZE).save(path, quality=90)
        sources.append(path)
    for label in range(classes):
        os.makedirs(os.path.join(root, "images", f"class_{label}"), exist_ok=True)
    for index in range(files):
        link = os.path.join(root, "images", f"class_{index % classes}", f"{index:07d}.jpg")
        os.link(sources[index % len(sources)], link)
    return os.path.join(root, "images")


def time_listing(folder, rounds):
    from vit_keras.tools import data

    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        splits = data.load_splits(f"folder:{folder}", log=lambda _: None)
        seconds.append(time.perf_counter() - started)
    return seconds, sum(splits.num_examples[split] for split in ("train", "val"))


def time_decoding(folder, count, rounds):
    """CPU seconds per image of a plain decode map and of the pipeline's decoder, and of the
    former PIL check, over the first `count` files."""
    from PIL import Image
    import tensorflow as tf

    from vit_keras.tools import data

    splits = data.load_splits(f"folder:{folder}", log=lambda _: None)
    files = splits.encoded_source("train").take(count)

    def plain():
        return files.map(lambda path, label: (data.decode_image_file(path), label),
                         num_parallel_calls=tf.data.AUTOTUNE)

    def reporting():
        return splits.source("train").take(count)

    def cpu_per_image(make):
        started = time.process_time()
        images = sum(1 for _ in make())
        return (time.process_time() - started) / images

    results = {"plain tf.io.decode_image map": [], "vit_keras folder decoder": []}
    for _ in range(rounds):
        results["plain tf.io.decode_image map"].append(cpu_per_image(plain))
        results["vit_keras folder decoder"].append(cpu_per_image(reporting))
    paths = [path.decode() for path, _ in files.as_numpy_iterator()]
    started = time.process_time()
    for path in paths:
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            image.load()
    results["PIL verify + load (former start-up check)"] = [
        (time.process_time() - started) / len(paths)]
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode_images", type=int, default=2000,
                        help="files decoded per pipeline and round (0: listing only)")
    parser.add_argument("--folder", default=None, help="where to make the folder (default: a "
                        "temporary one under /tmp, deleted at the end)")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    root = args.folder or tempfile.mkdtemp(prefix="folder_listing_")
    try:
        started = time.perf_counter()
        folder = make_folder(root, args.files)
        print(f"made {args.files:,} hard links in {time.perf_counter() - started:.1f} s",
              file=sys.stderr, flush=True)
        listing, listed = time_listing(folder, args.rounds)
        decoding = time_decoding(folder, args.decode_images, args.rounds) if args.decode_images \
            else {}
    finally:
        if args.folder is None:
            shutil.rmtree(root, ignore_errors=True)
    print("| measurement | files | fastest | slowest |\n|---|---|---|---|")
    print(f"| load_splits (list, split) | {listed:,} | {min(listing):.2f} s | "
          f"{max(listing):.2f} s |")
    for name, seconds in decoding.items():
        print(f"| {name}, CPU per image | {args.decode_images:,} | {1e3 * min(seconds):.3f} ms | "
              f"{1e3 * max(seconds):.3f} ms |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"files": listed, "cpus": os.cpu_count(), "listing_seconds": listing,
                       "decode_images": args.decode_images,
                       "decode_cpu_seconds_per_image": decoding,
                       "command": " ".join(["python", *sys.argv])}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
