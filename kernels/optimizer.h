// Optimizers shared by the worker (local steps) and the parameter server
// (remote steps): SGD, momentum (optionally Nesterov), Adam and AdamW, L2 or
// decoupled weight decay, and learning-rate schedules.
//
//   PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> opt,
//                            Optimizer::Create(spec.optimizer(), backend));
//   PSTRAIN_RETURN_IF_ERROR(opt->AddParameter("fc1/weight", w.num_elements()));
//   ...
//   // Each step, after the gradients are ready:
//   PSTRAIN_RETURN_IF_ERROR(opt->Apply(0, w.data(), dw.data(), step));
//
// Threads: one thread at a time, like the Backend it runs on; except that
// Apply (and reads of the state tensors) for different parameter indices may
// run concurrently when the backend's updates allow it (the CPU backend's
// do: kernels/cpu/cpu_backend.h). Create and AddParameter come first, alone.
#ifndef PSTRAIN_KERNELS_OPTIMIZER_H_
#define PSTRAIN_KERNELS_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain {

// Checks an OptimizerSpec; the message names the offending field
// ("optimizer.learning_rate must be > 0, got -1").
absl::Status ValidateOptimizerSpec(const v1::OptimizerSpec& spec);

// The learning rate at each iteration: base rate, then warm-up, then either
// the step map (DL4J MapSchedule semantics) or cosine decay. Immutable after
// construction; thread-safe.
class LearningRateSchedule {
 public:
  explicit LearningRateSchedule(const v1::OptimizerSpec& spec);
  // `iteration` is 0-based.
  float RateAt(int64_t iteration) const;

 private:
  float base_rate_;
  v1::LrSchedule schedule_;
};

// One optimizer instance owns the state slots (momentum, Adam moments) of
// every parameter registered with it, in device memory of `backend`.
class Optimizer {
 public:
  // Fails with INVALID_ARGUMENT when ValidateOptimizerSpec fails.
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(const v1::OptimizerSpec& spec,
                                                           Backend* backend);

  // Registers a parameter of `count` floats and allocates its zeroed state.
  // Returns its index for Apply(). Names must be unique.
  absl::StatusOr<int> AddParameter(const std::string& name, int64_t count);

  // Updates param in place from grad at 0-based iteration `step` (the rate is
  // schedule().RateAt(step); Adam's bias correction uses step + 1).
  absl::Status Apply(int index, float* param, const float* grad, int64_t step);

  // State tensors, named "<parameter>/<slot>" (slots: "momentum" for SGD with
  // momentum, "adam_m" and "adam_v" for Adam/AdamW), in registration order.
  // Used by checkpoints and by parameter averaging. Pointers stay valid for
  // the optimizer's lifetime.
  std::vector<std::pair<std::string, Tensor*>> StateTensors();

  const LearningRateSchedule& schedule() const { return schedule_; }
  const v1::OptimizerSpec& spec() const { return spec_; }

 private:
  struct Slot {
    std::string name;
    int64_t count = 0;
    Tensor first;   // momentum, or Adam m.
    Tensor second;  // Adam v.
  };
  Optimizer(const v1::OptimizerSpec& spec, Backend* backend);

  // Constant after construction.
  const v1::OptimizerSpec spec_;
  Backend* const backend_;
  const LearningRateSchedule schedule_;

  // One entry per registered parameter. Heap-allocated so that the Tensor
  // pointers handed out by StateTensors() survive later AddParameter() calls.
  std::vector<std::unique_ptr<Slot>> slots_;
};

}  // namespace pstrain

#endif  // PSTRAIN_KERNELS_OPTIMIZER_H_
