// PaceLeadTuner: see pace_lead_tuner.h.
#include "server/pace_lead_tuner.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pstrain {
namespace {

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

}  // namespace

PaceLeadTuner::PaceLeadTuner(Options options)
    : options_(std::move(options)),
      trial_steps_(static_cast<int64_t>(options_.rounds) * options_.block_steps *
                   static_cast<int64_t>(options_.leads.size())),
      chosen_(static_cast<int>(options_.leads.size()) - 1),
      samples_(options_.leads.size()) {}

int PaceLeadTuner::TrialCandidate(int64_t version) const {
  if (version < options_.first_trial) return -1;
  const int64_t phase = (version - options_.first_trial) % options_.period;
  if (phase >= trial_steps_) return -1;
  const int64_t block = phase / options_.block_steps;
  return static_cast<int>(block % static_cast<int64_t>(options_.leads.size()));
}

int PaceLeadTuner::LeadFor(int64_t version) const {
  const int candidate = TrialCandidate(version);
  return options_.leads[candidate >= 0 ? candidate : chosen_];
}

bool PaceLeadTuner::StepTook(int64_t version, absl::Duration duration) {
  const int candidate = TrialCandidate(version);
  if (candidate < 0) return false;
  const int64_t phase = (version - options_.first_trial) % options_.period;
  const int64_t start = version - phase;
  if (start != trial_start_) {
    trial_start_ = start;
    for (std::vector<double>& s : samples_) s.clear();
  }
  // Inside the block: the steps before and after ran with the same lead.
  if (const int64_t in_block = phase % options_.block_steps;
      in_block > 0 && in_block < options_.block_steps - 1) {
    samples_[candidate].push_back(absl::ToDoubleMilliseconds(duration));
  }
  if (phase != trial_steps_ - 1) return false;
  Choose();
  return true;
}

void PaceLeadTuner::Choose() {
  const int n = static_cast<int>(samples_.size());
  std::vector<double> medians(n);
  trial_summary_.clear();
  bool complete = true;
  for (int c = 0; c < n; ++c) {
    absl::StrAppend(&trial_summary_, c > 0 ? ", " : "", "lead ", options_.leads[c], ": ");
    if (samples_[c].empty()) {
      complete = false;
      absl::StrAppend(&trial_summary_, "not timed");
      continue;
    }
    medians[c] = Median(samples_[c]);
    absl::StrAppend(&trial_summary_, absl::StrFormat("%.1f ms", medians[c]));
  }
  if (complete) {
    const int best =
        static_cast<int>(std::min_element(medians.begin(), medians.end()) - medians.begin());
    if (medians[best] < medians[chosen_]) chosen_ = best;
  }
  absl::StrAppend(&trial_summary_, "; chose ", options_.leads[chosen_],
                  complete ? "" : " (kept: a candidate was not timed)");
  for (std::vector<double>& s : samples_) s.clear();
}

}  // namespace pstrain
