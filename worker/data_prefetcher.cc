#include "worker/data_prefetcher.h"

#include <algorithm>
#include <cstddef>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

constexpr size_t kPinnedAlignment = 64;

size_t RoundUp(size_t bytes, size_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

PrefetchOptions WithDefaults(PrefetchOptions options) {
  if (options.prefetch_batches == 0) options.prefetch_batches = 4;
  if (options.threads == 0) options.threads = 1;
  if (options.max_batch < options.batch_size) options.max_batch = options.batch_size;
  return options;
}

absl::Status CheckOptions(const PrefetchOptions& options) {
  if (options.batch_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefetch: batch_size must be > 0, got ", options.batch_size));
  }
  if (options.prefetch_batches < 0 || options.prefetch_batches > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefetch: prefetch_batches must be in [0, 1024], got ", options.prefetch_batches));
  }
  if (options.threads < 0 || options.threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefetch: threads must be in [0, 256], got ", options.threads));
  }
  if (options.world_size <= 0 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("prefetch: rank ", options.rank,
                                                   " is outside [0, world_size = ",
                                                   options.world_size, ")"));
  }
  if (options.max_batch < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefetch: max_batch must be >= 0, got ", options.max_batch));
  }
  if (options.next_timeout_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefetch: next_timeout_ms must be > 0, got ", options.next_timeout_ms));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPrefetcher>> DataPrefetcher::Create(
    Backend* backend, const data::ImageDataset* dataset, data::Preprocess preprocess,
    PrefetchOptions options) {
  if (backend == nullptr || dataset == nullptr) {
    return absl::InvalidArgumentError("prefetch: backend and dataset must not be null");
  }
  options = WithDefaults(options);
  PSTRAIN_RETURN_IF_ERROR(CheckOptions(options));
  PSTRAIN_RETURN_IF_ERROR(dataset->Validate("prefetch dataset"));
  PSTRAIN_RETURN_IF_ERROR(preprocess.Validate(dataset->channels));
  std::unique_ptr<DataPrefetcher> prefetcher(
      new DataPrefetcher(backend, dataset, std::move(preprocess), options));
  PSTRAIN_RETURN_IF_ERROR(prefetcher->Init());
  return prefetcher;
}

DataPrefetcher::DataPrefetcher(Backend* backend, const data::ImageDataset* dataset,
                               data::Preprocess preprocess, PrefetchOptions options)
    : backend_(backend),
      dataset_(dataset),
      preprocess_(std::move(preprocess)),
      options_(options),
      epoch_length_(options.balance
                        ? data::BalancedEpochLength(dataset->labels, dataset->num_classes)
                        : dataset->size()),
      samples_per_epoch_(data::ShardSize(epoch_length_, options.rank, options.world_size)),
      batches_per_epoch_(options.drop_last
                             ? samples_per_epoch_ / options.batch_size
                             : (samples_per_epoch_ + options.batch_size - 1) / options.batch_size),
      max_batch_(options.max_batch),
      image_bytes_(static_cast<size_t>(options.max_batch) * dataset->sample_elements() *
                   sizeof(float)),
      label_offset_bytes_(RoundUp(image_bytes_, kPinnedAlignment)) {}

absl::Status DataPrefetcher::Init() {
  const size_t label_bytes = static_cast<size_t>(max_batch_) * sizeof(int32_t);
  for (int i = 0; i < options_.prefetch_batches; ++i) {
    PSTRAIN_ASSIGN_OR_RETURN(PinnedBuffer buffer,
                             backend_->AllocatePinned(label_offset_bytes_ + label_bytes));
    pinned_.push_back(std::move(buffer));
  }
  for (int d = 0; d < 2; ++d) {
    PSTRAIN_ASSIGN_OR_RETURN(device_images_[d], backend_->Allocate(image_bytes_));
    PSTRAIN_ASSIGN_OR_RETURN(device_labels_[d], backend_->Allocate(label_bytes));
  }
  {
    absl::MutexLock lock(&mu_);
    for (int i = options_.prefetch_batches - 1; i >= 0; --i) free_slots_.push_back(i);
  }
  for (int t = 0; t < options_.threads; ++t) threads_.emplace_back([this] { AssembleLoop(); });
  return absl::OkStatus();
}

DataPrefetcher::~DataPrefetcher() {
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    work_cv_.SignalAll();
    ready_cv_.SignalAll();
  }
  for (std::thread& t : threads_) t.join();
  // Copies may still read pinned memory; the buffers are freed only after.
  for (InFlight& copy : in_flight_) copy.copied->Wait().IgnoreError();
  in_flight_.clear();
}

