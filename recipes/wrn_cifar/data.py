"""Image data for the WRN recipe: three data sets of one shape, kept on the device, augmented there.

Every data set gives uint8 images [N, 3, 32, 32] and int64 labels [N] in 0..9:

- ``cifar10``: CIFAR-10 (50,000 train / 10,000 test), downloaded once into ``data.root`` and checked
  against the MD5 sums torchvision knows. Downloads go to a temporary folder inside the root and are
  renamed into place only when verified, so a failed or interrupted download leaves nothing behind.
- ``digits``: scikit-learn's handwritten digits (1,797 real 8x8 images shipped inside the package),
  scaled to 32x32 and 3 channels; a fixed stratified split of 1,297 train / 500 test. Needs no
  download: the demo's data. Mirrored digits are not digits, so this data set is never flipped.
- ``fake``: seeded random images whose class shows in their mean colour (tests and smoke runs).

As the fastest CIFAR trainers do, the whole data set lives on the device as uint8 and
``DeviceBatches`` augments whole batches there (random crop after zero padding, horizontal flip,
per-channel normalisation): no per-image Python work and no DataLoader workers.
"""

from __future__ import annotations

import http.client
import inspect
import logging
import math
import os
import pickle
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.datasets import CIFAR10

from lowmem.download import fetch, file_md5

log = logging.getLogger(__name__)

NUM_CLASSES = 10
IMAGE_SIZE = 32
CROP_PADDING = 4  # pixels of zero padding before the random 32x32 crop (SPEC §3.1)

# What torchvision knows about CIFAR-10 (module constants so tests can point them at tiny files).
CIFAR10_URL: str = CIFAR10.url
CIFAR10_ARCHIVE = CIFAR10.filename  # cifar-10-python.tar.gz
CIFAR10_ARCHIVE_MD5: str = CIFAR10.tgz_md5
CIFAR10_FOLDER = CIFAR10.base_folder  # cifar-10-batches-py
CIFAR10_TRAIN_FILES: dict[str, str] = dict(CIFAR10.train_list)  # file name -> MD5
CIFAR10_TEST_FILES: dict[str, str] = dict(CIFAR10.test_list)

DIGITS_TEST_PER_CLASS = 50  # 10 classes x 50 = 500 test images, the other 1,297 train
DIGITS_SPLIT_SEED = 0


class DataUnavailableError(RuntimeError):
    """A data set is missing, cannot be downloaded, or is corrupt; the message says what to do."""


@dataclass
class ImageDataset:
    """A whole image data set, every tensor on one device.

    Images are uint8 [N, 3, 32, 32] (0..255), labels int64 [N] (0..num_classes-1). ``mean`` and
    ``std`` are per channel, in 0..1 pixel units, computed from the training images.
    ``flip_invariant``: a horizontally mirrored image keeps its label, so flipping is a valid
    augmentation (CIFAR-10, fake; not digits, where flips cost ~2 points of test accuracy).
    """

    train_images: Tensor
    train_labels: Tensor
    test_images: Tensor
    test_labels: Tensor
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    name: str
    flip_invariant: bool = True
    num_classes: int = NUM_CLASSES


Split = tuple[Tensor, Tensor, Tensor, Tensor]  # train images, train labels, test images, test labels


# ----------------------------------------------------------------------------------------- CIFAR-10


def load_cifar10(root: str, *, download_url: str = CIFAR10_URL, download_timeout_s: float = 5.0) -> Split:
    """CIFAR-10 from ``root/cifar-10-batches-py``, downloading it there first if it is absent.

    ``download_timeout_s`` bounds the wait for the server's answer (connectivity is checked before
    the 163 MB download) and every stalled read, so an offline machine fails within seconds.
    """
    root_path = Path(root).expanduser()
    folder = root_path / CIFAR10_FOLDER
    if not folder.exists():
        _download_cifar10(root_path, download_url, download_timeout_s)
    _verify_cifar10(folder)  # before unpickling: only the known files are ever unpickled
    train = [_read_cifar10_batch(folder / name) for name in CIFAR10_TRAIN_FILES]
    test = [_read_cifar10_batch(folder / name) for name in CIFAR10_TEST_FILES]
    return (
        torch.cat([images for images, _ in train]),
        torch.cat([labels for _, labels in train]),
        torch.cat([images for images, _ in test]),
        torch.cat([labels for _, labels in test]),
    )


