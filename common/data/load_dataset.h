// Loading a dataset described by a job's DatasetSpec: one entry point above
// every reader (IDX, CIFAR-10, image folders, packed shards, synthetic).
//
//   PSTRAIN_ASSIGN_OR_RETURN(data::DatasetSplits splits, data::LoadDataset(job.dataset()));
//   // splits.train and splits.test share one image shape and num_classes.
//
// To add a format: write its reader against image_dataset.h alone, then add
// one case to LoadDataset's dispatch in load_dataset.cc.
//
// Threads: free functions without shared state; thread-safe.
#ifndef PSTRAIN_COMMON_DATA_LOAD_DATASET_H_
#define PSTRAIN_COMMON_DATA_LOAD_DATASET_H_

#include "absl/status/statusor.h"
#include "common/data/image_dataset.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain::storage {
class Storage;
}  // namespace pstrain::storage

namespace pstrain::data {

// Random pixels and labels of the given shape (benchmarks only). Errors for
// non-positive sizes.
absl::StatusOr<DatasetSplits> MakeSyntheticDataset(const pstrain::v1::SyntheticSpec& spec);

// Loads the train and test splits described by `spec`, dispatching on
// spec.format(); applies train_limit / test_limit; checks that both splits
// have the same image shape, gives both the same num_classes (the larger of
// the two), and that every label is below it. Errors name the file, and the
// byte offset for corrupt or truncated data.
absl::StatusOr<DatasetSplits> LoadDataset(const pstrain::v1::DatasetSpec& spec);

// Largest DatasetSpec.shuffle_window_mib.
inline constexpr int kMaxShuffleWindowMib = 65536;

// The same with paths read through `store`: packed shards may then be at an
// s3:// prefix (other formats from an s3:// path are INVALID_ARGUMENT, with
// the way to pack them). Packed shards at an s3:// prefix are streamed
// (PackedReadOptions::stream, the spec's shuffle_window_mib): the splits'
// stores then read through `store`, which must outlive them.
absl::StatusOr<DatasetSplits> LoadDataset(const pstrain::v1::DatasetSpec& spec,
                                          storage::Storage& store);

}  // namespace pstrain::data

#endif  // PSTRAIN_COMMON_DATA_LOAD_DATASET_H_