void DataPrefetcher::AssembleLoop() {
  while (true) {
    int64_t batch = 0;
    int slot = 0;
    uint64_t generation = 0;
    uint64_t aug_key = 0;
    std::shared_ptr<const std::vector<int64_t>> order, ends;
    {
      absl::MutexLock lock(&mu_);
      while (!shutdown_ &&
             !(epoch_active_ && next_to_assemble_ < static_cast<int64_t>(ends_->size()) &&
               !free_slots_.empty())) {
        work_cv_.Wait(&mu_);
      }
      if (shutdown_) return;
      batch = next_to_assemble_++;
      slot = free_slots_.back();
      free_slots_.pop_back();
      generation = generation_;
      aug_key = aug_key_;
      order = order_;
      ends = ends_;
    }

    // Outside the lock: slot `slot` belongs to this thread until handed back.
    const int64_t begin = batch == 0 ? 0 : (*ends)[static_cast<size_t>(batch - 1)];
    const int n = static_cast<int>((*ends)[static_cast<size_t>(batch)] - begin);
    auto idx = absl::MakeConstSpan(*order).subspan(static_cast<size_t>(begin), n);
    const uint64_t aug_seed = data::MixSeed(aug_key, static_cast<uint64_t>(batch));
    char* base = static_cast<char*>(pinned_[slot].data());
    // Pixels in a store are fetched here (the store reads ahead of the plan
    // Begin gave it); a read that fails ends the epoch with its error.
    absl::StatusOr<std::shared_ptr<const void>> lease = dataset_->Acquire(idx.data(), idx.size());
    if (lease.ok()) {
      data::AssembleBatch(*dataset_, idx, preprocess_, options_.augment, aug_seed,
                          reinterpret_cast<float*>(base),
                          reinterpret_cast<int32_t*>(base + label_offset_bytes_));
      lease->reset();
    }

    absl::MutexLock lock(&mu_);
    if (generation == generation_ && !lease.ok()) {
      failed_.emplace(batch, lease.status());
      free_slots_.push_back(slot);
      ready_cv_.SignalAll();
    } else if (generation == generation_) {
      ready_.emplace(batch, slot);
      ready_cv_.SignalAll();
    } else {  // StartEpoch ran meanwhile: this batch is stale.
      free_slots_.push_back(slot);
      work_cv_.Signal();
    }
  }
}

absl::Status DataPrefetcher::ReleaseCopiedBuffers(size_t keep) {
  absl::Status status;
  std::vector<int> released;
  size_t done = 0;
  for (; done + keep < in_flight_.size(); ++done) {
    InFlight& copy = in_flight_[done];
    absl::Status waited = copy.copied->Wait();
    if (!waited.ok() && status.ok()) status = waited;
    released.push_back(copy.slot);
  }
  in_flight_.erase(in_flight_.begin(), in_flight_.begin() + static_cast<std::ptrdiff_t>(done));
  if (!released.empty()) {
    absl::MutexLock lock(&mu_);
    free_slots_.insert(free_slots_.end(), released.begin(), released.end());
    work_cv_.SignalAll();
  }
  return status;
}

absl::Status DataPrefetcher::StartEpoch(int epoch, int64_t first_batch) {
  if (first_batch < 0 || first_batch > batches_per_epoch_) {
    return absl::InvalidArgumentError(absl::StrCat("prefetch: first batch ", first_batch,
                                                   " is outside [0, ", batches_per_epoch_, "]"));
  }
  PSTRAIN_RETURN_IF_ERROR(ReleaseCopiedBuffers());
  std::vector<int64_t> positions = data::EpochOrder(
      epoch_length_, options_.seed, epoch, options_.rank, options_.world_size, options_.shuffle);
  if (options_.balance) {
    const std::vector<int64_t> samples =
        data::BalancedEpochSamples(dataset_->labels, dataset_->num_classes, options_.seed, epoch);
    for (int64_t& p : positions) p = samples[static_cast<size_t>(p)];
  }
  std::vector<int64_t> ends;
  ends.reserve(static_cast<size_t>(batches_per_epoch_));
  for (int64_t b = 1; b <= batches_per_epoch_; ++b) {
    ends.push_back(std::min<int64_t>(b * options_.batch_size, samples_per_epoch_));
  }
  const uint64_t aug_key = data::MixSeed(data::MixSeed(options_.seed, static_cast<uint64_t>(epoch)),
                                         static_cast<uint64_t>(options_.rank));
  Begin(aug_key, std::move(positions), std::move(ends), first_batch);
  return absl::OkStatus();
}

absl::Status DataPrefetcher::StartSamples(uint64_t aug_key, std::vector<int64_t> samples,
                                          std::vector<int64_t> ends) {
  int64_t previous = 0;
  for (int64_t end : ends) {
    if (end <= previous || end - previous > max_batch_) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefetch: batch ends must ascend in steps of 1..", max_batch_, " samples"));
    }
    previous = end;
  }
  if (previous != static_cast<int64_t>(samples.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefetch: the batches cover ", previous, " samples of ", samples.size()));
  }
  for (int64_t index : samples) {
    if (index < 0 || index >= dataset_->size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefetch: sample ", index, " is outside the dataset"));
    }
  }
  PSTRAIN_RETURN_IF_ERROR(ReleaseCopiedBuffers());
  Begin(data::MixSeed(options_.seed, aug_key), std::move(samples), std::move(ends), 0);
  return absl::OkStatus();
}

