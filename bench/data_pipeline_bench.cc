// data_pipeline_bench: samples/s into the training pipeline from a JPEG image
// folder against the packed shards `pstrain prepare` makes from it, in the
// same run, and what preparing once costs.
//
//   ./build/bin/data_pipeline_bench --train=20000 --size=64 --reps=5
//
// The image folder is made from real Fashion-MNIST images (the first --train
// training and --test test images, upscaled to --size x --size RGB, JPEG
// quality 90, one directory per class) under --dir. Then:
//   prepare  LoadDataset(folder) + WritePackedDataset, once (what
//            `pstrain prepare` does);
//   rounds   alternating, --reps each after a warm-up: LoadDataset of the
//            folder (decode + resize with --threads decoders, the job's
//            loader_threads) or of the packed shards, then one epoch of
//            batches through the worker's DataPrefetcher on the CPU backend.
// Printed: medians of the load alone and of load + one epoch, as samples/s,
// and their ratio. Files are read from the page cache in every round (both
// formats alike); a cold read would favour the packed shards further only
// if the disk, not the decoder, were the bottleneck.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/data/dataset.h"
#include "common/data/load_dataset.h"
#include "common/data/image_codec.h"
#include "common/data/packed_format.h"
#include "kernels/backend.h"
#include "worker/data_prefetcher.h"

ABSL_FLAG(int, train, 20000, "Training images in the folder");
ABSL_FLAG(int, test, 2000, "Test images in the folder");
ABSL_FLAG(int, size, 64, "Image side in the folder (Fashion-MNIST upscaled, RGB)");
ABSL_FLAG(int, threads, 1, "Decoder threads for the image folder (a job's loader_threads)");
ABSL_FLAG(int, reps, 5, "Measured rounds per variant (after one warm-up)");
ABSL_FLAG(std::string, dir, "/tmp/pstrain-data-bench", "Scratch directory (removed at the end)");
ABSL_FLAG(std::string, fashion_mnist, "/usr/share/datasets/fashion-mnist", "IDX source");

namespace pstrain {
namespace {

namespace fs = std::filesystem;

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "data_pipeline_bench: %s\n", std::string(s.message()).c_str());
  return 1;
}

// Writes `count` images of `src` as JPEGs under dir/<label>/.
absl::Status WriteFolder(const data::ImageDataset& src, int64_t count, int side,
                         const fs::path& dir) {
  for (int c = 0; c < src.num_classes; ++c) fs::create_directories(dir / std::to_string(c));
  for (int64_t i = 0; i < count; ++i) {
    data::DecodedImage image;
    image.width = image.height = side;
    image.channels = 3;
    image.pixels.resize(static_cast<size_t>(side) * side * 3);
    const uint8_t* p = src.image(i);
    for (int y = 0; y < side; ++y) {
      for (int x = 0; x < side; ++x) {
        const uint8_t v = p[(y * src.height / side) * src.width + x * src.width / side];
        for (int ch = 0; ch < 3; ++ch) image.pixels[(y * side + x) * 3 + ch] = v;
      }
    }
    absl::StatusOr<std::string> jpeg = data::EncodeJpeg(image, 90);
    if (!jpeg.ok()) return jpeg.status();
    std::ofstream(dir / std::to_string(src.labels[i]) / absl::StrFormat("%06d.jpg", i),
                  std::ios::binary)
        << *jpeg;
  }
  return absl::OkStatus();
}

