// EpochPlanner: which samples each member of one run of a job trains in each
// epoch, so that every sample of an epoch is trained once even when members
// are lost. Owned by the coordinator's Job (one per run), called under the
// coordinator's lock; no I/O, no clock.
//
//   EpochPlanner planner({.start_epoch = 0, .start_step = 0, .batch_size = 64,
//                         .epochs = 10, .barrier = true});
//   // Each member asks at an epoch's start (freezing the epoch's member list
//   // at the first ask) and again once it trained what it was given:
//   PSTRAIN_ASSIGN_OR_RETURN(v1::EpochPlanResponse plan,
//                            planner.Plan("worker-1", /*epoch=*/0, /*epoch_length=*/60000,
//                                         /*share_done=*/false, /*tails_done=*/0,
//                                         {"worker-1", "worker-2"}));
//   // plan: rank 0 of 2, 468 base steps, no tails.
//   planner.MemberLost("worker-2", 100, {"worker-1"});  // it trained 100 steps
//   // worker-1's next ask returns worker-2's untrained samples as a tail.
//
// An epoch's plan: its members in rank order when the first member asked,
// each training data/epoch_work.h's BaseRange(rank, world size) in
// BaseSteps steps, then its tails in order. When a member is lost, the
// shards say how many steps of this run they hold from it; walking its
// plans from the run's start gives the positions it did not train. Each such
// range is split evenly among the survivors that have not ended that epoch
// (in the barrier modes that is every survivor, since none can end an epoch
// the lost member blocks) and appended to their tails; when every survivor
// has ended it (async and ssp), among the survivors of the next epoch that
// has open members, or of the next epoch planned. In the barrier modes each
// receiver gets a non-empty piece (a range shorter than the survivors is
// padded by training its first sample again) so that they step together.
//
// A member's epoch ends when it asks with every tail trained and no loss is
// pending (the coordinator answers `wait` while one is).
#ifndef PSTRAIN_SERVER_EPOCH_PLANNER_H_
#define PSTRAIN_SERVER_EPOCH_PLANNER_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/data/epoch_work.h"
#include "pstrain/v1/service.pb.h"

namespace pstrain {

class EpochPlanner {
 public:
  struct RunStart {
    int start_epoch = 0;     // Assignment.start_epoch of the run.
    int64_t start_step = 0;  // Assignment.start_step (data position).
    int batch_size = 1;
    int epochs = 1;       // JobSpec.epochs.
    bool barrier = true;  // sync or average mode: members step together.
  };
  explicit EpochPlanner(RunStart start) : start_(start) {}

  // `worker`'s plan for `epoch` (the first ask freezes the epoch with
  // `members`, the job's members in rank order). Ends the worker's epoch
  // when it trained its share (`share_done`) and tails_done covers its tails. INVALID_ARGUMENT for
  // an epoch outside the run, an epoch length that is not positive or differs from an earlier one;
  // FAILED_PRECONDITION for a worker not in the epoch's plan.
  absl::StatusOr<v1::EpochPlanResponse> Plan(const std::string& worker, int epoch,
                                             int64_t epoch_length, bool share_done, int tails_done,
                                             const std::vector<std::string>& members);

  // What `worker` says it trained so far in this run, per epoch (the
  // highest report counts; a lost member's count comes from MemberLost).
  void RecordTrained(const std::string& worker, int epoch, int64_t samples);

  // `worker` left the run after the shards took `steps` steps from it:
  // its untrained positions go to `survivors` (see above), and its trained
  // samples are counted from the same walk.
  void MemberLost(const std::string& worker, int64_t steps,
                  const std::vector<std::string>& survivors);

  // Samples trained in this run per epoch (members' reports, lost members'
  // walks). The skipped prefix of a resumed epoch counts as trained.
  std::map<int, int64_t> TrainedSamples() const;
  int64_t epoch_length() const { return epoch_length_; }

  // Steps of `epoch`'s base share that the run's first epoch skips (a
  // resume part-way through it); 0 for other epochs.
  int64_t FirstStep(int epoch, int64_t base_steps) const;

  // sync: the data position (epoch, steps into it) of the model version
  // `version` (versions count the run's steps from start_step - FirstStep).
  // A version inside an epoch's tails maps to the next epoch's start; one
  // beyond the planned epochs to the epoch after the last one planned.
  std::pair<int, int64_t> PositionOfVersion(int64_t version) const;

 private:
  struct Epoch {
    std::vector<std::string> members;  // Rank order.
    int64_t base_steps = 0;
    std::map<std::string, std::vector<data::WorkSegment>> tails;
    std::set<std::string> ended;
  };
  // `worker`'s segments in `epoch` (base share, then tails).
  std::vector<data::WorkSegment> SegmentsOf(const Epoch& e, int epoch,
                                            const std::string& worker) const;
  // Splits `range` among `receivers` as tails of `plan` (an epoch of epochs_).
  void Give(const data::WorkRange& range, Epoch& plan, const std::vector<std::string>& receivers);
  int64_t TailSteps(const Epoch& e) const;

  const RunStart start_;
  int64_t epoch_length_ = 0;
  std::map<int, Epoch> epochs_;
  // Ranges no planned epoch could take yet: given at the next freeze.
  std::vector<data::WorkRange> unplaced_;
  std::map<std::string, std::map<int, int64_t>> trained_;  // Worker -> epoch -> samples.
  std::set<std::string> lost_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_EPOCH_PLANNER_H_