def _read_cifar10_batch(path: Path) -> tuple[Tensor, Tensor]:
    """One python-pickle batch as uint8 images [n, 3, 32, 32] and int64 labels [n]."""
    with open(path, "rb") as file:
        batch = pickle.load(file, encoding="latin1")
    # Rows are 3,072 bytes: the red plane, then green, then blue, each 32x32 row-major.
    images = torch.from_numpy(np.ascontiguousarray(batch["data"], dtype=np.uint8))
    images = images.reshape(-1, 3, IMAGE_SIZE, IMAGE_SIZE)
    return images, torch.tensor(batch["labels"], dtype=torch.int64)


def _verify_cifar10(folder: Path) -> None:
    """Check every batch file against its MD5; a missing or corrupt one is named, with the fix."""
    fix = (
        f"Delete {folder} and run again to download a fresh copy, or set data.root to a "
        f"directory whose {CIFAR10_FOLDER} folder is intact."
    )
    for name, md5 in (CIFAR10_TRAIN_FILES | CIFAR10_TEST_FILES).items():
        path = folder / name
        if not path.is_file():
            raise DataUnavailableError(f"CIFAR-10 folder {folder} is incomplete: {name} is missing. {fix}")
        actual = file_md5(path)
        if actual != md5:
            raise DataUnavailableError(
                f"CIFAR-10 file {path} is corrupt (MD5 {actual}, expected {md5}). {fix}"
            )


