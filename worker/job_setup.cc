#include "worker/job_setup.h"

#include <utility>

#include "common/data/load_dataset.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_backend.h"

namespace pstrain {

absl::StatusOr<std::unique_ptr<Backend>> OpenBackend(const std::string& device, int cpu_threads) {
  PSTRAIN_ASSIGN_OR_RETURN(DeviceSpec spec, ParseDeviceSpec(device));
  const bool cpu = spec.automatic ? !CudaAvailable() : spec.type == DeviceType::kCpu;
  if (cpu) {
    CpuBackendOptions options;
    options.num_threads = cpu_threads;
    return CreateCpuBackend(options);
  }
  return CreateBackend(spec);
}

absl::StatusOr<JobSetup> LoadDataAndBuildModel(const v1::JobSpec& job, Backend* backend,
                                               storage::Storage* store) {
  // Phase: LoadData.
  PSTRAIN_ASSIGN_OR_RETURN(data::DatasetSplits splits,
                           store != nullptr ? data::LoadDataset(job.dataset(), *store)
                                            : data::LoadDataset(job.dataset()));
  PSTRAIN_ASSIGN_OR_RETURN(data::Preprocess preprocess,
                           data::Preprocess::FromSpec(job.dataset(), splits.train.channels));
  // Phase: BuildModel.
  ModelOptions model_options;
  model_options.precision = DataTypeOf(job.precision());
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Model> model,
                           Model::Create(job.model(), backend, model_options));
  PSTRAIN_RETURN_IF_ERROR(model->InitializeParameters());
  return JobSetup{std::move(splits), std::move(preprocess), std::move(model)};
}

}  // namespace pstrain
