#include "common/data/load_dataset.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/data/bson_dataset.h"
#include "common/data/cifar_reader.h"
#include "common/data/dataset.h"
#include "common/data/idx_reader.h"
#include "common/data/image_folder_reader.h"
#include "common/data/packed_format.h"
#include "common/status_macros.h"
#include "common/storage/storage.h"

namespace pstrain::data {

// ---- Synthetic ------------------------------------------------------------------

absl::StatusOr<DatasetSplits> MakeSyntheticDataset(const pstrain::v1::SyntheticSpec& spec) {
  if (spec.channels() <= 0 || spec.height() <= 0 || spec.width() <= 0 ||
      spec.num_classes() < 2 || spec.train_samples() <= 0 || spec.test_samples() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "synthetic dataset needs channels, height, width, train_samples, test_samples > 0 and "
        "num_classes >= 2; got ", spec.channels(), "x", spec.height(), "x", spec.width(), ", ",
        spec.num_classes(), " classes, ", spec.train_samples(), "/", spec.test_samples(),
        " samples"));
  }
  const int64_t elements = int64_t{spec.channels()} * spec.height() * spec.width();
  if (elements * (spec.train_samples() + spec.test_samples()) > (int64_t{8} << 30)) {
    return absl::InvalidArgumentError("synthetic dataset larger than 8 GiB");
  }
  auto make = [&](int64_t samples, uint64_t stream) {
    ImageDataset ds;
    ds.channels = spec.channels();
    ds.height = spec.height();
    ds.width = spec.width();
    ds.num_classes = spec.num_classes();
    ds.pixels.resize(samples * elements);
    ds.labels.resize(samples);
    const uint64_t seed = MixSeed(spec.seed(), stream);
    for (int64_t i = 0; i < samples * elements; ++i) {
      ds.pixels[i] = static_cast<uint8_t>(MixSeed(seed, i) >> 56);
    }
    for (int64_t i = 0; i < samples; ++i) {
      ds.labels[i] = static_cast<int32_t>(MixSeed(seed ^ 0x1abe1, i) % spec.num_classes());
    }
    return ds;
  };
  DatasetSplits splits;
  splits.train = make(spec.train_samples(), 1);
  splits.test = make(spec.test_samples(), 2);
  return splits;
}

// ---- LoadDataset ----------------------------------------------------------------

absl::StatusOr<DatasetSplits> LoadDataset(const pstrain::v1::DatasetSpec& spec) {
  std::unique_ptr<storage::Storage> local = storage::NewLocalStorage();
  return LoadDataset(spec, *local);
}

