// DataPrefetcher: background threads assemble training batches (shuffle,
// shard, normalise, augment) into pinned host buffers ahead of the trainer;
// Next() enqueues the host-to-device copy and hands back device pointers.
//
//   PrefetchOptions options;
//   options.batch_size = 64;
//   options.rank = rank;
//   options.world_size = world_size;
//   PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<DataPrefetcher> prefetcher,
//                            DataPrefetcher::Create(backend, &splits.train, preprocess, options));
//   for (int epoch = 0; epoch < epochs; ++epoch) {
//     PSTRAIN_RETURN_IF_ERROR(prefetcher->StartEpoch(epoch));
//     while (true) {
//       PSTRAIN_ASSIGN_OR_RETURN(DeviceBatch batch, prefetcher->Next());
//       if (batch.n == 0) break;  // End of the epoch.
//       ... Forward(batch.images, batch.labels, batch.n) ...
//     }
//   }
//
// Pipeline: producer threads take batch indices in order, each with a free
// buffer from a pool of `prefetch_batches` pinned buffers, and fill it with
// data::AssembleBatch. Next() takes the oldest batch (batches come out in
// order whatever the thread count), copies it into one of two device buffers
// (alternating, so the copy for batch k+1 never lands on batch k), records an
// event after the copy and gives the pinned buffer back to the pool only once
// that event has been waited on (at the following Next()/StartEpoch()).
#ifndef PSTRAIN_WORKER_DATA_PREFETCHER_H_
#define PSTRAIN_WORKER_DATA_PREFETCHER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/data/dataset.h"
#include "kernels/backend.h"

namespace pstrain {

struct PrefetchOptions {
  int batch_size = 64;       // > 0.
  int prefetch_batches = 4;  // Pinned buffers in the pool; 0 means 4.
  int threads = 1;           // Assembling threads; 0 means 1.
  uint64_t seed = 0;         // Shuffle and augmentation seed.
  int rank = 0;              // This worker's shard, in [0, world_size).
  int world_size = 1;        // > 0.
  bool shuffle = true;       // Per-epoch permutation (else dataset order).
  bool augment = false;      // Apply the Preprocess flip/crop.
  bool drop_last = false;    // Skip the final partial batch of the shard.
  // Class-balanced epochs (data::BalancedEpochSamples): the epoch is the
  // oversampled list, shuffled and sharded instead of [0, size()).
  bool balance = false;
  // Largest batch StartSamples may ask for (buffers are sized for it);
  // 0 means batch_size.
  int max_batch = 0;
  int next_timeout_ms = 60000;  // Longest Next() waits for a batch; > 0.
};

// One batch on the device: n images (float NCHW, normalised) and n int32
// labels. The pointers are device pointers owned by the prefetcher and stay
// valid until the next call to Next() or StartEpoch(). n == 0: end of epoch.
struct DeviceBatch {
  int n = 0;
  const float* images = nullptr;
  const int32_t* labels = nullptr;
};

// Threads: Create, StartEpoch, Next, last_wait_seconds, queue_depth and the
// destructor are called from one thread, the one that owns `backend` (the
// trainer's); only that thread touches the backend. The prefetcher's own
// threads read the dataset and write pinned memory only. `backend` and
// `dataset` must outlive the prefetcher.
class DataPrefetcher {
 public:
  // Checks the options (and preprocess against the dataset's channels),
  // allocates the pinned pool and the two device buffers, and starts the
  // threads (idle until StartEpoch).
  static absl::StatusOr<std::unique_ptr<DataPrefetcher>> Create(
      Backend* backend, const data::ImageDataset* dataset, data::Preprocess preprocess,
      PrefetchOptions options);

  DataPrefetcher(const DataPrefetcher&) = delete;
  DataPrefetcher& operator=(const DataPrefetcher&) = delete;
  // Stops and joins the threads (also mid-epoch) and waits for the copies
  // still reading pinned memory.
  ~DataPrefetcher();

  // Begins epoch `epoch` (order from data::EpochOrder(size, seed, epoch, rank,
  // world_size, shuffle), through data::BalancedEpochSamples with
  // `balance`) at batch `first_batch` (a resumed run: the batches
  // before it were trained already). May be called before the previous
  // epoch is exhausted; its remaining batches are dropped. INVALID_ARGUMENT
  // for a first batch outside [0, batches_per_epoch()].
  absl::Status StartEpoch(int epoch, int64_t first_batch = 0);

