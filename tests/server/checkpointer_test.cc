// Tests for server/checkpointer.{h,cc}: numbered checkpoints with the newest
// N kept, model.ckpt always the newest, the fallback to an older checkpoint
// when the newest cannot be read, and the clean-up of temporary files that a
// killed write leaves behind.
#include "server/checkpointer.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"
#include "common/storage/storage.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;
using ::pstrain::testing::StatusIs;
using ::testing::Contains;
using ::testing::HasSubstr;

class CheckpointerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/checkpointer_test_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  Checkpointer Make(int keep) {
    return Checkpointer({.state_dir = dir_,
                         .keep = keep,
                         .log = [this](const std::string& l) { log_.push_back(l); },
                         .remote_dir = "",
                         .store = nullptr});
  }

  // A checkpoint whose one tensor holds `step` (so that files differ).
  static v1::Checkpoint AtStep(int64_t step) {
    v1::Checkpoint ckpt;
    ckpt.mutable_job()->set_name("job");
    const float value = static_cast<float>(step);
    *ckpt.add_parameters() = MakeTensorProto("fc/bias", {1}, &value);
    ckpt.set_step(step);
    return ckpt;
  }

  std::string dir_;
  std::vector<std::string> log_;
};

TEST_F(CheckpointerTest, KeepsTheNewestAndModelCkptIsAlwaysTheNewest) {
  Checkpointer checkpoints = Make(/*keep=*/2);
  EXPECT_FALSE(checkpoints.HasCheckpoint("job-1"));
  EXPECT_THAT(checkpoints.LoadLatest("job-1").status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("model.ckpt")));
  for (int64_t step : {10, 20, 30}) {
    ASSERT_OK(checkpoints.Write("job-1", AtStep(step)));
    ASSERT_OK_AND_ASSIGN(v1::Checkpoint latest,
                         ReadCheckpointFile(checkpoints.LatestPath("job-1")));
    EXPECT_EQ(latest.step(), step);
  }
  const std::vector<std::string> kept = checkpoints.List("job-1");
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_THAT(kept[0], HasSubstr("ckpt-00000002.ckpt"));
  EXPECT_THAT(kept[1], HasSubstr("ckpt-00000003.ckpt"));
  ASSERT_OK_AND_ASSIGN(v1::Checkpoint latest, checkpoints.LoadLatest("job-1"));
  EXPECT_EQ(latest.step(), 30);
  EXPECT_TRUE(checkpoints.HasCheckpoint("job-1"));
}

// A checkpoint whose newest file is damaged (a disk error, a truncated
// copy) still resumes: from the newest one that reads back.
TEST_F(CheckpointerTest, AnUnreadableNewestCheckpointFallsBackToTheOneBefore) {
  Checkpointer checkpoints = Make(3);
  ASSERT_OK(checkpoints.Write("job-1", AtStep(10)));
  ASSERT_OK(checkpoints.Write("job-1", AtStep(20)));
  const std::string newest = checkpoints.List("job-1").back();
  {
    std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.write("XYZ", 3);
  }
  EXPECT_THAT(ReadCheckpointFile(newest).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("")));
  ASSERT_OK_AND_ASSIGN(v1::Checkpoint loaded, checkpoints.LoadLatest("job-1"));
  EXPECT_EQ(loaded.step(), 10);
  bool said = false;
  for (const std::string& line : log_)
    said |= line.find("using the older checkpoint") != std::string::npos;
  EXPECT_TRUE(said);
}

// Issue 9: a kill during a checkpoint write left model.ckpt.tmp.* behind for
// good. The kill is simulated by what it leaves: the temporary files of an
// unfinished write beside intact older checkpoints. The previous checkpoint
// loads with a good CRC, and RemoveOrphans (called at start-up) removes the
// debris.
TEST_F(CheckpointerTest, AWriteKilledHalfwayLeavesThePreviousCheckpointAndItsDebrisIsRemoved) {
  Checkpointer checkpoints = Make(3);
  ASSERT_OK(checkpoints.Write("job-1", AtStep(10)));
  const fs::path job_dir = checkpoints.JobDir("job-1");
  const std::vector<std::string> debris = {
      (job_dir / "checkpoints" / "ckpt-00000002.ckpt.tmp.4242.0").string(),
      (job_dir / "model.ckpt.tmp.link.4242").string(), (job_dir / "status.pb.tmp.4242.1").string()};
  for (const std::string& path : debris) std::ofstream(path) << "half a checkpoint";
  ASSERT_OK_AND_ASSIGN(v1::Checkpoint loaded, checkpoints.LoadLatest("job-1"));
  EXPECT_EQ(loaded.step(), 10);
  EXPECT_EQ(checkpoints.RemoveOrphans("job-1"), 3);
  for (const std::string& path : debris) EXPECT_FALSE(fs::exists(path)) << path;
  EXPECT_EQ(checkpoints.List("job-1").size(), 1u);
  ASSERT_OK(checkpoints.Write("job-1", AtStep(20)));
  ASSERT_OK_AND_ASSIGN(loaded, checkpoints.LoadLatest("job-1"));
  EXPECT_EQ(loaded.step(), 20);
}

