#include "server/checkpoint_writer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pstrain {

bool IsCut(const CheckpointWork& work) {
  const v1::ConsistencyMode mode = work.spec.mode();
  return (work.kind == CheckpointWork::kEpoch || work.kind == CheckpointWork::kInterval) &&
         (mode == v1::CONSISTENCY_SYNC || mode == v1::CONSISTENCY_AVERAGE);
}

DataPosition CheckpointPosition(const CheckpointWork& work, int64_t cut_version) {
  DataPosition position = work.position;
  if (!IsCut(work) || work.spec.mode() != v1::CONSISTENCY_SYNC) return position;
  position.step = cut_version;
  const std::pair<int, int64_t> planned = work.position_of_version
                                              ? work.position_of_version(cut_version)
                                              : std::pair<int, int64_t>{-1, 0};
  const int epochs = work.spec.epochs();
  if (planned.first >= 0 && work.steps_per_epoch > 0) {
    // The epoch and the steps into its share.
    position.epoch = std::min(planned.first, epochs);
    position.step = static_cast<int64_t>(position.epoch) * work.steps_per_epoch +
                    (position.epoch < epochs ? planned.second : 0);
  } else if (work.steps_per_epoch > 0) {
    position.epoch =
        static_cast<int>(std::min<int64_t>(cut_version / work.steps_per_epoch, epochs));
  }
  return position;
}

CheckpointWriter::CheckpointWriter(Options options, ShardController* shards,
                                   const Checkpointer* checkpointer)
    : options_(std::move(options)), shards_(shards), checkpointer_(checkpointer) {}

absl::StatusOr<ModelSnapshot> CheckpointWriter::ReadModel(const CheckpointWork& work) const {
  if (!IsCut(work)) return shards_->ReadModel(work.job_id, work.graph);
  PSTRAIN_ASSIGN_OR_RETURN(const int64_t version, shards_->MaxVersion(work.job_id));
  return shards_->ReadModelAt(work.job_id, work.graph, version, options_.cut_wait);
}

absl::Status CheckpointWriter::Write(const CheckpointWork& work, ModelSnapshot model) const {
  if (options_.state_dir.empty()) return absl::OkStatus();
  const bool cut = IsCut(work);
  const int64_t cut_version = model.max_version;
  CheckpointContents contents{.params = std::move(model.params),
                              .optimizer_state = std::move(model.optimizer_state),
                              .chunk_versions = std::move(model.chunk_versions),
                              .position = CheckpointPosition(work, cut_version)};
  const v1::Checkpoint ckpt = EncodeCheckpoint(work.spec, work.graph, contents, options_.clock());
  PSTRAIN_RETURN_IF_ERROR(checkpointer_->Write(work.job_id, ckpt));
  const char* kind = work.kind == CheckpointWork::kFinal      ? ", final"
                     : work.kind == CheckpointWork::kInterval ? ", interval"
                     : work.kind == CheckpointWork::kStop     ? ", stopped"
                                                              : "";
  if (options_.log) {
    options_.log(absl::StrCat(work.job_id, ": checkpoint written (epoch ", contents.position.epoch,
                              ", step ", contents.position.step, kind,
                              cut ? absl::StrCat(", cut at version ", cut_version) : std::string(),
                              ")"));
  }
  return absl::OkStatus();
}

}  // namespace pstrain
