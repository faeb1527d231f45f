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
// With Options::remote_dir (an object-store prefix, s3://bucket/prefix), the
// numbered checkpoints live there instead: <remote_dir>/<id>/ckpt-<n>.ckpt,
// each committed by its manifest <remote_dir>/<id>/ckpt-<n>.manifest (its
// size and SHA-256), written only after the checkpoint object is whole. A
// reader takes only checkpoints whose manifest is there and whose bytes
// match it, newest first; pruning deletes the manifest before the object.
// A server killed mid-upload leaves an object without a manifest (or the
// parts of a multipart upload), which RemoveOrphans deletes (aborts) at the
// next start; the job resumes from the previous committed checkpoint.
// <job dir>/model.ckpt stays on the local disk as the newest one's copy for
// DownloadModel. Objects are written whole or not at all
// (storage::Storage::Write), so there are no temporary objects.
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
#include "common/storage/storage.h"
#include "pstrain/v1/checkpoint.pb.h"

namespace pstrain {

class Checkpointer {
 public:
  struct Options {
    std::string state_dir;  // Empty: nothing is written; Write is a no-op.
    int keep = 3;           // Newest checkpoints kept per job (>= 1).
    // Log lines ("job-1: checkpoint ... is corrupt; using ..."); default stderr.
    std::function<void(const std::string&)> log;
    // Where the numbered checkpoints go when not under state_dir: an
    // s3:// prefix (any URI `store` takes) read and written through `store`
    // (both set, or neither).
    std::string remote_dir;
    storage::Storage* store = nullptr;
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

  // The job's numbered checkpoint files (or, remote, committed checkpoint
  // objects), oldest first.
  std::vector<std::string> List(const std::string& job_id) const;

 private:
  void Log(const std::string& line) const;
  bool remote() const { return !options_.remote_dir.empty(); }
  // <remote_dir>/<job_id>.
  std::string RemoteJobDir(const std::string& job_id) const;
  absl::Status WriteRemote(const std::string& job_id, const v1::Checkpoint& ckpt) const;
  absl::StatusOr<v1::Checkpoint> LoadRemote(const std::string& job_id) const;
  // The committed checkpoints' numbers, ascending; errors from the store.
  absl::StatusOr<std::vector<int64_t>> RemoteNumbers(const std::string& job_id) const;
  int RemoveRemoteOrphans(const std::string& job_id) const;

  const Options options_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_CHECKPOINTER_H_
