// worker/command_run.h: which programs a daemon's --command-root allows, and
// how a job's command runs, ends and is stopped.
#include "worker/command_run.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;
using ::pstrain::testing::StatusIs;
using ::testing::HasSubstr;

class CommandRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           absl::StrCat("command_run_test_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    root_ = dir_ / "jobs";
    fs::create_directories(root_ / "sub");
    fs::create_directories(dir_ / "elsewhere");
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Script(const fs::path& path, const std::string& body, bool executable = true) {
    std::ofstream(path) << "#!/bin/sh\n" << body;
    fs::permissions(path, executable ? fs::perms::owner_all : fs::perms::owner_read);
    return path.string();
  }

  std::vector<std::string> Roots() const { return {root_.string()}; }

  CommandRun::Options Options() {
    CommandRun::Options options;
    options.env = {{"PSTRAIN_JOB", "job-7"}};
    options.stop_grace = absl::Milliseconds(300);
    options.log = [this](const std::string& line) {
      absl::MutexLock lock(&mu_);
      lines_.push_back(line);
    };
    return options;
  }

  v1::CommandEnd WaitForEnd(CommandRun& run) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      if (std::optional<v1::CommandEnd> end = run.Poll()) return *end;
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << "the command did not end";
    return run.Stop();
  }

  fs::path dir_, root_;
  absl::Mutex mu_;
  std::vector<std::string> lines_;
};

TEST_F(CommandRunTest, OnlyExecutableFilesUnderARootAreRun) {
  const std::string train = Script(root_ / "train.sh", "exit 0\n");
  Script(root_ / "sub" / "eval.sh", "exit 0\n");
  Script(root_ / "notes.sh", "exit 0\n", /*executable=*/false);
  const std::string outside = Script(dir_ / "elsewhere" / "evil.sh", "exit 0\n");
  fs::create_symlink(outside, root_ / "link.sh");

  auto resolved = [&](const std::string& program) {
    absl::StatusOr<std::string> r = ResolveCommand(program, Roots());
    return r.ok() ? *r : r.status().ToString();
  };
  EXPECT_EQ(resolved("train.sh"), train);
  EXPECT_EQ(resolved(train), train);
  EXPECT_EQ(resolved("sub/eval.sh"), (root_ / "sub" / "eval.sh").string());
  for (const std::string& refused :
       {std::string("notes.sh"), outside, std::string("link.sh"), std::string("../elsewhere/evil.sh"),
        std::string("/bin/sh"), std::string("sub"), std::string("missing.sh")}) {
    EXPECT_THAT(ResolveCommand(refused, Roots()),
                StatusIs(absl::StatusCode::kPermissionDenied,
                         HasSubstr("is not an executable file under this worker's --command-root")))
        << refused;
  }
  EXPECT_THAT(ResolveCommand("train.sh", {}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("runs no commands")));
}

TEST_F(CommandRunTest, ACommandRunsInItsDirectoryWithTheJobsEnvironmentAndEndsWithItsStatus) {
  const std::string program = Script(
      root_ / "train.sh",
      "echo \"job=$PSTRAIN_JOB seed=$SEED arg=$1 dir=$(pwd)\"\necho 'Traceback: bad' >&2\nexit 3\n");
  v1::CommandSpec command;
  command.add_argv("train.sh");
  command.add_argv("--epochs=2");
  (*command.mutable_env())["SEED"] = "42";
  (*command.mutable_env())["PSTRAIN_JOB"] = "not-this";  // The daemon's value wins.
  auto run = CommandRun::Start("job-7", program, command, Options());
  ASSERT_OK(run);
  const v1::CommandEnd end = WaitForEnd(**run);
  EXPECT_EQ(end.job_id(), "job-7");
  EXPECT_EQ(end.exit_code(), 3);
  EXPECT_EQ(end.signal(), 0);
  EXPECT_THAT(end.output_tail(),
              HasSubstr(absl::StrCat("job=job-7 seed=42 arg=--epochs=2 dir=", root_.string())));
  EXPECT_THAT(end.output_tail(), HasSubstr("Traceback: bad"));
  absl::MutexLock lock(&mu_);
  EXPECT_THAT(lines_, ::testing::Contains(HasSubstr("job-7 command: Traceback: bad")));
  EXPECT_THAT(lines_, ::testing::Contains(HasSubstr("exited with status 3")));
}

TEST_F(CommandRunTest, KillNineIsItsEndAndStopEndsEvenACommandThatIgnoresSigterm) {
  const std::string sleeper = Script(root_ / "sleep.sh", "echo started\nexec sleep 60\n");
  v1::CommandSpec command;
  command.add_argv("sleep.sh");
  auto killed = CommandRun::Start("job-7", sleeper, command, Options());
  ASSERT_OK(killed);
  EXPECT_FALSE((*killed)->Poll().has_value());
  ASSERT_EQ(kill((*killed)->pid(), SIGKILL), 0);
  EXPECT_EQ(WaitForEnd(**killed).signal(), SIGKILL);

  // It traps SIGTERM and its child sleeps on: SIGKILL after the grace, to
  // the whole group.
  const std::string stubborn =
      Script(root_ / "stubborn.sh", "trap '' TERM\necho ready\nsleep 60 &\nwait\nwait\n");
  auto run = CommandRun::Start("job-7", stubborn, command, Options());
  ASSERT_OK(run);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (bool ready = false; !ready && absl::Now() < deadline; absl::SleepFor(absl::Milliseconds(20))) {
    absl::MutexLock lock(&mu_);
    for (const std::string& l : lines_) ready = ready || l == "job-7 command: ready";
  }
  const absl::Time before = absl::Now();
  const v1::CommandEnd end = (*run)->Stop();
  EXPECT_EQ(end.signal(), SIGKILL);
  EXPECT_LT(absl::Now() - before, absl::Seconds(5));
  run->reset();  // Joins its output reader: the group's sleep died too.
}

TEST_F(CommandRunTest, AProgramThatCannotStartIsAnError) {
  v1::CommandSpec command;
  command.add_argv("gone.sh");
  EXPECT_THAT(CommandRun::Start("job-7", (root_ / "gone.sh").string(), command, Options()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("cannot run")));
}

}  // namespace
}  // namespace pstrain
