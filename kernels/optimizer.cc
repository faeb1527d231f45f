#include "kernels/optimizer.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numbers>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

constexpr float kDefaultBeta1 = 0.9f;
constexpr float kDefaultBeta2 = 0.999f;
constexpr float kDefaultEpsilon = 1e-8f;

bool IsAdamFamily(v1::OptimizerType type) {
  return type == v1::OPTIMIZER_ADAM || type == v1::OPTIMIZER_ADAMW;
}

absl::Status FieldError(absl::string_view field, absl::string_view rule, double value) {
  return absl::InvalidArgumentError(
      absl::StrCat("optimizer.", field, " must be ", rule, ", got ", value));
}

// Checks 0 <= value < 1 (finite by construction of the comparison).
absl::Status CheckUnitInterval(absl::string_view field, float value) {
  if (!(value >= 0.f && value < 1.f)) return FieldError(field, "in [0, 1)", value);
  return absl::OkStatus();
}

absl::Status CheckNonNegativeFinite(absl::string_view field, float value) {
  if (!(std::isfinite(value) && value >= 0.f)) return FieldError(field, "finite and >= 0", value);
  return absl::OkStatus();
}

absl::Status ValidateSchedule(const v1::OptimizerSpec& spec) {
  const v1::LrSchedule& schedule = spec.schedule();
  for (const auto& [iteration, rate] : schedule.step_map()) {
    if (iteration < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer.schedule.step_map keys (iterations) must be >= 0, got ", iteration));
    }
    if (!(std::isfinite(rate) && rate > 0.f)) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer.schedule.step_map[", iteration,
                                                     "] must be finite and > 0, got ", rate));
    }
  }
  if (schedule.cosine_decay_steps() < 0) {
    return FieldError("schedule.cosine_decay_steps", ">= 0",
                      static_cast<double>(schedule.cosine_decay_steps()));
  }
  if (!schedule.step_map().empty() && schedule.cosine_decay_steps() > 0) {
    return absl::InvalidArgumentError(
        "optimizer.schedule: step_map and cosine_decay_steps are mutually exclusive; set one");
  }
  const float min_rate = schedule.min_learning_rate();
  if (!(std::isfinite(min_rate) && min_rate >= 0.f && min_rate <= spec.learning_rate())) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.schedule.min_learning_rate must be in [0, learning_rate = ",
                     spec.learning_rate(), "], got ", min_rate));
  }
  if (schedule.warmup_steps() < 0) {
    return FieldError("schedule.warmup_steps", ">= 0",
                      static_cast<double>(schedule.warmup_steps()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateOptimizerSpec(const v1::OptimizerSpec& spec) {
  if (spec.type() != v1::OPTIMIZER_SGD && !IsAdamFamily(spec.type())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.type must be OPTIMIZER_SGD, OPTIMIZER_ADAM or OPTIMIZER_ADAMW, got ",
        v1::OptimizerType_IsValid(spec.type()) ? v1::OptimizerType_Name(spec.type())
                                               : absl::StrCat(static_cast<int>(spec.type()))));
  }
  if (!(std::isfinite(spec.learning_rate()) && spec.learning_rate() > 0.f)) {
    return FieldError("learning_rate", "finite and > 0", spec.learning_rate());
  }
  PSTRAIN_RETURN_IF_ERROR(CheckUnitInterval("momentum", spec.momentum()));
  if (spec.nesterov()) {
    if (spec.type() != v1::OPTIMIZER_SGD) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer.nesterov requires type OPTIMIZER_SGD, got ",
                       v1::OptimizerType_Name(spec.type())));
    }
    if (spec.momentum() <= 0.f) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer.nesterov requires optimizer.momentum > 0, got ", spec.momentum()));
    }
  }
  PSTRAIN_RETURN_IF_ERROR(CheckUnitInterval("beta1", spec.beta1()));
  PSTRAIN_RETURN_IF_ERROR(CheckUnitInterval("beta2", spec.beta2()));
  PSTRAIN_RETURN_IF_ERROR(CheckNonNegativeFinite("epsilon", spec.epsilon()));
  PSTRAIN_RETURN_IF_ERROR(CheckNonNegativeFinite("weight_decay", spec.weight_decay()));
  return ValidateSchedule(spec);
}

// ---------------------------------------------------------------------------
// LearningRateSchedule
// ---------------------------------------------------------------------------

LearningRateSchedule::LearningRateSchedule(const v1::OptimizerSpec& spec)
    : base_rate_(spec.learning_rate()), schedule_(spec.schedule()) {}

