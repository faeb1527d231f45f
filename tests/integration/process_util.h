// Helpers for integration tests that start real pstrain processes on
// 127.0.0.1: a child process with captured output, a free-port finder, and
// "run a command and give me its output".
//
//   int port = FreePort();
//   ChildProcess server({BinPath("pstrain-server"), "--listen", Address(port)});
//   ASSERT_TRUE(server.WaitForOutput("listening on", absl::Seconds(30)));
//   CommandResult r = RunCommand({BinPath("pstrain"), "--server", Address(port), "list"});
//
// Threads: a ChildProcess is used from one test thread; its reader thread is
// internal.
#ifndef PSTRAIN_TESTS_INTEGRATION_PROCESS_UTIL_H_
#define PSTRAIN_TESTS_INTEGRATION_PROCESS_UTIL_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pstrain::testing {

inline std::string BinPath(const std::string& name) {
  return std::string(PSTRAIN_BIN_DIR) + "/" + name;
}

inline std::string SourcePath(const std::string& rel) {
  return std::string(PSTRAIN_SOURCE_DIR) + "/" + rel;
}

inline std::string Address(int port) { return absl::StrCat("127.0.0.1:", port); }

// A TCP port on 127.0.0.1 that was free a moment ago (the kernel picks it).
inline int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

// A child process whose stdout and stderr are captured. Killed (SIGKILL) and
// reaped on destruction if still running.
class ChildProcess {
 public:
  explicit ChildProcess(std::vector<std::string> argv, std::vector<std::string> env = {})
      : argv_(std::move(argv)) {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      dup2(fds[1], STDERR_FILENO);
      close(fds[0]);
      close(fds[1]);
      setpgid(0, 0);
      for (const std::string& kv : env) putenv(const_cast<char*>(kv.c_str()));
      std::vector<char*> args;
      for (std::string& a : argv_) args.push_back(a.data());
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
    close(fds[1]);
    read_fd_ = fds[0];
    reader_ = std::thread([this] { ReadLoop(); });
  }
  ~ChildProcess() {
    Kill(SIGKILL);
    Wait(absl::Seconds(10));
    if (reader_.joinable()) reader_.join();
    if (read_fd_ >= 0) close(read_fd_);
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  bool started() const { return pid_ > 0; }

  void Kill(int signal) {
    if (pid_ > 0 && !exited_) ::kill(pid_, signal);
  }

  // Waits for the process to exit; returns its exit status (or -1 on timeout,
  // 128+signal when killed).
  int Wait(absl::Duration timeout) {
    if (pid_ <= 0) return -1;
    if (exited_) return exit_status_;
    absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      int status = 0;
      pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        return exit_status_;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return -1;
  }

  // True once `needle` appeared in the output, false at the deadline or when
  // the process exited without printing it.
  bool WaitForOutput(const std::string& needle, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto found = [&] {
      mu_.AssertReaderHeld();  // Await calls it with mu_ held.
      return output_.find(needle) != std::string::npos || eof_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&found), timeout);
    return output_.find(needle) != std::string::npos;
  }

  std::string output() const {
    absl::MutexLock lock(&mu_);
    return output_;
  }

 private:
  void ReadLoop() {
    char buf[4096];
    for (;;) {
      ssize_t n = read(read_fd_, buf, sizeof(buf));
      if (n <= 0) break;
      absl::MutexLock lock(&mu_);
      output_.append(buf, n);
    }
    absl::MutexLock lock(&mu_);
    eof_ = true;
  }

  std::vector<std::string> argv_;
  pid_t pid_ = -1;
  int read_fd_ = -1;
  bool exited_ = false;
  int exit_status_ = -1;
  std::thread reader_;
  mutable absl::Mutex mu_;
  std::string output_ ABSL_GUARDED_BY(mu_);
  bool eof_ ABSL_GUARDED_BY(mu_) = false;
};

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr, interleaved.
  // The last non-empty line (the JSON summary of `--json` commands).
  std::string LastLine() const {
    size_t end = output.find_last_not_of("\n\r ");
    if (end == std::string::npos) return "";
    size_t start = output.rfind('\n', end);
    return output.substr(start == std::string::npos ? 0 : start + 1, end - (start == std::string::npos ? 0 : start + 1) + 1);
  }
};

// Runs a command to completion (killed after `timeout`).
inline CommandResult RunCommand(std::vector<std::string> argv,
                                absl::Duration timeout = absl::Minutes(5)) {
  ChildProcess child(std::move(argv));
  CommandResult result;
  result.exit_code = child.Wait(timeout);
  if (result.exit_code == -1) child.Kill(SIGKILL);
  child.Wait(absl::Seconds(5));
  // Give the reader a moment to drain the pipe after exit.
  child.WaitForOutput("\x01never\x01", absl::Milliseconds(200));
  result.output = child.output();
  return result;
}

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_INTEGRATION_PROCESS_UTIL_H_
