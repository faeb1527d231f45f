#include "server/epoch_planner.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pstrain {

namespace {
// Positions of one epoch beyond this are refused (bounds what a request can
// make the planner compute; far above any real dataset).
constexpr int64_t kMaxEpochLength = int64_t{1} << 40;
}  // namespace

int64_t EpochPlanner::FirstStep(int epoch, int64_t base_steps) const {
  if (epoch != start_.start_epoch || base_steps <= 0) return 0;
  const int64_t into = start_.start_step - static_cast<int64_t>(epoch) * base_steps;
  return into > 0 && into < base_steps ? into : 0;
}

absl::StatusOr<v1::EpochPlanResponse> EpochPlanner::Plan(const std::string& worker, int epoch,
                                                         int64_t epoch_length, bool share_done,
                                                         int tails_done,
                                                         const std::vector<std::string>& members) {
  if (epoch < start_.start_epoch || epoch >= start_.epochs) {
    return absl::InvalidArgumentError(absl::StrCat("epoch ", epoch, " is outside this run's [",
                                                   start_.start_epoch, ", ", start_.epochs, ")"));
  }
  if (epoch_length <= 0 || epoch_length > kMaxEpochLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("epoch length ", epoch_length, " is outside [1, ", kMaxEpochLength, "]"));
  }
  if (epoch_length_ != 0 && epoch_length != epoch_length_) {
    return absl::InvalidArgumentError(absl::StrCat("epoch length ", epoch_length,
                                                   " differs from the ", epoch_length_,
                                                   " the other members train"));
  }
  if (tails_done < 0) {
    return absl::InvalidArgumentError(absl::StrCat("tails_done ", tails_done, " is negative"));
  }
  auto it = epochs_.find(epoch);
  if (it == epochs_.end()) {
    if (members.empty()) {
      return absl::FailedPreconditionError("the job has no members to plan an epoch for");
    }
    Epoch plan;
    plan.members = members;
    plan.base_steps =
        data::BaseSteps(epoch_length, static_cast<int>(members.size()), start_.batch_size);
    if (epoch_length / static_cast<int64_t>(members.size()) < start_.batch_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("an epoch of ", epoch_length, " samples over ", members.size(),
                       " workers is less than one batch of ", start_.batch_size, " each"));
    }
    epoch_length_ = epoch_length;
    it = epochs_.emplace(epoch, std::move(plan)).first;
    std::vector<data::WorkRange> unplaced = std::move(unplaced_);
    unplaced_.clear();
    for (const data::WorkRange& range : unplaced) Give(range, it->second, it->second.members);
  }
  Epoch& plan = it->second;
  auto member = std::find(plan.members.begin(), plan.members.end(), worker);
  if (member == plan.members.end() || lost_.count(worker) > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(worker, " is not in the plan of epoch ", epoch));
  }
  v1::EpochPlanResponse response;
  response.set_rank(static_cast<int32_t>(member - plan.members.begin()));
  response.set_world_size(static_cast<int32_t>(plan.members.size()));
  response.set_base_steps(plan.base_steps);
  const std::vector<data::WorkSegment>& tails = plan.tails[worker];
  for (const data::WorkSegment& t : tails) {
    v1::WorkSegment* out = response.add_tails();
    out->set_epoch(t.range.epoch);
    out->set_begin(t.range.begin);
    out->set_end(t.range.end);
    out->set_steps(t.steps);
  }
  if (share_done && static_cast<size_t>(tails_done) >= tails.size()) plan.ended.insert(worker);
  return response;
}

void EpochPlanner::RecordTrained(const std::string& worker, int epoch, int64_t samples) {
  if (lost_.count(worker) > 0 || epoch < 0 || epoch >= start_.epochs || samples < 0) return;
  // A member trains at most its share plus tails; bound what one report can claim.
  const int64_t bound = epoch_length_ > 0 ? 2 * epoch_length_ : kMaxEpochLength;
  int64_t& count = trained_[worker][epoch];
  count = std::max(count, std::min(samples, bound));
}

std::vector<data::WorkSegment> EpochPlanner::SegmentsOf(const Epoch& e, int epoch,
                                                        const std::string& worker) const {
  std::vector<data::WorkSegment> segments;
  const auto member = std::find(e.members.begin(), e.members.end(), worker);
  if (member == e.members.end()) return segments;
  const int rank = static_cast<int>(member - e.members.begin());
  segments.push_back(
      {data::BaseRange(epoch_length_, epoch, rank, static_cast<int>(e.members.size())),
       e.base_steps});
  if (auto t = e.tails.find(worker); t != e.tails.end()) {
    segments.insert(segments.end(), t->second.begin(), t->second.end());
  }
  return segments;
}

