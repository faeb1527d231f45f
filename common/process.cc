#include "common/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace pstrain {
namespace {

namespace fs = std::filesystem;

// Escapes `s` for a JSON string.
std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppend(&out, "\\u00", absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace

absl::StatusOr<pid_t> SpawnProcess(const std::vector<std::string>& argv,
                                   const std::map<std::string, std::string>& env,
                                   const SpawnOptions& options) {
  if (argv.empty() || argv[0].empty()) return absl::InvalidArgumentError("no program to run");
  // Everything the child needs is made before fork.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (env.count(entry.substr(0, entry.find('='))) == 0) env_strings.push_back(entry);
  }
  for (const auto& [k, v] : env) env_strings.push_back(absl::StrCat(k, "=", v));
  std::vector<char*> envp, args;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (std::string& s : argv_copy) args.push_back(s.data());
  args.push_back(nullptr);
  int output = options.output_fd;
  if (!options.log_path.empty()) {
    output = open(options.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (output < 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot open ", options.log_path, ": ", std::strerror(errno)));
    }
  }
  // The child reports an exec failure's errno through this pipe (closed on
  // a successful exec).
  int report[2];
  if (pipe2(report, O_CLOEXEC) != 0) {
    if (!options.log_path.empty()) close(output);
    return absl::UnavailableError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    auto fail = [&](int error) {
      (void)!write(report[1], &error, sizeof(error));
      _exit(127);
    };
    if (options.new_process_group && setpgid(0, 0) != 0) fail(errno);
    if (options.die_with_parent) {
      if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) fail(errno);
      if (getppid() != parent) _exit(127);  // The parent died already.
    }
    if (output >= 0 && (dup2(output, 1) < 0 || dup2(output, 2) < 0)) fail(errno);
    if (!options.cwd.empty() && chdir(options.cwd.c_str()) != 0) fail(errno);
    if (options.search_path) {
      execvpe(args[0], args.data(), envp.data());
    } else {
      execve(args[0], args.data(), envp.data());
    }
    fail(errno);
  }
  const int fork_errno = errno;
  close(report[1]);
  if (!options.log_path.empty()) close(output);
  if (pid < 0) {
    close(report[0]);
    return absl::UnavailableError(absl::StrCat("fork: ", std::strerror(fork_errno)));
  }
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(report[0], &child_errno, sizeof(child_errno));
  } while (n < 0 && errno == EINTR);
  close(report[0]);
  if (n == static_cast<ssize_t>(sizeof(child_errno))) {
    int ignored = 0;
    waitpid(pid, &ignored, 0);
    return absl::FailedPreconditionError(
        absl::StrCat("cannot run ", argv[0], ": ", std::strerror(child_errno)));
  }
  return pid;
}

std::string ExitText(int wait_status) {
  if (WIFEXITED(wait_status)) {
    return absl::StrCat("exited with status ", WEXITSTATUS(wait_status));
  }
  if (WIFSIGNALED(wait_status)) {
    const int sig = WTERMSIG(wait_status);
    const char* name = strsignal(sig);
    return absl::StrCat("was killed by signal ", sig,
                        name != nullptr ? absl::StrCat(" (", name, ")") : std::string());
  }
  return "ended";
}

absl::Status WriteLauncherCredentials(const std::string& path,
                                      const LauncherCredentials& c) {
  {
    std::ofstream f(path, std::ios::trunc);
    f << "{\"tls_ca\": " << JsonString(c.tls_ca) << ", \"tls_cert\": " << JsonString(c.tls_cert)
      << ", \"tls_key\": " << JsonString(c.tls_key)
      << ", \"tls_server_name\": " << JsonString(c.tls_server_name)
      << ", \"token_file\": " << JsonString(c.token_file) << "}\n";
    if (!f.flush()) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  }
  if (chmod(path.c_str(), 0600) != 0) {
    return absl::UnavailableError(absl::StrCat("chmod ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::string BuildTreePythonPath() {
  std::error_code ec;
  const fs::path package =
      fs::read_symlink("/proc/self/exe", ec).parent_path().parent_path() / "python";
  if (ec || !fs::exists(package / "pstrain" / "torch.py", ec)) return "";
  const char* old_path = std::getenv("PYTHONPATH");
  return old_path != nullptr && *old_path != '\0' ? absl::StrCat(package.string(), ":", old_path)
                                                  : package.string();
}

}  // namespace pstrain
