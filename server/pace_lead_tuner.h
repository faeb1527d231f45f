// PaceLeadTuner: chooses a sync job's push pacing lead by measuring.
//
//   PaceLeadTuner tuner({});                 // Leads 1 and 2.
//   int lead = tuner.LeadFor(version);       // When a step's pushes start.
//   tuner.StepTook(version, step_duration);  // When the next step starts.
//
// The lead (ParameterShard::Options::pace_lead_frames) is how many frames a
// member's push may run ahead of the slowest member's at a shard. A lead of
// one frame scales best where the links are the bottleneck: every member's
// frames reach the shard in step, so each chunk completes, and its pull can
// start, as early as the link allows. It costs a credit round trip per frame,
// which a lead of two hides, and where the hosts' cores are the bottleneck
// that round trip is long and two is faster (docs/BENCHMARKS.md, "The lead
// chosen by measuring"). Neither is right everywhere, so a job measures:
//
//  * Trials. At versions first_trial, first_trial + period, ... a trial
//    runs: rounds * leads.size() blocks of block_steps steps, the candidate
//    leads taking turns block by block (1 1 1 1 2 2 2 2 1 1 1 1 2 2 2 2).
//    Only the steps inside a block are timed, neither the first nor the
//    last: a step's lead most likely also changes when the next step's
//    first frame reaches this shard (how close together the members start,
//    where in the push this shard's chunks come), so a step is timed only
//    when the steps on either side ran with its lead. Taking turns step by
//    step split the shards' choices where blocks did not (docs/
//    BENCHMARKS.md, "The lead chosen by measuring"). The schedule depends
//    on the version alone, so all shards of a job try the same lead in the
//    same step and each sees what the lead of every shard does to the step.
//  * The choice. When the trial's last step has ended, the candidate
//    whose median step time was shortest becomes the lead of the following
//    steps (a tie keeps the lead chosen before). Until the first trial ends,
//    and when a trial misses a candidate's steps (a job restored mid-trial,
//    versions skipped), the lead stays the one chosen before: at first the
//    last candidate. Shards choose alone, each from its own timing of the
//    same steps: they can disagree only where the candidates' times are
//    within the noise of each other, where the choice matters least (a
//    margin that a new choice had to beat split the shards of one job
//    where the difference was near it).
//
// A step's time, as the shard sees it, is from the first push of its version
// to the first push of the next: the pull, the compute and the push of one
// step, of which the lead changes only the push.
//
// Thread-safety: none; the owner serialises calls (PushPacer::mu_).
#ifndef PSTRAIN_SERVER_PACE_LEAD_TUNER_H_
#define PSTRAIN_SERVER_PACE_LEAD_TUNER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace pstrain {

class PaceLeadTuner {
 public:
  struct Options {
    std::vector<int> leads = {1, 2};  // Candidates (> 0), in the order tried.
    // A job's first versions run with the last candidate untimed: their
    // steps open connections and allocate.
    int64_t first_trial = 2;
    int block_steps = 4;   // Steps a candidate runs in turn (>= 3).
    int rounds = 2;        // Blocks of each candidate in a trial.
    int64_t period = 256;  // Versions from one trial's start to the next.
  };
  // Options are assumed valid (leads non-empty and positive, block_steps
  // >= 3, rounds >= 1, period >= the trial's steps).
  explicit PaceLeadTuner(Options options);

  // The lead for pushes of `version`.
  int LeadFor(int64_t version) const;
  // Step `version` took `duration`. True when this ended a trial and the
  // choice was made again (see trial_summary()).
  bool StepTook(int64_t version, absl::Duration duration);

  int chosen() const { return options_.leads[chosen_]; }
  // The last trial, for the log: each candidate's median step time and the
  // lead chosen, e.g. "lead 1: 5102.4 ms, lead 2: 5420.0 ms; chose 1";
  // empty until a trial has ended.
  const std::string& trial_summary() const { return trial_summary_; }

 private:
  // The candidate (index into leads) `version` runs in a trial, or -1.
  int TrialCandidate(int64_t version) const;
  void Choose();

  const Options options_;
  const int64_t trial_steps_;
  int chosen_;                                // Index into options_.leads.
  int64_t trial_start_ = -1;                  // The trial whose samples_ are held.
  std::vector<std::vector<double>> samples_;  // Per candidate: step ms.
  std::string trial_summary_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_PACE_LEAD_TUNER_H_
