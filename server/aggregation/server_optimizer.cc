#include "server/aggregation/server_optimizer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/aggregation/aggregation_policy.h"

namespace pstrain {

absl::StatusOr<std::unique_ptr<ServerOptimizer>> ServerOptimizer::Create(
    const v1::OptimizerSpec& spec, std::string where) {
  std::unique_ptr<ServerOptimizer> server(
      new ServerOptimizer(OptimizerSlotNames(spec), std::move(where)));
  CpuBackendOptions backend_options;
  backend_options.num_threads = 1;  // The server shares the cores with workers.
  server->backend_ = CreateCpuBackend(backend_options);
  PSTRAIN_ASSIGN_OR_RETURN(server->optimizer_, Optimizer::Create(spec, server->backend_.get()));
  return server;
}

absl::Status ServerOptimizer::AddChunk(ShardChunk& chunk, const v1::ChunkValues& initial) {
  const std::string name = absl::StrCat("chunk", chunk.id);
  PSTRAIN_ASSIGN_OR_RETURN(chunk.optimizer_index, optimizer_->AddParameter(name, chunk.count));
  for (const std::string& slot : slot_names_) {
    for (auto& [state_name, tensor] : optimizer_->StateTensors()) {
      if (state_name == absl::StrCat(name, "/", slot)) chunk.optimizer_state.push_back(tensor);
    }
  }
  if (chunk.optimizer_state.size() != slot_names_.size()) {
    return absl::InternalError(absl::StrCat(where_, "optimizer has ", chunk.optimizer_state.size(),
                                            " state slots for ", name, ", expected ",
                                            slot_names_.size()));
  }
  for (int s = 0; s < initial.slots_size(); ++s) {
    PSTRAIN_RETURN_IF_ERROR(backend_->CopyHostToDevice(chunk.optimizer_state[s]->data(),
                                                       initial.slots(s).values().data(),
                                                       chunk.count * sizeof(float)));
  }
  return absl::OkStatus();
}

absl::Status ServerOptimizer::Apply(ShardChunk& chunk, const float* gradient) {
  std::vector<float>* target = Writable(&chunk.values);
  return optimizer_->Apply(chunk.optimizer_index, target->data(), gradient, chunk.version);
}

absl::Status ServerOptimizer::ReadSlots(const ShardChunk& chunk, v1::ChunkValues* out) {
  for (size_t s = 0; s < chunk.optimizer_state.size(); ++s) {
    v1::OptimizerSlot* slot = out->add_slots();
    slot->set_name(slot_names_[s]);
    slot->mutable_values()->Resize(static_cast<int>(chunk.count), 0.f);
    PSTRAIN_RETURN_IF_ERROR(backend_->CopyDeviceToHost(slot->mutable_values()->mutable_data(),
                                                       chunk.optimizer_state[s]->data(),
                                                       chunk.count * sizeof(float)));
  }
  return backend_->Synchronize();
}

}  // namespace pstrain
