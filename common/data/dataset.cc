#include "common/data/dataset.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pstrain::data {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

uint64_t Finalize(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// SplitMix64 (Steele, Lea, Flood 2014): a fixed, portable generator.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    state_ += kGolden;
    return Finalize(state_);
  }
  // Uniform in [0, range), range > 0, without modulo bias (Lemire 2019).
  uint64_t Below(uint64_t range) {
    unsigned __int128 m = static_cast<unsigned __int128>(Next()) * range;
    uint64_t low = static_cast<uint64_t>(m);
    if (low < range) {
      const uint64_t threshold = (0 - range) % range;
      while (low < threshold) {
        m = static_cast<unsigned __int128>(Next()) * range;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }

 private:
  uint64_t state_;
};

// The normalisation value for channel c: one value broadcasts.
float ChannelValue(const std::vector<float>& values, int c, float fallback) {
  if (values.empty()) return fallback;
  return values.size() == 1 ? values[0] : values[c];
}

absl::Status CheckPerChannel(const std::vector<float>& values, const char* what, int channels,
                             bool positive) {
  if (!values.empty() && values.size() != 1 && values.size() != static_cast<size_t>(channels)) {
    return absl::InvalidArgumentError(absl::StrCat("dataset ", what, " has ", values.size(),
                                                   " values; expected 0, 1 or ", channels,
                                                   " (one per channel)"));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i]) || (positive && values[i] <= 0.f)) {
      return absl::InvalidArgumentError(absl::StrCat("dataset ", what, "[", i, "] = ", values[i],
                                                     positive ? " must be finite and > 0"
                                                              : " must be finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t MixSeed(uint64_t seed, uint64_t index) { return Finalize(seed + (index + 1) * kGolden); }

// ---- Order and shards -------------------------------------------------------------

int64_t ShardSize(int64_t n, int rank, int world_size) {
  if (n <= 0 || world_size <= 0 || rank < 0 || rank >= world_size) return 0;
  return n / world_size + (rank < n % world_size ? 1 : 0);
}

std::vector<int64_t> EpochOrder(int64_t n, uint64_t seed, int epoch, int rank, int world_size,
                                bool shuffle) {
  const int64_t count = ShardSize(n, rank, world_size);
  if (count == 0) return {};
  const int64_t begin = rank * (n / world_size) + std::min<int64_t>(rank, n % world_size);
  if (!shuffle) {
    std::vector<int64_t> order(count);
    for (int64_t i = 0; i < count; ++i) order[i] = begin + i;
    return order;
  }
  std::vector<int64_t> perm(n);
  for (int64_t i = 0; i < n; ++i) perm[i] = i;
  SplitMix64 rng(MixSeed(seed, static_cast<uint64_t>(static_cast<int64_t>(epoch))));
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rng.Below(static_cast<uint64_t>(i) + 1));
    std::swap(perm[i], perm[j]);
  }
  return std::vector<int64_t>(perm.begin() + begin, perm.begin() + begin + count);
}

std::vector<int64_t> ChunkedEpochOrder(const std::vector<int64_t>& samples,
                                       const SampleStore::Chunks& chunks, uint64_t seed,
                                       int epoch) {
  const size_t count = chunks.starts.size();
  if (count == 0) return samples;
  std::vector<std::vector<int64_t>> by_chunk(count);
  for (int64_t s : samples) {
    const size_t c = static_cast<size_t>(
        std::upper_bound(chunks.starts.begin(), chunks.starts.end(), s) - chunks.starts.begin());
    by_chunk[c == 0 ? 0 : c - 1].push_back(s);
  }
  SplitMix64 rng(MixSeed(MixSeed(seed ^ 0xc4u, static_cast<uint64_t>(epoch)), count));
  std::vector<size_t> perm(count);
  for (size_t c = 0; c < count; ++c) perm[c] = c;
  for (size_t i = count - 1; i > 0; --i) std::swap(perm[i], perm[rng.Below(i + 1)]);
  const size_t window = static_cast<size_t>(std::max<int64_t>(1, chunks.window_chunks));
  std::vector<int64_t> order;
  order.reserve(samples.size());
  for (size_t w = 0; w < count; w += window) {
    const size_t begin = order.size();
    for (size_t k = w; k < std::min(count, w + window); ++k) {
      order.insert(order.end(), by_chunk[perm[k]].begin(), by_chunk[perm[k]].end());
    }
    for (size_t i = order.size() - begin; i > 1; --i) {
      std::swap(order[begin + i - 1], order[begin + rng.Below(i)]);
    }
  }
  return order;
}

std::vector<int64_t> TrainingOrder(const ImageDataset& ds, int64_t epoch_length, bool balance,
                                   uint64_t seed, int epoch) {
  std::vector<int64_t> order = EpochOrder(epoch_length, seed, epoch, 0, 1, /*shuffle=*/true);
  std::vector<int64_t> samples;
  if (balance) {
    samples = BalancedEpochSamples(ds.labels, ds.num_classes, seed, epoch);
    for (int64_t& p : order) p = samples[static_cast<size_t>(p)];
  }
  const SampleStore::Chunks* chunks = ds.store != nullptr ? ds.store->chunks() : nullptr;
  if (chunks == nullptr) return order;
  const int64_t spanned =
      std::lower_bound(chunks->starts.begin(), chunks->starts.end(), ds.size()) -
      chunks->starts.begin();
  if (spanned <= chunks->window_chunks) return order;  // One window: shuffled whole.
  if (!balance) {
    samples.resize(static_cast<size_t>(epoch_length));
    for (int64_t i = 0; i < epoch_length; ++i) samples[i] = i;
  }
  return ChunkedEpochOrder(samples, *chunks, seed, epoch);
}

namespace {

// Sample indices of each class (empty for a class that has none).
std::vector<std::vector<int64_t>> IndicesByClass(const std::vector<int32_t>& labels,
                                                 int num_classes) {
  std::vector<std::vector<int64_t>> by_class(static_cast<size_t>(std::max(num_classes, 0)));
  for (size_t i = 0; i < labels.size(); ++i) {
    const int32_t c = labels[i];
    if (c >= 0 && c < num_classes) by_class[c].push_back(static_cast<int64_t>(i));
  }
  return by_class;
}

}  // namespace

int64_t BalancedEpochLength(const std::vector<int32_t>& labels, int num_classes) {
  int64_t largest = 0, present = 0;
  for (const std::vector<int64_t>& members : IndicesByClass(labels, num_classes)) {
    largest = std::max<int64_t>(largest, static_cast<int64_t>(members.size()));
    present += !members.empty();
  }
  return largest * present;
}

std::vector<int64_t> BalancedEpochSamples(const std::vector<int32_t>& labels, int num_classes,
                                          uint64_t seed, int epoch) {
  const std::vector<std::vector<int64_t>> by_class = IndicesByClass(labels, num_classes);
  size_t largest = 0;
  for (const std::vector<int64_t>& members : by_class) largest = std::max(largest, members.size());
  std::vector<int64_t> samples;
  samples.reserve(static_cast<size_t>(BalancedEpochLength(labels, num_classes)));
  for (size_t c = 0; c < by_class.size(); ++c) {
    std::vector<int64_t> members = by_class[c];
    if (members.empty()) continue;
    for (size_t copy = 0; copy < largest / members.size(); ++copy) {
      samples.insert(samples.end(), members.begin(), members.end());
    }
    // The rest: the first (largest mod k) of a seeded partial shuffle.
    const size_t rest = largest % members.size();
    SplitMix64 rng(MixSeed(MixSeed(seed ^ 0xba1a, static_cast<uint64_t>(epoch)), c));
    for (size_t i = 0; i < rest; ++i) {
      const size_t j = i + static_cast<size_t>(rng.Below(members.size() - i));
      std::swap(members[i], members[j]);
      samples.push_back(members[i]);
    }
  }
  return samples;
}

// ---- Preprocess ---------------------------------------------------------------------

absl::Status Preprocess::Validate(int channels) const {
  if (channels <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("channels must be > 0, got ", channels));
  }
  PSTRAIN_RETURN_IF_ERROR(CheckPerChannel(mean, "mean", channels, /*positive=*/false));
  PSTRAIN_RETURN_IF_ERROR(CheckPerChannel(std, "std", channels, /*positive=*/true));
  if (crop_padding < 0 || crop_padding > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("augmentation crop_padding must be in [0, 1024], got ", crop_padding));
  }
  return absl::OkStatus();
}

