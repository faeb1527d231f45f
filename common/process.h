// Child processes of pstrain's launchers (`pstrain run`, a pstrain-worker
// daemon that runs a job's command): start one with an environment, say how
// it ended, and the files and variables a pstrain.torch process reads.
//
//   SpawnOptions options;
//   options.output_fd = pipe_write_end;       // its stdout and stderr
//   options.new_process_group = true;         // kill(-pid, SIGTERM) reaches its children
//   PSTRAIN_ASSIGN_OR_RETURN(pid_t pid, SpawnProcess({"/opt/jobs/train.py"}, env, options));
//   ... waitpid(pid, &status, 0); ExitText(status)  // "exited with status 1"
//
// Threads: SpawnProcess is safe in a multi-threaded process (between fork
// and exec the child makes async-signal-safe calls only).
#ifndef PSTRAIN_COMMON_PROCESS_H_
#define PSTRAIN_COMMON_PROCESS_H_

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pstrain {

struct SpawnOptions {
  // Its stdout and stderr: a file (created or truncated), else `output_fd`
  // (>= 0), else this process's.
  std::string log_path;
  int output_fd = -1;
  // Its own process group (its pid), so that a signal to -pid reaches every
  // process it starts.
  bool new_process_group = false;
  // It gets SIGKILL when this process dies (Linux PR_SET_PDEATHSIG).
  bool die_with_parent = false;
  std::string cwd;         // "" = this process's.
  bool search_path = true;  // argv[0] without '/' is looked up in PATH.
};

// Starts argv with this process's environment plus `env` (which replaces
// variables of the same name). Its pid, or the error of fork or exec (an
// exec failure, e.g. a missing program, is reported here, not as an exit).
absl::StatusOr<pid_t> SpawnProcess(const std::vector<std::string>& argv,
                                   const std::map<std::string, std::string>& env,
                                   const SpawnOptions& options);

// A waitpid status in words: "exited with status 1", "was killed by
// signal 9 (Killed)".
std::string ExitText(int wait_status);

// The file and variables a pstrain.torch process reads to join a job
// (python/pstrain/torch.py, init()): where the TLS files and the worker token
// file are. Paths only: no secret is written.
struct LauncherCredentials {
  std::string tls_ca, tls_cert, tls_key, tls_server_name, token_file;
};
// Writes `credentials` as the JSON object PSTRAIN_CREDENTIALS names, mode
// 0600.
absl::Status WriteLauncherCredentials(const std::string& path,
                                      const LauncherCredentials& credentials);

// A build tree's Python package (<build>/bin/<this binary> beside
// <build>/python/pstrain, with pstrain._native): the PYTHONPATH that puts it
// first, or "" when this binary is not in a build tree (an installed one).
std::string BuildTreePythonPath();

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_PROCESS_H_
