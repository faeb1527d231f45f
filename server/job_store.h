// JobStore: the coordinator's durable state other than checkpoints: every
// job's status and the worker id counter, under a state directory.
//
//   JobStore store("/var/lib/pstrain");
//   PSTRAIN_ASSIGN_OR_RETURN(std::vector<v1::JobStatus> jobs, store.LoadJobs());
//   PSTRAIN_RETURN_IF_ERROR(store.SaveJob(status));            // after every change
//   PSTRAIN_ASSIGN_OR_RETURN(int64_t next, store.LoadNextWorkerId());
//   PSTRAIN_RETURN_IF_ERROR(store.SaveNextWorkerId(next + 1));  // before handing out `next`
//
// Layout: <state_dir>/jobs/<job id>/status.pb (a serialised v1::JobStatus)
// and <state_dir>/next_worker_id (decimal text). Every write goes to a
// temporary file, is fsync'ed and renamed (common/checkpoint.h
// WriteFileAtomically): a crash leaves the old file or the new one.
// An empty state directory stores nothing: every call succeeds and loads
// find nothing.
//
// Threads: thread-safe for different jobs; the coordinator serialises the
// writes of one job (and of the counter).
#ifndef PSTRAIN_SERVER_JOB_STORE_H_
#define PSTRAIN_SERVER_JOB_STORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pstrain/v1/service.pb.h"

namespace pstrain {

class JobStore {
 public:
  explicit JobStore(std::string state_dir) : state_dir_(std::move(state_dir)) {}

  // Every saved status, in job-number order (job-2 before job-10). Creates
  // the jobs directory. DATA_LOSS naming the file for a status that does not
  // parse or names another job; INTERNAL when the directory cannot be read.
  absl::StatusOr<std::vector<v1::JobStatus>> LoadJobs() const;
  absl::Status SaveJob(const v1::JobStatus& status) const;

  // The job's saved history (<job dir>/history.pb); an empty one for the
  // job when none was saved. DATA_LOSS naming the file for one that does
  // not parse or names another job.
  absl::StatusOr<v1::JobHistory> LoadHistory(const std::string& job_id) const;
  absl::Status SaveHistory(const v1::JobHistory& history) const;

  // The next worker number to hand out: 1 when none was saved. DATA_LOSS for
  // a counter file that is not a positive number.
  absl::StatusOr<int64_t> LoadNextWorkerId() const;
  absl::Status SaveNextWorkerId(int64_t next) const;

  // <state_dir>/jobs/<job_id>.
  std::string JobDir(const std::string& job_id) const;

 private:
  const std::string state_dir_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_JOB_STORE_H_
