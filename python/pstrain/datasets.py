"""Datasets a job trains on: each makes a pstrain.v1.DatasetSpec.

The workers read the files (under their --data-root, /usr/share/datasets by
default): a path here is a path on the workers, not on this machine.

    pstrain.datasets.IDX("/usr/share/datasets/fashion-mnist", mean=[0.2860], std=[0.3530])
    pstrain.datasets.FashionMNIST(train_limit=6400)      # the same, Debian's path

proto/pstrain/v1/job.proto documents every field.
"""

from pstrain._proto import job_pb2

FASHION_MNIST_PATH = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist.


class Dataset:
    """Fields shared by every format.

    mean, std: per-channel normalisation after scaling pixels to [0, 1] (one
    value for every channel; None: none). train_limit, test_limit: use only
    the first N samples (0: all). random_flip, crop_padding: augmentation.
    balance: "oversample" draws every class as often as the largest.
    """

    format = job_pb2.DATASET_FORMAT_UNSPECIFIED

    def __init__(self, path="", mean=None, std=None, train_limit=0, test_limit=0,
                 random_flip=False, crop_padding=0, balance=None, prefetch_batches=0,
                 loader_threads=0):
        if balance not in (None, "none", "oversample"):
            raise ValueError(f"balance must be None or 'oversample', got {balance!r}")
        self.path = str(path)
        self.mean = list(mean or [])
        self.std = list(std or [])
        self.train_limit = int(train_limit)
        self.test_limit = int(test_limit)
        self.random_flip = bool(random_flip)
        self.crop_padding = int(crop_padding)
        self.balance = balance
        self.prefetch_batches = int(prefetch_batches)
        self.loader_threads = int(loader_threads)

    def to_spec(self):
        spec = job_pb2.DatasetSpec(
            format=self.format, path=self.path, mean=self.mean, std=self.std,
            train_limit=self.train_limit, test_limit=self.test_limit,
            prefetch_batches=self.prefetch_batches, loader_threads=self.loader_threads,
            balance=(job_pb2.BALANCE_OVERSAMPLE if self.balance == "oversample"
                     else job_pb2.BALANCE_NONE))
        if self.random_flip or self.crop_padding:
            spec.augmentation.random_flip = self.random_flip
            spec.augmentation.crop_padding = self.crop_padding
        self._fill(spec)
        return spec

    def _fill(self, spec):
        """Format-specific fields."""

    def __repr__(self):
        return f"<pstrain.datasets.{type(self).__name__} {self.path!r}>"


class IDX(Dataset):
    """MNIST-style IDX files ({train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]) in `path`."""

    format = job_pb2.DATASET_FORMAT_IDX


def FashionMNIST(path=FASHION_MNIST_PATH, **kwargs):
    """Fashion-MNIST as IDX, normalised as examples/fashion-mnist.json does."""
    kwargs.setdefault("mean", [0.2860])
    kwargs.setdefault("std", [0.3530])
    return IDX(path, **kwargs)


class CIFAR10(Dataset):
    """CIFAR-10 binary version (data_batch_{1..5}.bin, test_batch.bin) in `path`."""

    format = job_pb2.DATASET_FORMAT_CIFAR10


class ImageFolder(Dataset):
    """<path>/train/<class>/*.{jpg,png} and <path>/test/...; every image resized
    to image_size (height, width)."""

    format = job_pb2.DATASET_FORMAT_IMAGE_FOLDER

    def __init__(self, path, image_size, **kwargs):
        super().__init__(path, **kwargs)
        self.image_height, self.image_width = (int(d) for d in image_size)

    def _fill(self, spec):
        spec.image_height = self.image_height
        spec.image_width = self.image_width


class BSON(Dataset):
    """The Cdiscount product dump's layout (docs/DATA.md): <path>/train.bson and
    test.bson, every picture a sample labelled with its product's category,
    decoded and resized to image_size (height, width) with `channels` (1 or
    3). max_bad_records: damaged records skipped and counted per split (0:
    the first stops the job with its offset)."""

    format = job_pb2.DATASET_FORMAT_BSON

    def __init__(self, path, image_size, channels=3, max_bad_records=0, **kwargs):
        super().__init__(path, **kwargs)
        self.image_height, self.image_width = (int(d) for d in image_size)
        self.channels = int(channels)
        self.max_bad_records = int(max_bad_records)

    def _fill(self, spec):
        spec.image_height = self.image_height
        spec.image_width = self.image_width
        spec.image_channels = self.channels
        spec.max_bad_records = self.max_bad_records


class Packed(Dataset):
    """Shards written by `pstrain prepare` (train-*-of-*.pspack, test-*): decoded,
    checksummed records read with a copy. Give the source's mean and std.

    From an object store (path "s3://bucket/prefix") each worker streams only
    the ~8 MiB chunks its share of an epoch holds; shuffle_window_mib (0: 256)
    is the window its epochs shuffle samples within, after shuffling the
    chunks. A split that fits in one window is shuffled whole."""

    format = job_pb2.DATASET_FORMAT_PACKED

    def __init__(self, path="", shuffle_window_mib=0, **kwargs):
        super().__init__(path, **kwargs)
        self.shuffle_window_mib = int(shuffle_window_mib)
        if not 0 <= self.shuffle_window_mib <= 65536:
            raise ValueError(f"shuffle_window_mib must be in [0, 65536], got {shuffle_window_mib!r}")

    def _fill(self, spec):
        spec.shuffle_window_mib = self.shuffle_window_mib


class Synthetic(Dataset):
    """Random pixels and labels from `seed`, for throughput tests: nothing to learn."""

    format = job_pb2.DATASET_FORMAT_SYNTHETIC

    def __init__(self, shape, num_classes, train_samples, test_samples, seed=0, **kwargs):
        super().__init__("", **kwargs)
        self.shape = tuple(int(d) for d in shape)
        if len(self.shape) != 3:
            raise ValueError(f"Synthetic shape must be (C, H, W), got {shape!r}")
        self.num_classes = int(num_classes)
        self.train_samples = int(train_samples)
        self.test_samples = int(test_samples)
        self.seed = int(seed)

    def _fill(self, spec):
        c, h, w = self.shape
        spec.synthetic.CopyFrom(job_pb2.SyntheticSpec(
            channels=c, height=h, width=w, num_classes=self.num_classes,
            train_samples=self.train_samples, test_samples=self.test_samples, seed=self.seed))