def _download_cifar10(root: Path, url: str, timeout_s: float) -> None:
    """Download, verify and extract into a temporary folder in ``root``; rename into place at the end."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".cifar10-download-", dir=root))
    except OSError as error:
        raise DataUnavailableError(_cifar10_unavailable(root, url, error)) from error
    try:
        archive = staging / CIFAR10_ARCHIVE
        log.info("downloading CIFAR-10 from %s into %s", url, root)
        try:
            actual = fetch(url, archive, timeout_s)
        except (OSError, http.client.HTTPException) as error:  # URLError, timeouts, refusals, cut-offs
            raise DataUnavailableError(_cifar10_unavailable(root, url, error)) from error
        if actual != CIFAR10_ARCHIVE_MD5:
            raise DataUnavailableError(
                f"the CIFAR-10 archive downloaded from {url} is damaged (MD5 {actual}, expected "
                f"{CIFAR10_ARCHIVE_MD5}); nothing was written to {root}. Run again. "
                + _cifar10_alternatives(root)
            )
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(staging, filter="data")
        _verify_cifar10(staging / CIFAR10_FOLDER)
        try:
            os.rename(staging / CIFAR10_FOLDER, root / CIFAR10_FOLDER)
        except OSError:
            if not (root / CIFAR10_FOLDER).is_dir():
                raise
            # Another process finished the same download first: use its (verified) copy.
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _cifar10_unavailable(root: Path, url: str, error: BaseException) -> str:
    return (
        f"CIFAR-10 is not in {root / CIFAR10_FOLDER} and could not be downloaded from {url} "
        f"({type(error).__name__}: {error}). " + _cifar10_alternatives(root)
    )


def _cifar10_alternatives(root: Path) -> str:
    return (
        f"To use CIFAR-10 offline, place the extracted {CIFAR10_FOLDER} folder (from "
        f"{CIFAR10_ARCHIVE}) in {root}, or set data.root to a directory that holds it. To train "
        "without it: data=digits (real handwritten digits embedded in scikit-learn) or data=fake "
        "(generated images)."
    )


# ------------------------------------------------------------------------------------------- digits


def digits_split_indices(targets: np.ndarray) -> tuple[Tensor, Tensor]:
    """The fixed digits split: sorted int64 indices (train [1297], test [500]) into the 1,797 digits.

    targets: the labels of ``sklearn.datasets.load_digits()``, [1797].
    Per class, a seeded permutation picks 50 test images. NumPy's legacy ``RandomState`` stream is
    frozen by NumPy's compatibility policy, so the split is the same on every machine and version.
    """
    rng = np.random.RandomState(DIGITS_SPLIT_SEED)
    test = np.concatenate(
        [rng.permutation(np.flatnonzero(targets == c))[:DIGITS_TEST_PER_CLASS] for c in range(NUM_CLASSES)]
    )
    is_test = np.zeros(len(targets), dtype=bool)
    is_test[test] = True
    return torch.from_numpy(np.flatnonzero(~is_test)), torch.from_numpy(np.flatnonzero(is_test))


def load_digits_32(root: str) -> Split:
    """scikit-learn's 8x8 digits as uint8 [N, 3, 32, 32]; ``root`` is unused (nothing to download).

    Pixel values 0..16 become 0..255; the images are upscaled bilinearly (all at once) and the grey
    channel is repeated three times so that the WRN's 3-channel input fits.
    """
    from sklearn.datasets import load_digits  # imported here: only this data set needs scikit-learn

    digits = load_digits()
    images = torch.from_numpy(digits.images).float().unsqueeze(1)  # [1797, 1, 8, 8], 0..16
    images = F.interpolate(images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    images = (images * (255 / 16)).round().clamp(0, 255).to(torch.uint8).expand(-1, 3, -1, -1)
    labels = torch.from_numpy(digits.target).to(torch.int64)
    train, test = digits_split_indices(digits.target)
    return images[train].contiguous(), labels[train], images[test].contiguous(), labels[test]


# --------------------------------------------------------------------------------------------- fake


def make_fake(root: str, *, train_size: int = 500, test_size: int = 100, seed: int = 0) -> Split:
    """Seeded random uint8 images whose class sets their mean colour, so a model can learn them.

    Each class has a random colour (train and test share it); every pixel adds uniform noise of
    ±48 levels. ``root`` is unused.
    """
    for knob, value in (("train_size", train_size), ("test_size", test_size)):
        if value < 1:
            raise ValueError(f"data.{knob}={value}: must be at least 1")
    generator = torch.Generator().manual_seed(seed)
    colours = torch.randint(32, 224, (NUM_CLASSES, 3), generator=generator)
    count = train_size + test_size
    labels = torch.randint(0, NUM_CLASSES, (count,), generator=generator)
    noise = torch.randint(-48, 49, (count, 3, IMAGE_SIZE, IMAGE_SIZE), generator=generator)
    images = (colours[labels][:, :, None, None] + noise).clamp(0, 255).to(torch.uint8)
    return images[:train_size], labels[:train_size], images[train_size:], labels[train_size:]


# ------------------------------------------------------------------------------------------- loader

_LOADERS: dict[str, Callable[..., Split]] = {
    "cifar10": load_cifar10,
    "digits": load_digits_32,
    "fake": make_fake,
}


def load_image_dataset(name: str, root: str, device: torch.device, **options: object) -> ImageDataset:
    """Load data set ``name`` (cifar10, digits, fake) onto ``device``.

    ``options`` are the data set's own keywords (cifar10: ``download_url``, ``download_timeout_s``;
    fake: ``train_size``, ``test_size``, ``seed``); an unknown one is an error naming it.
    """
    if name not in _LOADERS:
        raise ValueError(f"data={name!r} is not a known image data set; allowed: {', '.join(_LOADERS)}")
    loader = _LOADERS[name]
    allowed = [p for p in inspect.signature(loader).parameters if p != "root"]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"data={name} has no option {', '.join(f'data.{key}' for key in unknown)}; "
            f"allowed: {', '.join(f'data.{key}' for key in allowed) or 'none'}"
        )
    train_images, train_labels, test_images, test_labels = loader(root, **options)
    mean, std = channel_stats(train_images)
    return ImageDataset(
        train_images=train_images.to(device),
        train_labels=train_labels.to(device),
        test_images=test_images.to(device),
        test_labels=test_labels.to(device),
        mean=mean,
        std=std,
        name=name,
        flip_invariant=name != "digits",
    )


def channel_stats(images: Tensor) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """Per-channel mean and (population) standard deviation of uint8 [N, 3, H, W], in 0..1 units.

    Computed exactly from a 256-bin histogram per channel, so no float copy of the data is made.
    """
    levels = torch.arange(256, dtype=torch.float64) / 255
    means, stds = [], []
    for channel in range(images.shape[1]):
        counts = torch.bincount(images[:, channel].reshape(-1).cpu(), minlength=256).double()
        mean = (counts * levels).sum() / counts.sum()
        variance = (counts * (levels - mean) ** 2).sum() / counts.sum()
        means.append(mean.item())
        stds.append(variance.sqrt().item())
    return tuple(means), tuple(stds)  # type: ignore[return-value]


# ------------------------------------------------------------------------------------ augmentation


def crop_and_flip(images: Tensor, offsets: Tensor, flips: Tensor, padding: int = CROP_PADDING) -> Tensor:
    """Random-crop-after-padding and horizontal flip of a whole batch, in two gathers.

    images: [B, C, H, W] (any dtype); offsets: int64 [B, 2], each image's (row, column) crop origin
    in the zero-padded image, in 0..2*padding; flips: bool [B]. Returns [B, C, H, W].
    Zero padding on the raw pixels is what torchvision's ``RandomCrop(32, padding=4)`` does before
    normalisation in DSR's pipeline: the border is black, not the mean.
    """
    batch, channels, height, width = images.shape
    padded = F.pad(images, (padding,) * 4)
    rows = offsets[:, :1] + torch.arange(height, device=images.device)  # [B, H]
    columns = torch.arange(width, device=images.device).expand(batch, width)
    # A flip reads the crop's columns right to left: it costs nothing extra inside the gather.
    columns = torch.where(flips[:, None], width - 1 - columns, columns) + offsets[:, 1:]  # [B, W]
    cropped = padded.gather(2, rows[:, None, :, None].expand(batch, channels, height, width + 2 * padding))
    return cropped.gather(3, columns[:, None, None, :].expand(batch, channels, height, width))


class DeviceBatches:
    """Epoch iterator over device-resident data, augmented on the device in whole batches.

    Training (``train=True``): a fresh permutation per epoch, random crop after 4-pixel zero padding
    and (if ``flip``) random horizontal flip, then per-channel normalisation. Testing: data order, no
    augmentation. ``training_batches`` and ``evaluation_batches`` build both from an ``ImageDataset``.
    Every batch is (images [B, 3, 32, 32] normalised, in ``dtype`` and ``memory_format``; labels int64 [B]).

    The randomness of an epoch is drawn up front from a generator seeded by (seed, epoch) alone, so
    ``epoch(e, start_batch=k)`` yields exactly the batches k.. of an uninterrupted ``epoch(e)``:
    resuming needs no saved generator state.
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        batch_size: int,
        *,
        mean: tuple[float, float, float],
        std: tuple[float, float, float],
        train: bool,
        seed: int,
        dtype: torch.dtype = torch.float32,
        drop_last: bool | None = None,
        flip: bool = True,
        device: torch.device | None = None,
        memory_format: torch.memory_format = torch.preserve_format,
    ) -> None:
        """``drop_last`` (a short last batch is dropped) defaults to ``train``: every test image counts.
        ``device``: where batches are augmented and delivered (default: where ``images`` live); when
        it differs, each minibatch is gathered where the data set lives and copied as uint8."""
        if batch_size <= 0:
            raise ValueError(f"data.batch_size={batch_size}: must be a positive number of images")
        self.drop_last = train if drop_last is None else drop_last
        if self.drop_last and batch_size > len(images):
            raise ValueError(
                f"data.batch_size={batch_size} is larger than the data set ({len(images)} images): "
                "no full batch to train on"
            )
        self.images, self.labels, self.batch_size = images, labels, batch_size
        self.train, self.seed, self.dtype, self.flip = train, seed, dtype, flip
        self.memory_format = memory_format  # channels_last for 16-bit images on CUDA (techniques.convolutions)
        self.device = torch.device(device) if device is not None else images.device
        # Normalisation x/255 -> (x - mean)/std folded into one multiply-add per pixel.
        std_tensor = torch.tensor(std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        mean_tensor = torch.tensor(mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self._scale = 1 / (255 * std_tensor)
        self._shift = -mean_tensor / std_tensor

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return len(self.images) // self.batch_size
        return math.ceil(len(self.images) / self.batch_size)

    def epoch_randomness(self, epoch: int) -> tuple[Tensor, Tensor, Tensor]:
        """An epoch's order int64 [N], crop offsets int64 [N, 2] and flips bool [N] (by position).

        Drawn on the CPU (the same numbers on every device) from a seed that mixes (seed, epoch).
        """
        mixed = np.random.SeedSequence([self.seed, epoch]).generate_state(1, np.uint64)[0]
        generator = torch.Generator().manual_seed(int(mixed))
        count = len(self.images)
        order = torch.randperm(count, generator=generator)
        offsets = torch.randint(0, 2 * CROP_PADDING + 1, (count, 2), generator=generator)
        # Drawn even when flipping is off, so that the other draws do not depend on ``flip``.
        flips = torch.randint(0, 2, (count,), generator=generator).bool() & self.flip
        return order.to(self.images.device), offsets.to(self.device), flips.to(self.device)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
        """The batches ``start_batch``.. of epoch ``epoch`` (``epoch`` is ignored when testing)."""
        if not 0 <= start_batch <= len(self):
            raise ValueError(f"start_batch={start_batch}: an epoch has batches 0..{len(self) - 1}")
        return self._batches(epoch, start_batch)

    def _batches(self, epoch: int, start_batch: int) -> Iterator[tuple[Tensor, Tensor]]:
        if self.train:
            order, offsets, flips = self.epoch_randomness(epoch)
        for index in range(start_batch, len(self)):
            positions = slice(index * self.batch_size, (index + 1) * self.batch_size)
            chosen = order[positions] if self.train else positions
            images, labels = self._deliver(self.images[chosen]), self._deliver(self.labels[chosen])
            if self.train:
                images = crop_and_flip(images, offsets[positions], flips[positions])
            yield self.normalize(images), labels

    def _deliver(self, tensor: Tensor) -> Tensor:
        """A minibatch tensor on the batches' device (copied from pinned host memory if need be)."""
        if tensor.device.type == self.device.type and (
            self.device.index is None or tensor.device.index == self.device.index
        ):  # already there: ``cuda`` names the current device, which a ``cuda:0`` tensor is on
            return tensor
        if tensor.device.type == "cpu" and self.device.type == "cuda" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    @property
    def normalization(self) -> tuple[Tensor, Tensor]:
        """The per-channel scale and shift ``normalize`` applies (tensors on the batches' device)."""
        return self._scale, self._shift

    def normalize(self, images: Tensor) -> Tensor:
        """uint8 [B, 3, H, W] -> ((x/255 - mean) / std) in ``self.dtype`` and ``self.memory_format``,
        computed in FP32."""
        return torch.addcmul(self._shift, images.float(), self._scale).to(self.dtype, memory_format=self.memory_format)


def training_batches(
    dataset: ImageDataset,
    batch_size: int,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    memory_format: torch.memory_format = torch.preserve_format,
) -> DeviceBatches:
    """Shuffled, augmented training batches of ``dataset`` (flipped only if it is flip-invariant),
    delivered on ``device`` (default: where the data set lives) in ``memory_format``."""
    return DeviceBatches(
        dataset.train_images,
        dataset.train_labels,
        batch_size,
        mean=dataset.mean,
        std=dataset.std,
        train=True,
        seed=seed,
        dtype=dtype,
        flip=dataset.flip_invariant,
        device=device,
        memory_format=memory_format,
    )


def evaluation_batches(
    dataset: ImageDataset,
    batch_size: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    memory_format: torch.memory_format = torch.preserve_format,
) -> DeviceBatches:
    """The test set in order, unaugmented, the last short batch kept, delivered on ``device`` in
    ``memory_format``."""
    return DeviceBatches(
        dataset.test_images,
        dataset.test_labels,
        batch_size,
        mean=dataset.mean,
        std=dataset.std,
        train=False,
        seed=0,
        dtype=dtype,
        device=device,
        memory_format=memory_format,
    )
