"""WRN image data: the three data sets, device-side augmentation, resumable epochs, CIFAR-10 failures.

No test touches the network: CIFAR-10 is exercised on tiny look-alike files (served through a
file:// URL when a download is needed) with the expected checksums patched to theirs.
"""

from __future__ import annotations

import hashlib
import pickle
import tarfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from recipes.wrn_cifar import data
from recipes.wrn_cifar.data import (
    DataUnavailableError,
    DeviceBatches,
    channel_stats,
    crop_and_flip,
    digits_split_indices,
    evaluation_batches,
    load_image_dataset,
    training_batches,
)

CPU = torch.device("cpu")
UNROUTABLE_URL = "http://192.0.2.1/cifar-10-python.tar.gz"  # TEST-NET-1 (RFC 5737): never answers


@pytest.fixture(scope="module")
def digits() -> data.ImageDataset:
    return load_image_dataset("digits", "", CPU)


@pytest.fixture(scope="module")
def fake() -> data.ImageDataset:
    return load_image_dataset("fake", "", CPU, train_size=230, test_size=50)


def make_batches(dataset: data.ImageDataset, batch_size: int = 32, **kwargs) -> DeviceBatches:
    kwargs = {"train": True, "seed": 0} | kwargs
    return DeviceBatches(
        dataset.train_images, dataset.train_labels, batch_size, mean=dataset.mean, std=dataset.std, **kwargs
    )


def reference_crop_and_flip(image: torch.Tensor, row: int, column: int, flip: bool) -> torch.Tensor:
    """The slow, obvious version for one image [3, 32, 32]: paste into zeros, slice, maybe mirror."""
    padded = torch.zeros(3, 40, 40, dtype=image.dtype)
    padded[:, 4:36, 4:36] = image
    crop = padded[:, row : row + 32, column : column + 32]
    return crop.flip(-1) if flip else crop


def reference_normalize(images: torch.Tensor, dataset: data.ImageDataset) -> torch.Tensor:
    mean = torch.tensor(dataset.mean).view(1, 3, 1, 1)
    std = torch.tensor(dataset.std).view(1, 3, 1, 1)
    return (images.double() / 255 - mean) / std


# ---------------------------------------------------------------------------------------- data sets


def test_digits_shapes_dtypes_and_ranges(digits):
    assert digits.train_images.shape == (1297, 3, 32, 32) and digits.test_images.shape == (500, 3, 32, 32)
    assert digits.train_images.dtype == digits.test_images.dtype == torch.uint8
    assert digits.train_labels.dtype == digits.test_labels.dtype == torch.int64
    assert digits.train_labels.shape == (1297,) and digits.test_labels.shape == (500,)
    everything = torch.cat([digits.train_images, digits.test_images])
    assert everything.min() == 0 and everything.max() == 255  # 0..16 scaled to the full 0..255
    assert torch.equal(everything[:, 0], everything[:, 1]) and torch.equal(everything[:, 0], everything[:, 2])
    assert digits.test_labels.bincount().tolist() == [50] * 10
    assert digits.mean[0] == digits.mean[1] == digits.mean[2] and 0 < digits.mean[0] < 1
    assert digits.name == "digits" and digits.num_classes == 10


def test_digits_split_is_fixed_stratified_and_disjoint(digits):
    targets = load_digits().target
    train, test = digits_split_indices(targets)
    assert len(train) == 1297 and len(test) == 500
    assert torch.equal(torch.cat([train, test]).sort().values, torch.arange(1797))
    # Pinned: the split must be the same on every machine and library version.
    assert test[:10].tolist() == [3, 7, 13, 16, 19, 22, 26, 36, 38, 43] and int(test.sum()) == 435759
    assert torch.equal(digits.test_labels, torch.from_numpy(targets[test.numpy()]))


def test_fake_is_seeded_sized_and_learnable():
    one = load_image_dataset("fake", "", CPU, train_size=300, test_size=60, seed=3)
    assert one.train_images.shape == (300, 3, 32, 32) and one.test_images.shape == (60, 3, 32, 32)
    assert one.train_images.dtype == torch.uint8 and one.train_labels.dtype == torch.int64
    again = load_image_dataset("fake", "", CPU, train_size=300, test_size=60, seed=3)
    other = load_image_dataset("fake", "", CPU, train_size=300, test_size=60, seed=4)
    assert torch.equal(one.train_images, again.train_images)
    assert not torch.equal(one.train_images, other.train_images)
    # The signal is the mean colour: nearest class-mean colour must classify the test images.
    colour = lambda images: images.float().mean(dim=(2, 3))  # noqa: E731
    centres = torch.stack([colour(one.train_images[one.train_labels == c]).mean(0) for c in range(10)])
    predicted = torch.cdist(colour(one.test_images), centres).argmin(1)
    assert (predicted == one.test_labels).float().mean() >= 0.9