absl::StatusOr<Preprocess> Preprocess::FromSpec(const pstrain::v1::DatasetSpec& spec,
                                                int channels) {
  Preprocess pre;
  pre.mean.assign(spec.mean().begin(), spec.mean().end());
  pre.std.assign(spec.std().begin(), spec.std().end());
  pre.random_flip = spec.augmentation().random_flip();
  pre.crop_padding = spec.augmentation().crop_padding();
  PSTRAIN_RETURN_IF_ERROR(pre.Validate(channels));
  return pre;
}

// ---- AssembleBatch ---------------------------------------------------------------------

void AssembleBatch(const ImageDataset& ds, absl::Span<const int64_t> idx, const Preprocess& pre,
                   bool augment, uint64_t aug_seed, float* images_out, int32_t* labels_out) {
  const int channels = ds.channels, height = ds.height, width = ds.width;
  const int64_t plane = int64_t{height} * width;
  const int64_t sample = ds.sample_elements();
  // x = (p / 255 - mean) / std = p * scale + bias.
  std::vector<float> scale(channels), bias(channels);
  for (int c = 0; c < channels; ++c) {
    const float m = ChannelValue(pre.mean, c, 0.f);
    const float s = ChannelValue(pre.std, c, 1.f);
    scale[c] = 1.f / (255.f * s);
    bias[c] = -m / s;
  }
  const int pad = augment ? pre.crop_padding : 0;
  for (size_t j = 0; j < idx.size(); ++j) {
    const uint8_t* src = ds.image(idx[j]);
    float* dst = images_out + static_cast<int64_t>(j) * sample;
    labels_out[j] = ds.labels[idx[j]];
    bool flip = false;
    int offset_y = pad, offset_x = pad;  // Offsets into the padded image.
    if (augment) {
      const uint64_t draw = 3 * static_cast<uint64_t>(j);
      flip = pre.random_flip && (MixSeed(aug_seed, draw) >> 63) != 0;
      if (pad > 0) {
        offset_y = static_cast<int>(MixSeed(aug_seed, draw + 1) % (2 * pad + 1));
        offset_x = static_cast<int>(MixSeed(aug_seed, draw + 2) % (2 * pad + 1));
      }
    }
    if (!flip && offset_y == pad && offset_x == pad) {
      for (int c = 0; c < channels; ++c) {
        const uint8_t* in = src + c * plane;
        float* out = dst + c * plane;
        for (int64_t k = 0; k < plane; ++k) out[k] = in[k] * scale[c] + bias[c];
      }
      continue;
    }
    // Output (y, x) reads the cropped image at (y, flip ? W-1-x : x), which is
    // source pixel (y + offset_y - pad, x' + offset_x - pad), or zero outside.
    for (int c = 0; c < channels; ++c) {
      const uint8_t* in = src + c * plane;
      float* out = dst + c * plane;
      for (int y = 0; y < height; ++y) {
        const int sy = y + offset_y - pad;
        for (int x = 0; x < width; ++x) {
          const int sx = (flip ? width - 1 - x : x) + offset_x - pad;
          const bool inside = sy >= 0 && sy < height && sx >= 0 && sx < width;
          const uint8_t p = inside ? in[int64_t{sy} * width + sx] : 0;
          out[int64_t{y} * width + x] = p * scale[c] + bias[c];
        }
      }
    }
  }
}

}  // namespace pstrain::data
