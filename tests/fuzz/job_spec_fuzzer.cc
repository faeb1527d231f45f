// Job-spec JSON and its validation: what SubmitJob does with a job before it
// is queued (ParseJobSpec as the CLI does, then ValidateJobSpec,
// BuildModelGraph, CheckJobLimits with the server's default limits and the
// chunk plan of a two-shard server).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/chunking.h"
#include "common/job_spec.h"
#include "common/model_graph.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  // Relative model_file and dataset paths resolve in an empty directory.
  auto job = pstrain::ParseJobSpec(json, pstrain::fuzz::ScratchDir(), "fuzz");
  if (!job.ok()) return 0;
  pstrain::ApplyJobDefaults(&*job);
  if (!pstrain::ValidateJobSpec(*job).ok()) return 0;
  auto graph = pstrain::BuildModelGraph(job->model());
  if (!graph.ok()) return 0;
  if (!pstrain::CheckJobLimits(*job, *graph, pstrain::JobLimits()).ok()) return 0;
  (void)pstrain::PlanChunks(*graph, 2);
  (void)pstrain::JobSpecToJson(*job);
  return 0;
}
