// Epoch work: which samples of an epoch a worker trains, in which steps, and
// what is left of it when the worker is lost. Pure functions, the same on
// the coordinator (which plans and redistributes) and on the workers (which
// train the plan).
//
//   // Rank 1 of 3 in epoch 4 of a 60000-sample epoch at batch 64:
//   WorkRange base = BaseRange(60000, 4, 1, 3);           // positions [20000, 40000)
//   int64_t steps = BaseSteps(60000, 3, 64);              // 312, equal on every rank
//   std::vector<int64_t> ends = BatchEnds(base.size(), steps, 64);
//   // ends = {64, 128, ..., 19904, 20000}: the last step takes the rest.
//
// Positions index one epoch's sample order (data::EpochOrder over the whole
// epoch, world size 1; through data::BalancedEpochSamples with class
// balance), so a range means the same samples on every machine.
//
// Steps: a range of `size` samples trained in `steps` steps takes B samples
// per step and puts the rest (fewer than B more, or the whole range when it
// is smaller than B) in the last step, so that every sample is trained and
// every member of a group of ranges that differ by at most one sample runs
// the same number of steps (synchronous modes step together).
#ifndef PSTRAIN_COMMON_DATA_EPOCH_WORK_H_
#define PSTRAIN_COMMON_DATA_EPOCH_WORK_H_

#include <cstdint>
#include <vector>

namespace pstrain::data {

// Positions [begin, end) of epoch `epoch`'s order.
struct WorkRange {
  int epoch = 0;
  int64_t begin = 0, end = 0;
  int64_t size() const { return end > begin ? end - begin : 0; }
  friend bool operator==(const WorkRange& a, const WorkRange& b) {
    return a.epoch == b.epoch && a.begin == b.begin && a.end == b.end;
  }
};

// Rank `rank`'s contiguous share of an epoch of `epoch_length` positions
// (sizes differ by at most one; the first epoch_length % world_size ranks
// get the extra one). Empty for a rank outside [0, world_size).
WorkRange BaseRange(int64_t epoch_length, int epoch, int rank, int world_size);

// Steps every rank runs per epoch: the smallest share's size / batch (at
// least 1 when that share is not empty; 0 when it is).
int64_t BaseSteps(int64_t epoch_length, int world_size, int batch);

// Steps for a group of ranges whose smallest holds `smallest` samples:
// smallest / batch, at least 1; 0 only for an empty range.
int64_t GroupSteps(int64_t smallest, int batch);

// Cumulative sample counts after each of `steps` steps over `size` samples:
// B per step, the last step takes the rest. Empty when size or steps is 0.
// Requires size >= steps (every step trains at least one sample).
std::vector<int64_t> BatchEnds(int64_t size, int64_t steps, int batch);

// BatchEnds(size, steps, batch) without building it: how many steps there
// are, and the samples trained after the first `k` of them.
int64_t StepCount(int64_t size, int64_t steps);
int64_t SamplesAfter(int64_t size, int64_t steps, int batch, int64_t k);

// Splits `range` into `parts` contiguous pieces whose sizes differ by at most
// one (the first size % parts pieces are the larger). A piece may be empty
// when the range holds fewer than `parts` positions.
std::vector<WorkRange> SplitRange(const WorkRange& range, int parts);

// A range with the number of steps it is trained in.
struct WorkSegment {
  WorkRange range;
  int64_t steps = 0;
  friend bool operator==(const WorkSegment& a, const WorkSegment& b) {
    return a.range == b.range && a.steps == b.steps;
  }
};

// What `steps_done` steps over `segments` (trained in order) trained, and
// what is left. A segment part-way through is split at the end of its
// `steps_done`-th step.
struct WorkProgress {
  std::vector<WorkRange> trained;
  std::vector<WorkRange> left;
  int64_t trained_samples = 0;
  int64_t steps_used = 0;  // min(steps_done, total steps)
};
WorkProgress ProgressThrough(const std::vector<WorkSegment>& segments, int64_t steps_done,
                             int batch);

}  // namespace pstrain::data

#endif  // PSTRAIN_COMMON_DATA_EPOCH_WORK_H_
