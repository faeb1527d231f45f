// Checkpointer: where a job's checkpoints live on server 0, how they are
// written, kept and read back. No gRPC and no shard traffic here: the
// coordinator reads the model (a consistent cut where the mode has one) and
// hands it over.
//
//   Checkpointer checkpoints({.state_dir = "/var/lib/pstrain", .keep = 3});
//   checkpoints.RemoveOrphans("job-1");                       // at start-up
//   PSTRAIN_RETURN_IF_ERROR(checkpoints.Write("job-1", ckpt)); // the newest
//   PSTRAIN_ASSIGN_OR_RETURN(v1::Checkpoint latest, checkpoints.LoadLatest("job-1"));
//
// Layout, per job: <state_dir>/jobs/<id>/checkpoints/ckpt-<n>.ckpt, n
// counting up from 1 (eight digits), the newest `keep` of them kept; and
// <state_dir>/jobs/<id>/model.ckpt, the newest again (a hard link, or a
// copy where links fail), which is what DownloadModel streams and
// `pstrain-worker --evaluate` reads. Every file is written atomically (a
// temporary file, fsync, rename: common/checkpoint.h), so a kill at any
// point leaves the previous checkpoints intact and loadable; the temporary
// files such a kill leaves behind ("*.tmp.*") are removed by
// RemoveOrphans, which the coordinator calls for every job at start-up.
// LoadLatest reads the newest checkpoint and falls back to older ones when
// it is unreadable (a CRC mismatch, a truncated file), saying so in the log.
//
// Checkpoints are single files written in parts (common/checkpoint.h): no
// size limit, one part in memory at a time beyond the checkpoint itself.
//
// Threads: not thread-safe for one job; the coordinator writes from its
// Tick thread only. Different jobs may be handled concurrently.
#ifndef PSTRAIN_SERVER_CHECKPOINTER_H_
#define PSTRAIN_SERVER_CHECKPOINTER_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pstrain/v1/checkpoint.pb.h"

namespace pstrain {

class Checkpointer {
 public:
  struct Options {
    std::string state_dir;  // Empty: nothing is written; Write is a no-op.
    int keep = 3;           // Newest checkpoints kept per job (>= 1).
    // Log lines ("job-1: checkpoint ... is corrupt; using ..."); default stderr.
    std::function<void(const std::string&)> log;
  };

  explicit Checkpointer(Options options);

  // <state_dir>/jobs/<job_id>.
  std::string JobDir(const std::string& job_id) const;
  // The newest checkpoint's stable path (<job dir>/model.ckpt).
  std::string LatestPath(const std::string& job_id) const;
  // True when the job has a checkpoint on disk.
  bool HasCheckpoint(const std::string& job_id) const;

  // Writes `ckpt` as the job's newest checkpoint and drops the ones beyond
  // Options::keep. On error nothing that was there before is touched.
  absl::Status Write(const std::string& job_id, const v1::Checkpoint& ckpt) const;

  // The newest readable checkpoint. NOT_FOUND when the job has none; the
  // newest one's error (DATA_LOSS, ...) when none of them can be read.
  absl::StatusOr<v1::Checkpoint> LoadLatest(const std::string& job_id) const;

  // Removes the temporary files a killed write left in the job's
  // directories; returns how many.
  int RemoveOrphans(const std::string& job_id) const;

  // The job's numbered checkpoint files, oldest first.
  std::vector<std::string> List(const std::string& job_id) const;

 private:
  void Log(const std::string& line) const;

  const Options options_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_CHECKPOINTER_H_
