// What training a job on this machine starts from, the same for
// `pstrain-worker --standalone` (standalone.h) and for a daemon's assignment
// (assignment_run.h): the backend, the job's data, and its model with fresh
// parameters.
//
//   PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, OpenBackend("auto", 0));
//   PSTRAIN_ASSIGN_OR_RETURN(JobSetup setup, LoadDataAndBuildModel(job, backend.get()));
//   ... Trainer::Create(setup.model.get(), updater, &setup.splits.train, setup.preprocess, ...)
//
// A JobSetup is moved only before a trainer points into its splits.
#ifndef PSTRAIN_WORKER_JOB_SETUP_H_
#define PSTRAIN_WORKER_JOB_SETUP_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/data/dataset.h"
#include "kernels/backend.h"
#include "pstrain/v1/job.pb.h"
#include "worker/model.h"

namespace pstrain::storage {
class Storage;
}  // namespace pstrain::storage

namespace pstrain {

// The backend for `device` (auto | cpu | cuda | cuda:N; auto: CUDA when a
// device is usable, else the CPU). `cpu_threads` is the CPU backend's
// OpenMP threads (CpuBackendOptions::num_threads; 0 = its default).
// INVALID_ARGUMENT for a malformed device; FAILED_PRECONDITION for a CUDA
// device that is not there.
absl::StatusOr<std::unique_ptr<Backend>> OpenBackend(const std::string& device, int cpu_threads);

struct JobSetup {
  data::DatasetSplits splits;
  data::Preprocess preprocess;   // For splits.train's channels.
  std::unique_ptr<Model> model;  // In the job's precision, parameters initialised.
};

// Phases LoadData (the job's dataset and its preprocessing) and BuildModel
// (the job's model on `backend`, which must outlive it, in the job's
// precision, with initialised parameters). The dataset path is not checked
// against any allow-list here: a caller that takes jobs from the network
// checks it first (data::DataPathPolicy). The dataset is read through
// `store` (local paths and, when it has S3 settings, s3://); null: local
// paths only.
absl::StatusOr<JobSetup> LoadDataAndBuildModel(const v1::JobSpec& job, Backend* backend,
                                               storage::Storage* store = nullptr);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_JOB_SETUP_H_