def test_unknown_data_set_or_option_is_named():
    with pytest.raises(ValueError, match=r"data='imagenet'.*cifar10, digits, fake"):
        load_image_dataset("imagenet", "", CPU)
    with pytest.raises(ValueError, match=r"data\.batch_size.*data\.train_size"):
        load_image_dataset("fake", "", CPU, batch_size=10)
    with pytest.raises(ValueError, match=r"data\.train_size=0"):
        load_image_dataset("fake", "", CPU, train_size=0)


def test_channel_stats_equal_the_float_computation(fake):
    pixels = fake.train_images.double() / 255
    assert fake.mean == pytest.approx(pixels.mean(dim=(0, 2, 3)).tolist(), abs=1e-12)
    assert fake.std == pytest.approx(pixels.std(dim=(0, 2, 3), unbiased=False).tolist(), abs=1e-12)
    assert channel_stats(fake.train_images) == (fake.mean, fake.std)


# ------------------------------------------------------------------------------------- augmentation


def test_crop_and_flip_matches_the_per_image_reference():
    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (12, 3, 32, 32), generator=generator, dtype=torch.uint8)
    offsets = torch.randint(0, 9, (12, 2), generator=generator)
    offsets[:4] = torch.tensor([[0, 0], [8, 8], [0, 8], [8, 0]])  # the corners of the padding
    flips = torch.randint(0, 2, (12,), generator=generator).bool()
    flips[:4] = torch.tensor([False, True, True, False])
    expected = torch.stack(
        [
            reference_crop_and_flip(image, int(r), int(c), bool(f))
            for image, (r, c), f in zip(images, offsets, flips, strict=True)
        ]
    )
    assert torch.equal(crop_and_flip(images, offsets, flips), expected)


def test_training_batch_is_crop_flip_normalize_of_the_epoch_order(fake):
    batches = make_batches(fake, batch_size=16, seed=5)
    order, offsets, flips = batches.epoch_randomness(2)
    assert torch.equal(order.sort().values, torch.arange(230))
    images, labels = list(batches.epoch(2))[3]
    positions = range(3 * 16, 4 * 16)
    expected = torch.stack(
        [
            reference_crop_and_flip(fake.train_images[order[p]], *offsets[p].tolist(), bool(flips[p]))
            for p in positions
        ]
    )
    assert images.shape == (16, 3, 32, 32) and images.dtype == torch.float32
    torch.testing.assert_close(images.double(), reference_normalize(expected, fake), rtol=0, atol=1e-5)
    assert torch.equal(labels, fake.train_labels[order[3 * 16 : 4 * 16]])


def test_resuming_mid_epoch_reproduces_the_uninterrupted_run(fake):
    batches = make_batches(fake, seed=7)
    full = list(batches.epoch(4))
    assert len(full) == len(batches) == 230 // 32
    resumed = list(make_batches(fake, seed=7).epoch(4, start_batch=3))  # a fresh object, as after a restart
    assert len(resumed) == len(full) - 3
    for (images, labels), (expected_images, expected_labels) in zip(resumed, full[3:], strict=True):
        assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
    assert list(batches.epoch(4, start_batch=len(batches))) == []
    with pytest.raises(ValueError, match="start_batch"):
        batches.epoch(4, start_batch=len(batches) + 1)


def test_epochs_and_seeds_draw_different_batches(fake):
    first_labels = lambda batches, epoch: next(iter(batches.epoch(epoch)))[1]  # noqa: E731
    batches = make_batches(fake, seed=0)
    assert not torch.equal(first_labels(batches, 0), first_labels(batches, 1))
    assert not torch.equal(first_labels(batches, 0), first_labels(make_batches(fake, seed=1), 0))
    _, offsets_0, flips_0 = batches.epoch_randomness(0)
    _, offsets_1, flips_1 = batches.epoch_randomness(1)
    assert not torch.equal(offsets_0, offsets_1) and not torch.equal(flips_0, flips_1)