int64_t EpochPlanner::TailSteps(const Epoch& e) const {
  int64_t most = 0;
  for (const auto& [worker, tails] : e.tails) {
    int64_t steps = 0;
    for (const data::WorkSegment& t : tails) steps += t.steps;
    most = std::max(most, steps);
  }
  return most;
}

void EpochPlanner::Give(const data::WorkRange& range, Epoch& plan,
                        const std::vector<std::string>& receivers) {
  if (range.size() == 0) return;
  if (receivers.empty()) {
    unplaced_.push_back(range);
    return;
  }
  std::vector<data::WorkRange> pieces = data::SplitRange(range, static_cast<int>(receivers.size()));
  int64_t smallest = range.size();
  for (data::WorkRange& piece : pieces) {
    // Barrier modes: every receiver takes a step (an empty piece would leave
    // the others waiting), so a piece trains the range's first sample again.
    if (piece.size() == 0 && start_.barrier) piece = {range.epoch, range.begin, range.begin + 1};
    smallest = std::min(smallest, piece.size());
  }
  for (size_t i = 0; i < receivers.size(); ++i) {
    if (pieces[i].size() == 0) continue;
    const int64_t steps =
        data::GroupSteps(start_.barrier ? smallest : pieces[i].size(), start_.batch_size);
    plan.tails[receivers[i]].push_back({pieces[i], steps});
  }
}

void EpochPlanner::MemberLost(const std::string& worker, int64_t steps,
                              const std::vector<std::string>& survivors) {
  if (!lost_.insert(worker).second) return;
  std::map<int, int64_t> trained;
  int64_t left = std::max<int64_t>(0, steps);
  for (auto& [number, plan] : epochs_) {
    const std::vector<data::WorkSegment> segments = SegmentsOf(plan, number, worker);
    if (segments.empty()) continue;
    const int64_t skip = FirstStep(number, plan.base_steps);
    int64_t total = 0;
    for (const data::WorkSegment& s : segments) {
      total += data::StepCount(s.range.size(), s.steps);
    }
    const int64_t used = std::min(left + skip, total);
    left = std::max<int64_t>(0, left - (used - skip));
    const data::WorkProgress progress = data::ProgressThrough(segments, used, start_.batch_size);
    for (const data::WorkRange& r : progress.trained) trained[r.epoch] += r.size();
    plan.ended.insert(worker);
    for (const data::WorkRange& r : progress.left) {
      // The survivors still in this epoch take it; else those of a later
      // epoch already planned; else the next epoch planned.
      bool given = false;
      for (auto next = epochs_.find(number); next != epochs_.end() && !given; ++next) {
        std::vector<std::string> open;
        for (const std::string& s : survivors) {
          const Epoch& e = next->second;
          if (std::find(e.members.begin(), e.members.end(), s) != e.members.end() &&
              e.ended.count(s) == 0 && lost_.count(s) == 0) {
            open.push_back(s);
          }
        }
        if (open.empty()) continue;
        Give(r, next->second, open);
        given = true;
      }
      if (!given) unplaced_.push_back(r);
    }
  }
  trained_[worker] = std::move(trained);
}

std::map<int, int64_t> EpochPlanner::TrainedSamples() const {
  std::map<int, int64_t> total;
  for (const auto& [worker, by_epoch] : trained_) {
    for (const auto& [epoch, samples] : by_epoch) total[epoch] += samples;
  }
  return total;
}

std::pair<int, int64_t> EpochPlanner::PositionOfVersion(int64_t version) const {
  auto it = epochs_.find(start_.start_epoch);
  if (it == epochs_.end()) return {-1, 0};
  int64_t cursor = start_.start_step - FirstStep(start_.start_epoch, it->second.base_steps);
  int number = start_.start_epoch;
  for (; it != epochs_.end() && it->first == number; ++it, ++number) {
    const Epoch& e = it->second;
    if (version < cursor + e.base_steps) return {number, std::max<int64_t>(0, version - cursor)};
    cursor += e.base_steps + TailSteps(e);
    if (version < cursor) return {number + 1, 0};
  }
  return {number, 0};
}

}  // namespace pstrain
