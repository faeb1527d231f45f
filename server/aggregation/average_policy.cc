#include "server/aggregation/average_policy.h"

#include <memory>
#include <vector>

namespace pstrain {

absl::Status AveragePolicy::AddChunk(ShardChunk& chunk, const v1::ChunkValues& initial) {
  if (!chunk.trainable || (!ExchangesState(chunk) && initial.slots_size() == 0)) {
    return absl::OkStatus();
  }
  for (size_t s = 0; s < slot_names().size(); ++s) {
    if (initial.slots_size() > 0) {
      const auto& src = initial.slots(static_cast<int>(s)).values();
      chunk.slots.push_back(std::make_shared<std::vector<float>>(src.begin(), src.end()));
    } else {
      chunk.slots.push_back(std::make_shared<std::vector<float>>(chunk.count, 0.f));
    }
  }
  if (ExchangesState(chunk)) chunk.slot_barriers.resize(slot_names().size());
  return absl::OkStatus();
}

absl::Status AveragePolicy::ReadSlots(const ShardChunk& chunk, v1::ChunkValues* out) {
  // Slots exist only where they are real (averaged, or given at
  // configuration).
  for (size_t s = 0; s < chunk.slots.size(); ++s) {
    v1::OptimizerSlot* slot = out->add_slots();
    slot->set_name(slot_names()[s]);
    slot->mutable_values()->Assign(chunk.slots[s]->begin(), chunk.slots[s]->end());
  }
  return absl::OkStatus();
}

}  // namespace pstrain