def test_test_batches_keep_order_and_the_short_last_batch(fake):
    batches = DeviceBatches(
        fake.test_images, fake.test_labels, 16, mean=fake.mean, std=fake.std, train=False, seed=0
    )
    assert len(batches) == 4  # 16 + 16 + 16 + 2: every test image counts
    got = list(batches.epoch(0))
    assert [len(labels) for _, labels in got] == [16, 16, 16, 2]
    assert torch.equal(torch.cat([labels for _, labels in got]), fake.test_labels)
    images = torch.cat([images for images, _ in got])
    torch.testing.assert_close(
        images.double(), reference_normalize(fake.test_images, fake), rtol=0, atol=1e-5
    )
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, batches.epoch(9), strict=True))  # no randomness


def test_normalised_training_images_have_zero_mean_unit_std(digits):
    batches = DeviceBatches(
        digits.train_images, digits.train_labels, 500, mean=digits.mean, std=digits.std, train=False, seed=0
    )
    images = torch.cat([images for images, _ in batches.epoch(0)]).double()
    torch.testing.assert_close(
        images.mean(dim=(0, 2, 3)), torch.zeros(3, dtype=torch.float64), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        images.std(dim=(0, 2, 3), unbiased=False), torch.ones(3, dtype=torch.float64), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_batches_round_the_fp32_ones(fake, dtype):
    reference, _ = next(iter(make_batches(fake).epoch(0)))
    images, _ = next(iter(make_batches(fake, dtype=dtype).epoch(0)))
    assert images.dtype == dtype
    assert torch.equal(images, reference.to(dtype))


def test_digits_are_never_flipped_and_the_helpers_follow_the_data_set(digits, fake):
    assert not digits.flip_invariant and fake.flip_invariant
    no_flips, with_flips = training_batches(digits, 64, seed=1), make_batches(digits, seed=1)
    order, offsets, flips = no_flips.epoch_randomness(0)
    assert not flips.any()
    # Turning flips off changes nothing else: same order, same crops.
    expected_order, expected_offsets, expected_flips = with_flips.epoch_randomness(0)
    assert expected_flips.any()
    assert torch.equal(order, expected_order) and torch.equal(offsets, expected_offsets)
    assert training_batches(fake, 64, seed=1).epoch_randomness(0)[2].any()
    evaluation = evaluation_batches(digits, 128, dtype=torch.bfloat16)
    assert not evaluation.train and len(evaluation) == 4  # 3 x 128 + 116
    images, labels = next(iter(evaluation.epoch(0)))
    assert images.dtype == torch.bfloat16 and torch.equal(labels, digits.test_labels[:128])


def test_bad_batch_sizes_name_the_knob(fake):
    for bad in (0, -5):
        with pytest.raises(ValueError, match=rf"data\.batch_size={bad}"):
            make_batches(fake, batch_size=bad)
    with pytest.raises(ValueError, match=r"data\.batch_size=231 is larger than the data set \(230 images\)"):
        make_batches(fake, batch_size=231)
    assert len(make_batches(fake, batch_size=231, train=False)) == 1  # testing keeps the short batch


# ----------------------------------------------------------------------------------------- CIFAR-10


def write_tiny_cifar(folder: Path, per_batch: int = 4) -> dict[str, np.ndarray]:
    """A look-alike cifar-10-batches-py: the six pickled batches with ``per_batch`` random images each."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for name in [*data.CIFAR10_TRAIN_FILES, *data.CIFAR10_TEST_FILES]:
        pixels = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, per_batch).tolist()
        with open(folder / name, "wb") as file:
            pickle.dump({"batch_label": name, "data": pixels, "labels": labels}, file, protocol=2)
        written[name] = pixels
    return written


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def trust_files(monkeypatch, folder: Path) -> None:
    """Make the loader expect the checksums of the tiny files in ``folder``."""
    train = {name: md5(folder / name) for name in data.CIFAR10_TRAIN_FILES}
    test = {name: md5(folder / name) for name in data.CIFAR10_TEST_FILES}
    monkeypatch.setattr(data, "CIFAR10_TRAIN_FILES", train)
    monkeypatch.setattr(data, "CIFAR10_TEST_FILES", test)


@pytest.fixture
def tiny_archive(tmp_path, monkeypatch) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny cifar-10-python.tar.gz outside the data root, with the loader trusting its contents."""
    source = tmp_path / "source"
    written = write_tiny_cifar(source / data.CIFAR10_FOLDER)
    archive = tmp_path / data.CIFAR10_ARCHIVE
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source / data.CIFAR10_FOLDER, arcname=data.CIFAR10_FOLDER)
    trust_files(monkeypatch, source / data.CIFAR10_FOLDER)
    monkeypatch.setattr(data, "CIFAR10_ARCHIVE_MD5", md5(archive))
    return archive, written


