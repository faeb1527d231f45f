// Per-epoch sample order (shuffle + shard) and batch assembly with
// normalisation and augmentation, over the in-memory datasets of
// image_dataset.h (loaded by load_dataset.h).
//
//   PSTRAIN_ASSIGN_OR_RETURN(data::DatasetSplits splits, data::LoadDataset(job.dataset()));
//   PSTRAIN_ASSIGN_OR_RETURN(data::Preprocess pre,
//                            data::Preprocess::FromSpec(job.dataset(), splits.train.channels));
//   std::vector<int64_t> order = data::EpochOrder(splits.train.size(), job.seed(), epoch,
//                                                 rank, world_size, /*shuffle=*/true);
//   data::AssembleBatch(splits.train, absl::MakeConstSpan(order).subspan(0, 64), pre,
//                       /*augment=*/true, batch_seed, images, labels);
//
// Everything here is deterministic: the same inputs give the same bytes on
// every machine, so that workers agree on shards and runs are reproducible.
#ifndef PSTRAIN_COMMON_DATA_DATASET_H_
#define PSTRAIN_COMMON_DATA_DATASET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/data/image_dataset.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain::data {

// The sample order of one epoch for one worker. When `shuffle`, a
// Fisher-Yates permutation of [0, n) driven by SplitMix64 seeded from
// (seed, epoch); otherwise the identity. The permutation is then cut into
// `world_size` contiguous shards whose sizes differ by at most one (the first
// n % world_size shards get one extra sample) and shard `rank` is returned.
// Shards of one (seed, epoch) are disjoint and cover [0, n). The result is the
// same on every machine and standard library. Returns an empty vector when
// n <= 0, world_size <= 0 or rank is outside [0, world_size).
std::vector<int64_t> EpochOrder(int64_t n, uint64_t seed, int epoch, int rank, int world_size,
                                bool shuffle);

// Number of samples EpochOrder returns for `rank` (without building it).
int64_t ShardSize(int64_t n, int rank, int world_size);

// Class-balanced epochs (BALANCE_OVERSAMPLE). The samples of one epoch in
// which every class present in `labels` (values in [0, num_classes)) comes
// M times, M the largest class's count: a class of k samples contributes
// each of them floor(M / k) times plus M mod k of them drawn without
// replacement from (seed, epoch, class). Grouped by class, in index order
// within a copy; EpochOrder(size(), ...) then shuffles and shards positions
// in it. The same on every machine.
std::vector<int64_t> BalancedEpochSamples(const std::vector<int32_t>& labels, int num_classes,
                                          uint64_t seed, int epoch);
// Its length, the same for every epoch: M x the classes present.
int64_t BalancedEpochLength(const std::vector<int32_t>& labels, int num_classes);

// An epoch's order of `samples` (dataset indices; repeats allowed, as in a
// balanced epoch) for a store read in chunks (SampleStore::Chunks): the
// samples grouped by chunk, the chunks in a random order from (seed,
// epoch), cut into windows of chunks.window_chunks chunks, and each
// window's samples shuffled. The same on every machine. A range of its
// positions touches the chunks of few windows, so a worker's share of an
// epoch reads about its share of the bytes.
std::vector<int64_t> ChunkedEpochOrder(const std::vector<int64_t>& samples,
                                       const SampleStore::Chunks& chunks, uint64_t seed, int epoch);

// The training order of an epoch of `epoch_length` positions over `ds`
// (every rank's, in one list; ranks take ranges of it): EpochOrder's
// permutation, through BalancedEpochSamples with `balance`. For a store
// read in chunks whose first `ds.size()` samples span more than one window,
// ChunkedEpochOrder of the same samples instead.
std::vector<int64_t> TrainingOrder(const ImageDataset& ds, int64_t epoch_length, bool balance,
                                   uint64_t seed, int epoch);

// How pixels become model inputs. A value type.
struct Preprocess {
  // Per-channel normalisation after scaling to [0, 1]: x = (x - mean[c]) / std[c].
  // One value applies to every channel; empty means mean 0 / std 1.
  std::vector<float> mean, std;
  // Augmentation (only applied when AssembleBatch is asked to augment).
  bool random_flip = false;  // Horizontal flip with probability 0.5.
  int crop_padding = 0;      // Random crop of the original size after zero padding.

  // Reads mean/std/augmentation from `spec` and validates them for images of
  // `channels` channels: mean and std each have 0, 1 or `channels` values,
  // every std is finite and > 0, every mean finite, 0 <= crop_padding <= 1024.
  static absl::StatusOr<Preprocess> FromSpec(const pstrain::v1::DatasetSpec& spec, int channels);
  // The checks FromSpec makes, for a Preprocess built by hand.
  absl::Status Validate(int channels) const;
};

// Writes idx.size() samples of `ds` as float NCHW into `images_out`
// (idx.size() * ds.sample_elements() floats) and their labels into
// `labels_out` (idx.size() values). Each pixel becomes p / 255, then
// (x - mean[c]) / std[c].
//
// When `augment`, sample j of the batch (its position in idx) is first
// cropped (if pre.crop_padding > 0: the image is padded with zero pixels, i.e.
// black before normalisation, by crop_padding on every side and an H x W
// window is taken at a random offset) and then flipped horizontally (if
// pre.random_flip, with probability 0.5). The random draws depend only on
// (aug_seed, j), so a batch is reproducible.
//
// Preconditions (programmer errors, not checked per call): every index is in
// [0, ds.size()), `pre.Validate(ds.channels)` is OK, and the outputs are
// large enough. Thread-safe for distinct outputs.
void AssembleBatch(const ImageDataset& ds, absl::Span<const int64_t> idx, const Preprocess& pre,
                   bool augment, uint64_t aug_seed, float* images_out, int32_t* labels_out);

// SplitMix64 finaliser of (seed, index); the one PRNG used by this module.
uint64_t MixSeed(uint64_t seed, uint64_t index);

}  // namespace pstrain::data

#endif  // PSTRAIN_COMMON_DATA_DATASET_H_