absl::StatusOr<DatasetSplits> LoadDataset(const pstrain::v1::DatasetSpec& spec,
                                          storage::Storage& store) {
  if (storage::IsS3Uri(spec.path()) && spec.format() != pstrain::v1::DATASET_FORMAT_PACKED &&
      spec.format() != pstrain::v1::DATASET_FORMAT_BSON &&
      spec.format() != pstrain::v1::DATASET_FORMAT_IMAGE_FOLDER) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset ", spec.path(), ": ", pstrain::v1::DatasetFormat_Name(spec.format()),
        " is read from local paths only; from an object store pstrain reads packed shards, "
        "image folders and BSON dumps (pack others into the store with `pstrain prepare "
        "--out s3://...`)"));
  }
  if (spec.path().empty() && spec.format() != pstrain::v1::DATASET_FORMAT_SYNTHETIC) {
    return absl::InvalidArgumentError("dataset path is empty");
  }
  if (spec.train_limit() < 0 || spec.test_limit() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("dataset train_limit (", spec.train_limit(),
                                                   ") and test_limit (", spec.test_limit(),
                                                   ") must be >= 0"));
  }
  DatasetSplits splits;
  switch (spec.format()) {
    case pstrain::v1::DATASET_FORMAT_IDX: {
      PSTRAIN_ASSIGN_OR_RETURN(splits, LoadIdxDataset(spec.path()));
      break;
    }
    case pstrain::v1::DATASET_FORMAT_CIFAR10: {
      PSTRAIN_ASSIGN_OR_RETURN(splits, LoadCifar10Dataset(spec.path()));
      break;
    }
    case pstrain::v1::DATASET_FORMAT_IMAGE_FOLDER: {
      if (spec.image_height() <= 0 || spec.image_width() <= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "image-folder dataset ", spec.path(), " needs image_height and image_width > 0, got ",
            spec.image_height(), "x", spec.image_width()));
      }
      ImageFolderOptions options;
      options.height = spec.image_height();
      options.width = spec.image_width();
      options.channels = spec.image_channels() > 0 ? spec.image_channels() : 3;
      options.threads = spec.loader_threads() > 0 ? spec.loader_threads() : 1;
      PSTRAIN_ASSIGN_OR_RETURN(splits, LoadImageFolderDataset(spec.path(), options, &store));
      break;
    }
    case pstrain::v1::DATASET_FORMAT_SYNTHETIC: {
      PSTRAIN_ASSIGN_OR_RETURN(splits, MakeSyntheticDataset(spec.synthetic()));
      break;
    }
    case pstrain::v1::DATASET_FORMAT_PACKED: {
      if (spec.shuffle_window_mib() < 0 || spec.shuffle_window_mib() > kMaxShuffleWindowMib) {
        return absl::InvalidArgumentError(absl::StrCat("dataset shuffle_window_mib must be in [0, ",
                                                       kMaxShuffleWindowMib, "] (0: 256), got ",
                                                       spec.shuffle_window_mib()));
      }
      // From a store, each worker reads the chunks its epochs hold; a local
      // directory is mapped.
      PackedReadOptions options;
      options.stream = storage::IsS3Uri(spec.path());
      if (spec.shuffle_window_mib() > 0) {
        options.window_bytes = int64_t{spec.shuffle_window_mib()} << 20;
      }
      PSTRAIN_ASSIGN_OR_RETURN(splits, LoadPackedDataset(spec.path(), store, options));
      break;
    }
    case pstrain::v1::DATASET_FORMAT_BSON: {
      if (spec.image_height() <= 0 || spec.image_width() <= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "BSON dataset ", spec.path(), " needs image_height and image_width > 0, got ",
            spec.image_height(), "x", spec.image_width()));
      }
      if (spec.max_bad_records() < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "dataset max_bad_records must be >= 0, got ", spec.max_bad_records()));
      }
      BsonDecodeOptions options;
      options.channels = spec.image_channels() > 0 ? spec.image_channels() : 3;
      options.height = spec.image_height();
      options.width = spec.image_width();
      options.max_bad_records = spec.max_bad_records();
      PSTRAIN_ASSIGN_OR_RETURN(splits, LoadBsonDataset(spec.path(), options, spec.train_limit(),
                                                       spec.test_limit(), &store));
      break;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dataset ", spec.path(), ": unsupported format ",
                       pstrain::v1::DatasetFormat_Name(spec.format())));
  }
  splits.train.Truncate(spec.train_limit());
  splits.test.Truncate(spec.test_limit());
  const ImageDataset& a = splits.train;
  const ImageDataset& b = splits.test;
  if (a.channels != b.channels || a.height != b.height || a.width != b.width) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset ", spec.path(), ": train images are ", a.channels, "x", a.height, "x", a.width,
        " but test images are ", b.channels, "x", b.height, "x", b.width));
  }
  const int num_classes = std::max(a.num_classes, b.num_classes);
  splits.train.num_classes = num_classes;
  splits.test.num_classes = num_classes;
  PSTRAIN_RETURN_IF_ERROR(splits.train.Validate(absl::StrCat(spec.path(), " (train split)")));
  PSTRAIN_RETURN_IF_ERROR(splits.test.Validate(absl::StrCat(spec.path(), " (test split)")));
  return splits;
}

}  // namespace pstrain::data