  // Begins an explicit list of batches: batch b holds samples[ends[b-1],
  // ends[b]) (dataset indices; ends ascending, the last = samples.size(),
  // no batch larger than max_batch). `aug_key` seeds the augmentation (give
  // every list its own). Next() returns them, then n == 0. Replaces what
  // StartEpoch or an earlier call began.
  absl::Status StartSamples(uint64_t aug_key, std::vector<int64_t> samples,
                            std::vector<int64_t> ends);

  // Batches Next() returns per epoch (before the n == 0 one).
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  // Samples in this rank's shard per epoch (with drop_last, the final
  // samples_per_epoch() % batch_size of them are not delivered).
  int64_t samples_per_epoch() const { return samples_per_epoch_; }

  // Waits (up to next_timeout_ms, then DEADLINE_EXCEEDED) for the next batch,
  // enqueues its host-to-device copy and returns the device pointers; n == 0
  // once the epoch is exhausted. FAILED_PRECONDITION before StartEpoch; the
  // error of a store's read (data::SampleStore::Acquire) for a batch whose
  // pixels could not be fetched.
  absl::StatusOr<DeviceBatch> Next();

  // Seconds the latest Next() waited for a batch to be assembled.
  double last_wait_seconds() const { return last_wait_seconds_; }
  // Batches of the current epoch assembled and not yet taken by Next().
  int queue_depth() const;

 private:
  DataPrefetcher(Backend* backend, const data::ImageDataset* dataset, data::Preprocess preprocess,
                 PrefetchOptions options);

  // Allocates buffers and starts the threads.
  absl::Status Init();
  // The producer threads' loop.
  void AssembleLoop();
  // Waits on the oldest pending copy events until at most `keep` remain and
  // returns their pinned buffers to the pool.
  absl::Status ReleaseCopiedBuffers(size_t keep = 0);
  // Makes `order` and `ends` the current work, from batch `first_batch`.
  void Begin(uint64_t aug_key, std::vector<int64_t> order, std::vector<int64_t> ends,
             int64_t first_batch);

  // Constant after construction.
  Backend* const backend_;
  const data::ImageDataset* const dataset_;
  const data::Preprocess preprocess_;
  const PrefetchOptions options_;
  const int64_t epoch_length_;  // Samples in one epoch over every rank.
  const int64_t samples_per_epoch_;
  const int64_t batches_per_epoch_;
  const int max_batch_;
  const size_t image_bytes_;         // Per batch of max_batch_.
  const size_t label_offset_bytes_;  // Labels' offset inside a pinned buffer.
  // Constant after Init(): the pool (slot i's contents belong to whoever
  // holds index i: a producer, the ready map, or the in-flight list), the
  // double-buffered device batch, and the threads.
  std::vector<PinnedBuffer> pinned_;
  DeviceBuffer device_images_[2];
  DeviceBuffer device_labels_[2];
  std::vector<std::thread> threads_;

  // Used only by the owner thread.
  struct InFlight {
    std::unique_ptr<Event> copied;
    int slot;
  };
  std::vector<InFlight> in_flight_;
  bool epoch_started_ = false;
  int64_t next_to_take_ = 0;   // Next batch index Next() returns.
  // The current work's batch ends (also read by producers, under mu_).
  std::shared_ptr<const std::vector<int64_t>> owner_ends_;
  int device_slot_ = 0;        // Device buffer of the latest batch.
  double last_wait_seconds_ = 0;

  mutable absl::Mutex mu_;
  absl::CondVar work_cv_;   // Producers: work, a free slot, or shutdown.
  absl::CondVar ready_cv_;  // Owner: a batch became ready.
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  bool epoch_active_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // Bumped by StartEpoch.
  uint64_t aug_key_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<const std::vector<int64_t>> order_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const std::vector<int64_t>> ends_ ABSL_GUARDED_BY(mu_);
  int64_t next_to_assemble_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int> free_slots_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, int> ready_ ABSL_GUARDED_BY(mu_);  // Batch index -> slot.
  std::map<int64_t, absl::Status> failed_ ABSL_GUARDED_BY(mu_);  // Batches whose pixels failed.
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_DATA_PREFETCHER_H_