float LearningRateSchedule::RateAt(int64_t iteration) const {
  if (iteration < 0) iteration = 0;
  const int64_t warmup = schedule_.warmup_steps();
  double rate = base_rate_;

  if (!schedule_.step_map().empty()) {
    // DL4J MapSchedule: the value of the largest key <= iteration. The proto
    // map is unordered, so scan for that key.
    int64_t best_key = -1;
    for (const auto& [key, value] : schedule_.step_map()) {
      if (key <= iteration && key > best_key) {
        best_key = key;
        rate = value;
      }
    }
  } else if (schedule_.cosine_decay_steps() > 0) {
    const double total = static_cast<double>(schedule_.cosine_decay_steps());
    const int64_t after_warmup = std::max<int64_t>(iteration - warmup, 0);
    const double t = std::min(static_cast<double>(after_warmup), total);
    const double min_rate = schedule_.min_learning_rate();
    rate = min_rate + (rate - min_rate) * 0.5 * (1.0 + std::cos(std::numbers::pi * t / total));
  }

  if (warmup > 0 && iteration < warmup) {
    rate *= static_cast<double>(iteration + 1) / static_cast<double>(warmup);
  }
  return static_cast<float>(rate);
}

// ---------------------------------------------------------------------------
// Optimizer
// ---------------------------------------------------------------------------

Optimizer::Optimizer(const v1::OptimizerSpec& spec, Backend* backend)
    : spec_(spec), backend_(backend), schedule_(spec) {}

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(const v1::OptimizerSpec& spec,
                                                             Backend* backend) {
  PSTRAIN_RETURN_IF_ERROR(ValidateOptimizerSpec(spec));
  if (backend == nullptr) return absl::InvalidArgumentError("Optimizer::Create: backend is null");
  return std::unique_ptr<Optimizer>(new Optimizer(spec, backend));
}

absl::StatusOr<int> Optimizer::AddParameter(const std::string& name, int64_t count) {
  if (name.empty()) return absl::InvalidArgumentError("Optimizer::AddParameter: empty name");
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Optimizer::AddParameter(", name, "): negative count ", count));
  }
  for (const std::unique_ptr<Slot>& slot : slots_) {
    if (slot->name == name) {
      return absl::AlreadyExistsError(
          absl::StrCat("Optimizer::AddParameter: parameter '", name, "' is already registered"));
    }
  }
  auto slot = std::make_unique<Slot>();
  slot->name = name;
  slot->count = count;
  const bool needs_momentum = spec_.type() == v1::OPTIMIZER_SGD && spec_.momentum() > 0.f;
  const bool needs_adam = IsAdamFamily(spec_.type());
  if (needs_momentum || needs_adam) {
    PSTRAIN_ASSIGN_OR_RETURN(slot->first, backend_->AllocateTensor(Shape{count}));
    PSTRAIN_RETURN_IF_ERROR(backend_->Fill(slot->first.data(), 0.f, count));
  }
  if (needs_adam) {
    PSTRAIN_ASSIGN_OR_RETURN(slot->second, backend_->AllocateTensor(Shape{count}));
    PSTRAIN_RETURN_IF_ERROR(backend_->Fill(slot->second.data(), 0.f, count));
  }
  slots_.push_back(std::move(slot));
  return static_cast<int>(slots_.size() - 1);
}

absl::Status Optimizer::Apply(int index, float* param, const float* grad, int64_t step) {
  if (index < 0 || index >= static_cast<int>(slots_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("Optimizer::Apply: parameter index ", index,
                                                   " out of range [0, ", slots_.size(), ")"));
  }
  Slot& slot = *slots_[index];
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Optimizer::Apply(", slot.name, "): negative step ", step));
  }
  if (slot.count == 0) return absl::OkStatus();
  if (param == nullptr || grad == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("Optimizer::Apply(", slot.name, "): null param or grad"));
  }
  const float rate = schedule_.RateAt(step);

  if (spec_.type() == v1::OPTIMIZER_SGD) {
    SgdHyper hyper;
    hyper.learning_rate = rate;
    hyper.momentum = spec_.momentum();
    hyper.nesterov = spec_.nesterov();
    hyper.weight_decay = spec_.weight_decay();
    float* velocity = slot.first.empty() ? nullptr : slot.first.data();
    return backend_->SgdUpdate(param, grad, velocity, slot.count, hyper);
  }

  AdamHyper hyper;
  hyper.learning_rate = rate;
  hyper.beta1 = spec_.beta1() > 0.f ? spec_.beta1() : kDefaultBeta1;
  hyper.beta2 = spec_.beta2() > 0.f ? spec_.beta2() : kDefaultBeta2;
  hyper.epsilon = spec_.epsilon() > 0.f ? spec_.epsilon() : kDefaultEpsilon;
  hyper.weight_decay = spec_.weight_decay();
  hyper.decoupled_weight_decay = spec_.type() == v1::OPTIMIZER_ADAMW;
  hyper.step = step + 1;
  return backend_->AdamUpdate(param, grad, slot.first.data(), slot.second.data(), slot.count,
                              hyper);
}

std::vector<std::pair<std::string, Tensor*>> Optimizer::StateTensors() {
  std::vector<std::pair<std::string, Tensor*>> out;
  const bool adam = IsAdamFamily(spec_.type());
  for (const std::unique_ptr<Slot>& slot : slots_) {
    if (adam) {
      out.emplace_back(slot->name + "/adam_m", &slot->first);
      out.emplace_back(slot->name + "/adam_v", &slot->second);
    } else if (!slot->first.empty()) {
      out.emplace_back(slot->name + "/momentum", &slot->first);
    }
  }
  return out;
}

}  // namespace pstrain
