#include "worker/command_run.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/process.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;

constexpr size_t kTailBytes = 2048;
constexpr size_t kMaxLogLine = 1024;

// `path` with symlinks resolved, or "" when it does not exist.
std::string RealPath(const std::string& path) {
  char buffer[PATH_MAX];
  return realpath(path.c_str(), buffer) != nullptr ? std::string(buffer) : std::string();
}

bool Inside(const std::string& path, const std::string& dir) {
  return !dir.empty() && path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 &&
         (dir.back() == '/' || path[dir.size()] == '/');
}

}  // namespace

absl::StatusOr<std::string> ResolveCommand(const std::string& program,
                                           const std::vector<std::string>& roots) {
  if (roots.empty()) {
    return absl::FailedPreconditionError(
        "this worker runs no commands (start pstrain-worker with --command-root DIR)");
  }
  std::vector<std::string> candidates;
  if (!program.empty() && program[0] == '/') {
    candidates.push_back(program);
  } else if (!program.empty()) {
    for (const std::string& root : roots) candidates.push_back((fs::path(root) / program).string());
  }
  for (const std::string& candidate : candidates) {
    const std::string real = RealPath(candidate);
    if (real.empty()) continue;
    bool inside = false;
    for (const std::string& root : roots) inside = inside || Inside(real, RealPath(root));
    struct stat st;
    if (inside && stat(real.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        access(real.c_str(), X_OK) == 0) {
      return real;
    }
  }
  return absl::PermissionDeniedError(
      absl::StrCat("'", program.substr(0, 256),
                   "' is not an executable file under this worker's --command-root (",
                   absl::StrJoin(roots, ", "), ")"));
}

absl::StatusOr<std::unique_ptr<CommandRun>> CommandRun::Start(const std::string& job_id,
                                                               const std::string& program,
                                                               const v1::CommandSpec& command,
                                                               Options options) {
  std::map<std::string, std::string> env(command.env().begin(), command.env().end());
  for (const auto& [k, v] : options.env) env[k] = v;
  std::vector<std::string> argv = {program};
  for (int i = 1; i < command.argv_size(); ++i) argv.push_back(command.argv(i));
  int output[2];
  if (pipe2(output, O_CLOEXEC) != 0) {
    return absl::UnavailableError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  std::unique_ptr<CommandRun> run(new CommandRun(job_id, std::move(options)));
  absl::StatusOr<pid_t> pid = SpawnProcess(argv, env,
                                           {.log_path = "",
                                            .output_fd = output[1],
                                            .new_process_group = true,
                                            .die_with_parent = true,
                                            .cwd = fs::path(program).parent_path().string(),
                                            .search_path = false});
  close(output[1]);
  if (!pid.ok()) {
    close(output[0]);
    return pid.status();
  }
  run->pid_ = *pid;
  const int fd = output[0];
  run->reader_ = std::thread([r = run.get(), fd] { r->ReadOutput(fd); });
  return run;
}

CommandRun::~CommandRun() {
  if (pid_ <= 0) return;  // Never started.
  if (!end_) Stop();
  kill(-pid_, SIGKILL);  // Whatever of its group is left.
  {
    absl::MutexLock lock(&mu_);
    stop_reading_ = true;
  }
  if (reader_.joinable()) reader_.join();
}

void CommandRun::ReadOutput(int fd) {
  std::string line;
  char buffer[4096];
  auto emit = [&] {
    options_.log(absl::StrCat(job_id_, " command: ", line.substr(0, kMaxLogLine)));
    line.clear();
  };
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_reading_) break;
    }
    pollfd p{fd, POLLIN, 0};
    const int ready = poll(&p, 1, 200);
    if (ready < 0 && errno != EINTR) break;
    if (ready <= 0) continue;
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) break;  // EOF: every holder of the pipe closed it.
    absl::MutexLock lock(&mu_);
    tail_.append(buffer, static_cast<size_t>(n));
    if (tail_.size() > kTailBytes) tail_.erase(0, tail_.size() - kTailBytes);
    for (ssize_t i = 0; i < n; ++i) {
      if (buffer[i] == '\n') {
        emit();
      } else if (line.size() < 4 * kMaxLogLine) {
        line += buffer[i];
      }
    }
  }
  if (!line.empty()) emit();
  close(fd);
  absl::MutexLock lock(&mu_);
  output_closed_ = true;
}

v1::CommandEnd CommandRun::EndOf(int wait_status) {
  v1::CommandEnd end;
  end.set_job_id(job_id_);
  if (WIFEXITED(wait_status)) end.set_exit_code(WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) end.set_signal(WTERMSIG(wait_status));
  {
    // Its last output: what it wrote before it ended, within a second.
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&output_closed_), absl::Seconds(1));
    end.set_output_tail(tail_);
  }
  options_.log(absl::StrCat(job_id_, ": the command (pid ", pid_, ") ", ExitText(wait_status)));
  return end;
}

std::optional<v1::CommandEnd> CommandRun::Poll() {
  if (end_) return end_;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) != pid_) return std::nullopt;
  end_ = EndOf(status);
  return end_;
}

void CommandRun::Signal(int sig) {
  if (!end_) kill(-pid_, sig);
}

v1::CommandEnd CommandRun::Stop() {
  if (end_) return *end_;
  int status = 0;
  kill(-pid_, SIGTERM);
  const absl::Time deadline = absl::Now() + options_.stop_grace;
  while (absl::Now() < deadline) {
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      end_ = EndOf(status);
      return *end_;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  options_.log(absl::StrCat(job_id_, ": the command (pid ", pid_, ") ignored SIGTERM for ",
                            absl::FormatDuration(options_.stop_grace), "; SIGKILL"));
  kill(-pid_, SIGKILL);
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  end_ = EndOf(status);
  return *end_;
}

}  // namespace pstrain
