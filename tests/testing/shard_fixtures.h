// Small jobs and initial chunk values for tests of the parameter server
// (shard, services, client).
//
//   v1::JobSpec job = DenseJob("tiny", 64, 10, /*init_seed=*/7, v1::CONSISTENCY_SYNC);
//   ModelGraph graph = *BuildModelGraph(job.model());
//   ChunkPlan plan = *PlanChunks(graph, 2, 256);
//   shard.ConfigureJob(config, InitialChunks(graph, plan, 0));
#ifndef PSTRAIN_TESTS_TESTING_SHARD_FIXTURES_H_
#define PSTRAIN_TESTS_TESTING_SHARD_FIXTURES_H_

#include <string>
#include <vector>

#include "common/chunking.h"
#include "common/model_graph.h"
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/service.pb.h"

namespace pstrain::testing {

// input [features] -> dense `classes` -> softmax cross-entropy, SGD lr 0.5,
// synthetic data, 1 epoch of batch 1, in `mode` (average: K = 1).
inline v1::JobSpec DenseJob(const std::string& name, int features, int classes,
                            uint64_t init_seed, v1::ConsistencyMode mode) {
  v1::JobSpec job;
  job.set_name(name);
  v1::ModelSpec* model = job.mutable_model();
  model->set_name(name);
  model->add_input_shape(features);
  model->set_num_classes(classes);
  model->set_init_seed(init_seed);
  v1::LayerSpec* fc = model->add_layers();
  fc->set_name("fc1");
  fc->mutable_dense()->set_units(classes);
  v1::LayerSpec* loss = model->add_layers();
  loss->set_name("loss");
  loss->mutable_softmax_cross_entropy();
  job.mutable_dataset()->set_format(v1::DATASET_FORMAT_SYNTHETIC);
  job.mutable_optimizer()->set_type(v1::OPTIMIZER_SGD);
  job.mutable_optimizer()->set_learning_rate(0.5f);
  job.set_epochs(1);
  job.set_batch_size(1);
  job.set_mode(mode);
  if (mode == v1::CONSISTENCY_AVERAGE) job.set_averaging_frequency(1);
  return job;
}

// The initial values of the chunks `shard` owns, in by_shard order.
inline std::vector<v1::ChunkValues> InitialChunks(const ModelGraph& graph, const ChunkPlan& plan,
                                                  int shard) {
  const std::vector<std::vector<float>> params = InitialParameterValues(graph);
  std::vector<v1::ChunkValues> out;
  for (int id : plan.by_shard[shard]) {
    const ChunkInfo& c = plan.chunks[id];
    v1::ChunkValues v;
    v.set_chunk_id(id);
    const float* begin = params[c.param].data() + c.offset;
    v.mutable_values()->Add(begin, begin + c.count);
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_TESTING_SHARD_FIXTURES_H_