// Samples of one epoch through the prefetcher (batch 64, one thread).
absl::StatusOr<int64_t> OneEpoch(Backend* backend, const data::DatasetSplits& splits,
                                 const v1::DatasetSpec& spec) {
  absl::StatusOr<data::Preprocess> pre = data::Preprocess::FromSpec(spec, splits.train.channels);
  if (!pre.ok()) return pre.status();
  PrefetchOptions options;
  options.batch_size = 64;
  absl::StatusOr<std::unique_ptr<DataPrefetcher>> prefetcher =
      DataPrefetcher::Create(backend, &splits.train, *pre, options);
  if (!prefetcher.ok()) return prefetcher.status();
  if (absl::Status s = (*prefetcher)->StartEpoch(0); !s.ok()) return s;
  int64_t samples = 0;
  for (;;) {
    absl::StatusOr<DeviceBatch> batch = (*prefetcher)->Next();
    if (!batch.ok()) return batch.status();
    if (batch->n == 0) break;
    samples += batch->n;
  }
  return samples;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Run() {
  const fs::path root = absl::GetFlag(FLAGS_dir);
  const fs::path folder = root / "jpeg";
  const fs::path packed = root / "packed";
  const int side = absl::GetFlag(FLAGS_size);
  fs::remove_all(root);

  v1::DatasetSpec idx;
  idx.set_format(v1::DATASET_FORMAT_IDX);
  idx.set_path(absl::GetFlag(FLAGS_fashion_mnist));
  absl::StatusOr<data::DatasetSplits> source = data::LoadDataset(idx);
  if (!source.ok()) return Fail(source.status());
  const int64_t train = std::min<int64_t>(absl::GetFlag(FLAGS_train), source->train.size());
  const int64_t test = std::min<int64_t>(absl::GetFlag(FLAGS_test), source->test.size());
  if (absl::Status s = WriteFolder(source->train, train, side, folder / "train"); !s.ok()) {
    return Fail(s);
  }
  if (absl::Status s = WriteFolder(source->test, test, side, folder / "test"); !s.ok()) {
    return Fail(s);
  }
  int64_t jpeg_bytes = 0;
  for (const auto& e : fs::recursive_directory_iterator(folder)) {
    if (e.is_regular_file()) jpeg_bytes += static_cast<int64_t>(e.file_size());
  }

  v1::DatasetSpec folder_spec;
  folder_spec.set_format(v1::DATASET_FORMAT_IMAGE_FOLDER);
  folder_spec.set_path(folder.string());
  folder_spec.set_image_height(side);
  folder_spec.set_image_width(side);
  folder_spec.set_loader_threads(absl::GetFlag(FLAGS_threads));
  v1::DatasetSpec packed_spec;
  packed_spec.set_format(v1::DATASET_FORMAT_PACKED);
  packed_spec.set_path(packed.string());

  // Prepare once.
  const absl::Time p0 = absl::Now();
  absl::StatusOr<data::DatasetSplits> decoded = data::LoadDataset(folder_spec);
  if (!decoded.ok()) return Fail(decoded.status());
  absl::StatusOr<data::PackSummary> summary =
      data::WritePackedDataset(*decoded, packed.string(), {});
  if (!summary.ok()) return Fail(summary.status());
  const double prepare_s = absl::ToDoubleSeconds(absl::Now() - p0);
  decoded = absl::StatusOr<data::DatasetSplits>();

  std::unique_ptr<Backend> backend = CreateCpuBackend();
  std::vector<double> load[2], total[2];
  const char* names[2] = {"JPEG image folder", "packed shards"};
  const v1::DatasetSpec* specs[2] = {&folder_spec, &packed_spec};
  const int reps = absl::GetFlag(FLAGS_reps);
  for (int round = 0; round <= reps; ++round) {
    for (int v = 0; v < 2; ++v) {
      const absl::Time t0 = absl::Now();
      absl::StatusOr<data::DatasetSplits> splits = data::LoadDataset(*specs[v]);
      if (!splits.ok()) return Fail(splits.status());
      const absl::Time t1 = absl::Now();
      absl::StatusOr<int64_t> samples = OneEpoch(backend.get(), *splits, *specs[v]);
      if (!samples.ok()) return Fail(samples.status());
      const absl::Time t2 = absl::Now();
      if (*samples != train) {
        return Fail(absl::InternalError(absl::StrCat(names[v], ": epoch of ", *samples)));
      }
      if (round == 0) continue;  // Warm-up.
      const double all = static_cast<double>(train + test);
      load[v].push_back(all / absl::ToDoubleSeconds(t1 - t0));
      total[v].push_back(static_cast<double>(train) / absl::ToDoubleSeconds(t2 - t0));
    }
  }
  std::printf(
      "data_pipeline_bench: %lld train + %lld test Fashion-MNIST images as %dx%d RGB JPEG "
      "(%.1f MB) vs packed (%.1f MB, %d+%d shards); decoder threads %d; medians of %d rounds\n",
      static_cast<long long>(train), static_cast<long long>(test), side, side, jpeg_bytes / 1e6,
      summary->bytes / 1e6, summary->train_shards, summary->test_shards,
      absl::GetFlag(FLAGS_threads), reps);
  for (int v = 0; v < 2; ++v) {
    std::printf("  %-18s load %10.0f samples/s   load + one epoch of batches %9.0f samples/s\n",
                names[v], Median(load[v]), Median(total[v]));
  }
  std::printf("  packed / JPEG: load %.1fx, load + epoch %.1fx\n",
              Median(load[1]) / Median(load[0]), Median(total[1]) / Median(total[0]));
  std::printf("  prepare once (decode the folder, write the shards): %.2f s = %.0f samples/s\n",
              prepare_s, static_cast<double>(train + test) / prepare_s);
  fs::remove_all(root);
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pstrain::Run();
}