// The remote layout (an object store in production; any URI the storage
// takes, here a local directory): a checkpoint counts once its manifest is
// there and its bytes match it.
class RemoteCheckpointerTest : public CheckpointerTest {
 protected:
  Checkpointer MakeRemote(int keep) {
    return Checkpointer({.state_dir = dir_,
                         .keep = keep,
                         .log = [this](const std::string& l) { log_.push_back(l); },
                         .remote_dir = dir_ + "/bucket/runs",
                         .store = store_.get()});
  }
  std::string Remote(const std::string& name) { return dir_ + "/bucket/runs/job-1/" + name; }
  std::unique_ptr<storage::Storage> store_ = storage::NewLocalStorage();
};

TEST_F(RemoteCheckpointerTest, ManifestsCommitPruneAndGuardTheBytes) {
  Checkpointer checkpoints = MakeRemote(/*keep=*/2);
  EXPECT_FALSE(checkpoints.HasCheckpoint("job-1"));
  for (int64_t step : {10, 20, 30}) ASSERT_OK(checkpoints.Write("job-1", AtStep(step)));
  // Two kept, each with its manifest; the local model.ckpt is the newest.
  EXPECT_FALSE(fs::exists(Remote("ckpt-00000001.ckpt")));
  EXPECT_FALSE(fs::exists(Remote("ckpt-00000001.manifest")));
  EXPECT_TRUE(fs::exists(Remote("ckpt-00000003.manifest")));
  ASSERT_EQ(checkpoints.List("job-1").size(), 2u);
  ASSERT_OK_AND_ASSIGN(v1::Checkpoint local, ReadCheckpointFile(checkpoints.LatestPath("job-1")));
  EXPECT_EQ(local.step(), 30);
  ASSERT_OK_AND_ASSIGN(v1::Checkpoint latest, checkpoints.LoadLatest("job-1"));
  EXPECT_EQ(latest.step(), 30);
  // Bytes that do not match the manifest (a damaged object): the one before.
  ASSERT_OK_AND_ASSIGN(std::string bytes, store_->Read(Remote("ckpt-00000003.ckpt")));
  bytes[bytes.size() / 2] ^= 0x5a;
  ASSERT_OK(store_->Write(Remote("ckpt-00000003.ckpt"), bytes));
  ASSERT_OK_AND_ASSIGN(latest, checkpoints.LoadLatest("job-1"));
  EXPECT_EQ(latest.step(), 20);
  EXPECT_THAT(log_, Contains(HasSubstr("do not match its manifest")));
}

TEST_F(RemoteCheckpointerTest, AnObjectWithoutItsManifestIsNeverTakenAndIsRemoved) {
  Checkpointer checkpoints = MakeRemote(3);
  ASSERT_OK(checkpoints.Write("job-1", AtStep(10)));
  // A server killed between the object and its manifest.
  ASSERT_OK_AND_ASSIGN(std::string bytes, store_->Read(Remote("ckpt-00000001.ckpt")));
  ASSERT_OK(store_->Write(Remote("ckpt-00000002.ckpt"), bytes));
  ASSERT_OK_AND_ASSIGN(v1::Checkpoint latest, checkpoints.LoadLatest("job-1"));
  EXPECT_EQ(latest.step(), 10);
  EXPECT_EQ(checkpoints.RemoveOrphans("job-1"), 1);
  EXPECT_FALSE(fs::exists(Remote("ckpt-00000002.ckpt")));
  EXPECT_TRUE(fs::exists(Remote("ckpt-00000001.ckpt")));
  // The next checkpoint takes the next number after the committed ones.
  ASSERT_OK(checkpoints.Write("job-1", AtStep(20)));
  EXPECT_TRUE(fs::exists(Remote("ckpt-00000002.manifest")));
}

TEST_F(CheckpointerTest, WithoutAStateDirectoryNothingIsWritten) {
  Checkpointer checkpoints({});
  EXPECT_OK(checkpoints.Write("job-1", AtStep(1)));
  EXPECT_FALSE(checkpoints.HasCheckpoint("job-1"));
  EXPECT_EQ(checkpoints.RemoveOrphans("job-1"), 0);
}

}  // namespace
}  // namespace pstrain