void DataPrefetcher::Begin(uint64_t aug_key, std::vector<int64_t> order, std::vector<int64_t> ends,
                           int64_t first_batch) {
  if (dataset_->store != nullptr) {  // A store that fetches reads ahead of the batches.
    const size_t skip =
        first_batch == 0 ? 0 : static_cast<size_t>(ends[static_cast<size_t>(first_batch - 1)]);
    dataset_->store->Plan(
        std::vector<int64_t>(order.begin() + std::min(skip, order.size()), order.end()));
  }
  auto shared_order = std::make_shared<const std::vector<int64_t>>(std::move(order));
  owner_ends_ = std::make_shared<const std::vector<int64_t>>(std::move(ends));
  {
    absl::MutexLock lock(&mu_);
    ++generation_;
    aug_key_ = aug_key;
    order_ = std::move(shared_order);
    ends_ = owner_ends_;
    next_to_assemble_ = first_batch;
    epoch_active_ = true;
    for (const auto& [batch, slot] : ready_) free_slots_.push_back(slot);
    ready_.clear();
    failed_.clear();
    work_cv_.SignalAll();
  }
  epoch_started_ = true;
  next_to_take_ = first_batch;
  last_wait_seconds_ = 0;
}

absl::StatusOr<DeviceBatch> DataPrefetcher::Next() {
  if (!epoch_started_) {
    return absl::FailedPreconditionError("prefetch: Next() called before StartEpoch()");
  }
  // A batch's copy is enqueued before its compute, so the copy of the batch
  // before last finished when the step before that did. Waiting for that one
  // (not the last) lets the caller queue a second step while the device runs
  // the first. A pool of one buffer cannot spare it.
  PSTRAIN_RETURN_IF_ERROR(ReleaseCopiedBuffers(
      std::min<size_t>(1, static_cast<size_t>(options_.prefetch_batches - 1))));
  last_wait_seconds_ = 0;
  if (next_to_take_ >= static_cast<int64_t>(owner_ends_->size())) return DeviceBatch{};

  const int64_t batch = next_to_take_;
  int slot = 0;
  {
    const absl::Time start = absl::Now();
    const absl::Time deadline = start + absl::Milliseconds(options_.next_timeout_ms);
    absl::MutexLock lock(&mu_);
    while (!shutdown_ && ready_.find(batch) == ready_.end()) {
      if (auto failed = failed_.find(batch); failed != failed_.end()) {
        last_wait_seconds_ = absl::ToDoubleSeconds(absl::Now() - start);
        return failed->second;
      }
      if (ready_cv_.WaitWithDeadline(&mu_, deadline) && ready_.find(batch) == ready_.end() &&
          failed_.find(batch) == failed_.end()) {
        last_wait_seconds_ = absl::ToDoubleSeconds(absl::Now() - start);
        const std::string pending =
            dataset_->store != nullptr ? dataset_->store->Pending() : std::string();
        return absl::DeadlineExceededError(absl::StrCat(
            "prefetch: batch ", batch, " was not ready within ", options_.next_timeout_ms, " ms",
            pending.empty() ? "" : absl::StrCat(" (", pending, ")")));
      }
    }
    if (shutdown_) return absl::CancelledError("prefetch: shutting down");
    auto it = ready_.find(batch);
    slot = it->second;
    ready_.erase(it);
    last_wait_seconds_ = absl::ToDoubleSeconds(absl::Now() - start);
  }

  const int64_t begin = batch == 0 ? 0 : (*owner_ends_)[static_cast<size_t>(batch - 1)];
  const int n = static_cast<int>((*owner_ends_)[static_cast<size_t>(batch)] - begin);
  device_slot_ ^= 1;
  const char* base = static_cast<const char*>(pinned_[slot].data());
  absl::Status copied = backend_->CopyHostToDevice(
      device_images_[device_slot_].data(), base,
      static_cast<size_t>(n) * dataset_->sample_elements() * sizeof(float));
  if (copied.ok()) {
    copied = backend_->CopyHostToDevice(device_labels_[device_slot_].data(),
                                        base + label_offset_bytes_,
                                        static_cast<size_t>(n) * sizeof(int32_t));
  }
  absl::StatusOr<std::unique_ptr<Event>> event =
      copied.ok() ? backend_->RecordEvent() : absl::StatusOr<std::unique_ptr<Event>>(copied);
  if (!event.ok()) {
    // The failed copy may still touch the buffer; wait for the device before
    // reusing it.
    backend_->Synchronize().IgnoreError();
    absl::MutexLock lock(&mu_);
    free_slots_.push_back(slot);
    work_cv_.Signal();
    return event.status();
  }
  in_flight_.push_back({*std::move(event), slot});
  ++next_to_take_;

  DeviceBatch out;
  out.n = n;
  out.images = static_cast<const float*>(device_images_[device_slot_].data());
  out.labels = static_cast<const int32_t*>(device_labels_[device_slot_].data());
  return out;
}

int DataPrefetcher::queue_depth() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(ready_.size());
}

}  // namespace pstrain