def assert_offline_message(message: str, root: Path) -> None:
    for needed in (str(root), "data.root", "data=digits", "data=fake", data.CIFAR10_FOLDER):
        assert needed in message


def test_cifar10_offline_fails_fast_and_leaves_nothing(tmp_path):
    root = tmp_path / "data"
    start = time.monotonic()
    with pytest.raises(DataUnavailableError) as caught:
        load_image_dataset("cifar10", str(root), CPU, download_url=UNROUTABLE_URL, download_timeout_s=1.0)
    assert time.monotonic() - start < 10
    assert_offline_message(str(caught.value), root)
    assert list(root.iterdir()) == []


def test_cifar10_hanging_name_lookup_is_cut_off(tmp_path, monkeypatch):
    # A name lookup ignores socket timeouts: the request thread's deadline must end the wait.
    monkeypatch.setattr(urllib.request, "urlopen", lambda *args, **kwargs: time.sleep(5))
    start = time.monotonic()
    with pytest.raises(DataUnavailableError, match="no answer within 0.5 s") as caught:
        data.load_cifar10(str(tmp_path), download_timeout_s=0.5)
    assert time.monotonic() - start < 3
    assert_offline_message(str(caught.value), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cifar10_download_is_verified_then_renamed_into_place(tmp_path, tiny_archive):
    archive, written = tiny_archive
    root = tmp_path / "data"
    dataset = load_image_dataset("cifar10", str(root), CPU, download_url=archive.as_uri())
    assert [p.name for p in root.iterdir()] == [data.CIFAR10_FOLDER]  # no archive, no staging folder
    assert dataset.train_images.shape == (20, 3, 32, 32) and dataset.test_images.shape == (4, 3, 32, 32)
    assert dataset.train_images.dtype == torch.uint8 and dataset.train_labels.dtype == torch.int64
    expected = torch.from_numpy(written["data_batch_2"]).reshape(4, 3, 32, 32)  # planes R, G, B
    assert torch.equal(dataset.train_images[4:8], expected)
    # Present now: loading again needs no network.
    again = load_image_dataset("cifar10", str(root), CPU, download_url=UNROUTABLE_URL, download_timeout_s=0.1)
    assert torch.equal(again.test_images, dataset.test_images)


def test_cifar10_damaged_download_leaves_nothing(tmp_path, tiny_archive, monkeypatch):
    archive, _ = tiny_archive
    monkeypatch.setattr(data, "CIFAR10_ARCHIVE_MD5", "0" * 32)
    root = tmp_path / "data"
    with pytest.raises(DataUnavailableError, match="damaged"):
        data.load_cifar10(str(root), download_url=archive.as_uri())
    assert list(root.iterdir()) == []


def test_cifar10_corrupt_or_missing_file_is_named(tmp_path):
    folder = tmp_path / data.CIFAR10_FOLDER
    write_tiny_cifar(folder)  # real CIFAR-10 checksums expected: every tiny file is "corrupt"
    with pytest.raises(DataUnavailableError) as caught:
        data.load_cifar10(str(tmp_path), download_url=UNROUTABLE_URL)
    message = str(caught.value)
    assert str(folder / "data_batch_1") in message and "corrupt" in message and "Delete" in message
    (folder / "data_batch_1").unlink()
    with pytest.raises(DataUnavailableError, match="data_batch_1 is missing"):
        data.load_cifar10(str(tmp_path), download_url=UNROUTABLE_URL)


def test_digits_are_the_bilinear_upscale_of_the_originals(digits):
    # Reference: bilinear interpolation written out as a 32x8 matrix (half-pixel centres, clamped edges).
    interpolation = torch.zeros(32, 8, dtype=torch.float64)
    for i in range(32):
        x = min(max((i + 0.5) / 4 - 0.5, 0.0), 7.0)
        left = int(x)
        interpolation[i, left] += 1 - (x - left)
        interpolation[i, min(left + 1, 7)] += x - left
    originals = torch.from_numpy(load_digits().images)  # float64 [1797, 8, 8], 0..16
    _, test = digits_split_indices(load_digits().target)
    expected = interpolation @ originals[test] @ interpolation.T * (255 / 16)
    assert (digits.test_images[:, 0].double() - expected).abs().max() <= 0.5 + 1e-4  # rounding only
