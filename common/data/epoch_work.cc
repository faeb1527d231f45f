#include "common/data/epoch_work.h"

#include <algorithm>

namespace pstrain::data {

WorkRange BaseRange(int64_t epoch_length, int epoch, int rank, int world_size) {
  WorkRange range;
  range.epoch = epoch;
  if (epoch_length <= 0 || world_size <= 0 || rank < 0 || rank >= world_size) return range;
  const int64_t share = epoch_length / world_size, extra = epoch_length % world_size;
  range.begin = rank * share + std::min<int64_t>(rank, extra);
  range.end = range.begin + share + (rank < extra ? 1 : 0);
  return range;
}

int64_t BaseSteps(int64_t epoch_length, int world_size, int batch) {
  if (epoch_length <= 0 || world_size <= 0) return 0;
  return GroupSteps(epoch_length / world_size, batch);
}

int64_t GroupSteps(int64_t smallest, int batch) {
  if (smallest <= 0 || batch <= 0) return 0;
  return std::max<int64_t>(1, smallest / batch);
}

std::vector<int64_t> BatchEnds(int64_t size, int64_t steps, int batch) {
  std::vector<int64_t> ends;
  if (size <= 0 || steps <= 0 || batch <= 0) return ends;
  steps = std::min(steps, size);
  ends.reserve(static_cast<size_t>(steps));
  for (int64_t s = 1; s < steps; ++s) ends.push_back(std::min(size, s * batch));
  ends.push_back(size);
  return ends;
}

int64_t StepCount(int64_t size, int64_t steps) {
  if (size <= 0 || steps <= 0) return 0;
  return std::min(steps, size);
}

int64_t SamplesAfter(int64_t size, int64_t steps, int batch, int64_t k) {
  const int64_t count = StepCount(size, steps);
  if (k <= 0 || count == 0 || batch <= 0) return 0;
  if (k >= count) return size;
  return std::min(size, k * batch);
}

std::vector<WorkRange> SplitRange(const WorkRange& range, int parts) {
  std::vector<WorkRange> pieces;
  if (parts <= 0) return pieces;
  const int64_t n = range.size();
  for (int p = 0; p < parts; ++p) {
    WorkRange piece = BaseRange(n, range.epoch, p, parts);
    piece.begin += range.begin;
    piece.end += range.begin;
    if (n == 0) piece.begin = piece.end = range.begin;
    pieces.push_back(piece);
  }
  return pieces;
}

WorkProgress ProgressThrough(const std::vector<WorkSegment>& segments, int64_t steps_done,
                             int batch) {
  WorkProgress progress;
  int64_t left = std::max<int64_t>(0, steps_done);
  for (const WorkSegment& segment : segments) {
    const int64_t steps = StepCount(segment.range.size(), segment.steps);
    const int64_t used = std::min(left, steps);
    left -= used;
    progress.steps_used += used;
    const int64_t done = SamplesAfter(segment.range.size(), segment.steps, batch, used);
    WorkRange trained = segment.range, rest = segment.range;
    trained.end = rest.begin = segment.range.begin + done;
    if (trained.size() > 0) progress.trained.push_back(trained);
    if (rest.size() > 0) progress.left.push_back(rest);
    progress.trained_samples += done;
  }
  return progress;
}

}  // namespace pstrain::data
