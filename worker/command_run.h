// CommandRun: the process a pstrain-worker daemon runs for a job that names
// a command (JobSpec.command; the daemon's --command-root, docs/SECURITY.md).
//
//   PSTRAIN_ASSIGN_OR_RETURN(std::string program,
//                            ResolveCommand(spec.command().argv(0), roots));  // or the refusal
//   PSTRAIN_ASSIGN_OR_RETURN(auto run, CommandRun::Start(job_id, program, spec.command(), options));
//   ... every heartbeat: if (auto end = run->Poll()) report *end;
//   v1::CommandEnd end = run->Stop();  // the job ended, or the daemon stops
//
// The process runs in its own process group with the daemon's environment,
// the job's CommandSpec.env and Options::env, in the program's directory; it
// gets SIGKILL if the daemon dies. Its stdout and stderr are logged line by
// line ("job-3 command: ...", lines cut at 1 KiB) and the last 2 KiB are kept
// for the end's output_tail. Stop() sends SIGTERM to the group, SIGKILL after
// Options::stop_grace.
//
// Threads: one reader thread per run reads the output. Poll and Stop are
// called from the daemon's heartbeat thread only.
#ifndef PSTRAIN_WORKER_COMMAND_RUN_H_
#define PSTRAIN_WORKER_COMMAND_RUN_H_

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pstrain/v1/service.pb.h"

namespace pstrain {

// The program a command names, as a daemon with `roots` (its
// --command-root directories, absolute) would run it: argv[0] resolved,
// symlinks followed, to an executable regular file inside one of the roots
// (a name without '/' is looked up in each root in turn, a relative path
// with '/' is taken relative to each root). PERMISSION_DENIED, naming the
// roots, for anything else; FAILED_PRECONDITION with no roots.
absl::StatusOr<std::string> ResolveCommand(const std::string& program,
                                           const std::vector<std::string>& roots);

class CommandRun {
 public:
  struct Options {
    // Variables the daemon sets (PSTRAIN_SERVER, ...): they replace the
    // job's and the daemon's own.
    std::map<std::string, std::string> env;
    absl::Duration stop_grace = absl::Seconds(10);
    std::function<void(const std::string&)> log;  // Non-null.
  };

  // Starts `program` (ResolveCommand's) with argv[1..] of `command`.
  static absl::StatusOr<std::unique_ptr<CommandRun>> Start(const std::string& job_id,
                                                           const std::string& program,
                                                           const v1::CommandSpec& command,
                                                           Options options);
  ~CommandRun();  // Stop() unless it ended.
  CommandRun(const CommandRun&) = delete;
  CommandRun& operator=(const CommandRun&) = delete;

  const std::string& job_id() const { return job_id_; }
  pid_t pid() const { return pid_; }
  // Its end once it exited (without waiting), else nullopt.
  std::optional<v1::CommandEnd> Poll();
  // Ends it (SIGTERM to its group, SIGKILL after stop_grace) and returns its
  // end; the end it had when it exited already. Blocks up to twice
  // stop_grace.
  v1::CommandEnd Stop();
  // Sends `sig` to its process group (nothing once it ended); Poll() then
  // reaps it. For a caller that must not block while it waits.
  void Signal(int sig);

 private:
  CommandRun(std::string job_id, Options options) : job_id_(std::move(job_id)), options_(std::move(options)) {}
  void ReadOutput(int fd);
  v1::CommandEnd EndOf(int wait_status);

  const std::string job_id_;
  const Options options_;
  pid_t pid_ = -1;
  std::optional<v1::CommandEnd> end_;  // Once reaped.
  std::thread reader_;
  mutable absl::Mutex mu_;
  std::string tail_ ABSL_GUARDED_BY(mu_);  // Its last output.
  bool stop_reading_ ABSL_GUARDED_BY(mu_) = false;
  bool output_closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_COMMAND_RUN_H_
