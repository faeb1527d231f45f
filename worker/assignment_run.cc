#include "worker/assignment_run.h"

#include <algorithm>
#include <filesystem>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/chunking.h"
#include "common/data/dataset.h"
#include "common/data/epoch_work.h"
#include "common/eval_metrics.h"
#include "common/job_spec.h"
#include "common/status_macros.h"
#include "worker/evaluation.h"

namespace pstrain {
namespace {

bool Transient(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE ||
         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

v1::EvalMetrics EvalShardProto(const EvaluationShard& shard) {
  ClassificationMetrics m = shard.confusion.Compute();
  m.loss = shard.samples > 0 ? shard.loss_sum / shard.samples : 0;
  v1::EvalMetrics proto = EvalMetricsProto(m);
  proto.set_samples(shard.samples);  // As the evaluation counted them, not the matrix.
  return proto;
}

// The job id names a directory: one path component, never a way out.
bool IsFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

}  // namespace

std::shared_ptr<AssignmentRun> AssignmentRun::Create(const v1::Assignment& assignment,
                                                     Options options) {
  return std::shared_ptr<AssignmentRun>(new AssignmentRun(assignment, std::move(options)));
}

AssignmentRun::AssignmentRun(const v1::Assignment& assignment, Options options)
    : options_(std::move(options)),
      job_id_(assignment.job_id()),
      run_id_(assignment.run_id()),
      assignment_(assignment) {}

AssignmentRun::~AssignmentRun() { Join(); }

// --- The run's life, seen from its owner ---------------------------------------

void AssignmentRun::Start(std::function<void(AssignmentRun&, const absl::Status&)> on_end) {
  thread_ = std::thread([this, on_end = std::move(on_end)] {
    const absl::Status status = Run();
    on_end(*this, status);
    done_.store(true);
  });
}

void AssignmentRun::Join() {
  if (thread_.joinable()) thread_.join();
}

v1::Assignment AssignmentRun::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return assignment_;
}

void AssignmentRun::Update(const v1::Assignment& assignment) {
  absl::MutexLock lock(&mu_);
  v1::JobSpec spec = std::move(*assignment_.mutable_spec());
  assignment_ = assignment;
  if (!assignment.has_spec()) *assignment_.mutable_spec() = std::move(spec);
  if (attached_client_ != nullptr) attached_client_->SetGeneration(assignment.generation());
  if (attached_updater_ != nullptr) attached_updater_->SetRank(assignment.rank());
}

void AssignmentRun::Cancel() {
  stop_.store(true);
  absl::MutexLock lock(&mu_);
  if (attached_updater_ != nullptr) attached_updater_->Cancel();
}

void AssignmentRun::Attach(RemoteUpdater* updater, PsClient* client) {
  absl::MutexLock lock(&mu_);
  attached_updater_ = updater;
  attached_client_ = client;
  // The generation may have moved while the client was being created.
  if (client != nullptr) client->SetGeneration(assignment_.generation());
  if (updater != nullptr) {
    updater->SetRank(assignment_.rank());
    if (stop_.load()) updater->Cancel();
  }
}

// --- Run: the phases -------------------------------------------------------------

absl::Status AssignmentRun::Run() {
  absl::Status status = RunPhases();
  ReleaseTraining();
  return status;
}

absl::Status AssignmentRun::RunPhases() {
  start_ = Snapshot();
  job_ = start_.spec();
  PSTRAIN_RETURN_IF_ERROR(BuildModel());
  PSTRAIN_RETURN_IF_ERROR(ConnectAndPull());
  OpenTensorBoard();
  PSTRAIN_RETURN_IF_ERROR(TrainEpochs());
  return FinishAndEvaluate();
}

void AssignmentRun::ReleaseTraining() {
  trainer_.reset();
  tensorboard_.reset();
  Attach(nullptr, nullptr);
  updater_.reset();
  client_.reset();
  setup_.reset();
  backend_.reset();
}

absl::Status AssignmentRun::BuildModel() {
  PSTRAIN_ASSIGN_OR_RETURN(backend_, OpenBackend(options_.device, options_.num_threads));
  // Jobs come from the network: their dataset must lie under --data-root.
  if (job_.dataset().format() != v1::DATASET_FORMAT_SYNTHETIC) {
    PSTRAIN_RETURN_IF_ERROR(options_.data_policy->Check(job_.dataset().path()));
  }
  PSTRAIN_ASSIGN_OR_RETURN(setup_, LoadDataAndBuildModel(job_, backend_.get(), options_.storage));
  return absl::OkStatus();
}

absl::Status AssignmentRun::ConnectAndPull() {
  Model* const model = setup_->model.get();
  PSTRAIN_ASSIGN_OR_RETURN(ChunkPlan plan,
                           PlanChunks(model->graph(), static_cast<int>(options_.shards.size())));
  PsClient::Options client_options;
  client_options.shard_addresses = options_.shards;
  client_options.job_id = job_id_;
  client_options.worker_id = options_.worker_id;
  client_options.generation = start_.generation();
  client_options.rpc_timeout = options_.ps_rpc_timeout;
  client_options.connections_per_shard = options_.connections_per_shard;
  client_options.channel = options_.channel;
  client_options.compression = job_.compression();
  client_options.pace_pushes = ConsistencyModeOf(job_) == v1::CONSISTENCY_SYNC;
  PSTRAIN_ASSIGN_OR_RETURN(client_, PsClient::Create(client_options, std::move(plan)));
  RemoteUpdaterOptions updater_options = RemoteUpdaterOptionsFromJob(job_, start_.rank());
  updater_options.on_step = [this](const StepTimings& t) { OnStep(t); };
  PSTRAIN_ASSIGN_OR_RETURN(updater_, RemoteUpdater::Create(updater_options, model, client_.get()));
  Attach(updater_.get(), client_.get());
  return updater_->Start();
}

void AssignmentRun::OpenTensorBoard() {
  if (options_.tensorboard_dir.empty()) return;
  if (!IsFileName(job_id_)) {
    Log("no TensorBoard output: the job id is not a file name");
    return;
  }
  const std::string dir = (std::filesystem::path(options_.tensorboard_dir) / job_id_ /
                           absl::StrCat("worker-", start_.rank()))
                              .string();
  absl::StatusOr<std::unique_ptr<TfEventsWriter>> writer = TfEventsWriter::Create(dir);
  if (writer.ok()) {
    tensorboard_ = *std::move(writer);
  } else {
    Log(absl::StrCat("no TensorBoard output: ", writer.status().message()));
  }
}

// The coordinator names each epoch's rank and world size (the same for every
// member) and hands out the samples a lost member did not train as tails,
// trained after this member's share.
absl::Status AssignmentRun::TrainEpochs() {
  trainer_options_ = TrainerOptionsFromJob(job_);
  trainer_options_.bench_only_fixed_compute = options_.bench_only_fixed_compute;
  if (options_.bench_only_fixed_compute > absl::ZeroDuration()) {
    Log(absl::StrCat("BENCH ONLY: bench_only_fixed_compute_ms=",
                     absl::ToInt64Milliseconds(options_.bench_only_fixed_compute),
                     ": every step after the first sleeps instead of forward/backward and "
                     "pushes the first step's gradients again; this job does not learn"));
  }
  const data::ImageDataset& train = setup_->splits.train;
  const int64_t epoch_length = job_.dataset().balance() == v1::BALANCE_OVERSAMPLE
                                   ? data::BalancedEpochLength(train.labels, train.num_classes)
                                   : train.size();
  for (int epoch = start_.start_epoch(); epoch < job_.epochs(); ++epoch) {
    PSTRAIN_RETURN_IF_ERROR(TrainEpoch(epoch, epoch_length));
  }
  trainer_.reset();
  return absl::OkStatus();
}

absl::Status AssignmentRun::FinishAndEvaluate() {
  PSTRAIN_RETURN_IF_ERROR(updater_->Finish());
  if (stop_.load()) return absl::CancelledError("the job was stopped");
  const v1::Assignment a = Snapshot();
  EvaluateOptions eval;
  eval.batch_size = std::max(job_.batch_size(), 256);
  eval.rank = a.rank();
  eval.world_size = std::max(1, a.world_size());
  PSTRAIN_ASSIGN_OR_RETURN(EvaluationShard shard, EvaluateShard(*setup_->model, setup_->splits.test,
                                                                setup_->preprocess, eval));
  v1::ReportProgressRequest report = NewReport();
  report.set_generation(a.generation());
  report.set_epoch(job_.epochs());
  report.set_step(global_step_ < 0 ? 0 : global_step_);
  *report.mutable_eval_shard() = EvalShardProto(shard);
  if (static_cast<int>(setup_->splits.class_names.size()) == report.eval_shard().num_classes()) {
    for (const std::string& name : setup_->splits.class_names) {
      report.mutable_eval_shard()->add_class_names(name.substr(0, kMaxClassNameBytes));
    }
  }
  report.set_finished(true);
  WriteScalars(report.step(), {{"test/shard_accuracy", report.eval_shard().accuracy()},
                               {"test/shard_loss", report.eval_shard().loss()}});
  Log(absl::StrFormat("test shard %d/%d: accuracy %.4f on %d samples", eval.rank, eval.world_size,
                      report.eval_shard().accuracy(), shard.samples));
  SendFinalReport(std::move(report));
  return absl::OkStatus();
}

// --- TrainEpochs, one epoch ----------------------------------------------------------

absl::Status AssignmentRun::TrainEpoch(int epoch, int64_t epoch_length) {
  PSTRAIN_ASSIGN_OR_RETURN(v1::EpochPlanResponse plan,
                           AskEpochPlan(epoch, epoch_length, /*share_done=*/false, 0));
  PSTRAIN_RETURN_IF_ERROR(TrainerFor(plan, epoch));
  const int64_t first_step = FirstStep(epoch);
  global_step_ = epoch * trainer_->steps_per_epoch() + first_step;
  trainer_->set_global_step(global_step_);
  const data::WorkSegment base = trainer_->BaseSegment(epoch);
  if (first_step > 0) {
    trained_[epoch] +=
        data::SamplesAfter(base.range.size(), base.steps, job_.batch_size(), first_step);
  }
  const ProgressFn progress = [this, epoch](const StepProgress& p) { OnProgress(epoch, p); };
  PSTRAIN_ASSIGN_OR_RETURN(
      EpochStats stats,
      trainer_->RunEpoch(epoch, progress, options_.progress_every_steps, first_step));
  trained_[epoch] += stats.applied_samples;
  PSTRAIN_RETURN_IF_ERROR(TrainTails(epoch, epoch_length, &stats));
  global_step_ = trainer_->global_step();
  ReportEpochEnd(epoch, stats);
  return absl::OkStatus();
}

absl::Status AssignmentRun::TrainerFor(const v1::EpochPlanResponse& plan, int epoch) {
  if (trainer_ == nullptr || plan.rank() != trainer_options_.rank ||
      plan.world_size() != trainer_options_.world_size) {
    trainer_options_.rank = plan.rank();
    trainer_options_.world_size = std::max(1, plan.world_size());
    trainer_.reset();
    PSTRAIN_ASSIGN_OR_RETURN(
        trainer_, Trainer::Create(setup_->model.get(), updater_.get(), &setup_->splits.train,
                                  setup_->preprocess, trainer_options_));
  }
  if (plan.base_steps() != trainer_->steps_per_epoch()) {
    return absl::InternalError(absl::StrCat("epoch ", epoch + 1, ": the coordinator plans ",
                                            plan.base_steps(), " steps, this worker counts ",
                                            trainer_->steps_per_epoch()));
  }
  return absl::OkStatus();
}

int64_t AssignmentRun::FirstStep(int epoch) {
  if (global_step_ >= 0) return 0;  // Not the run's first epoch.
  const int64_t steps_per_epoch = trainer_->steps_per_epoch();
  const int64_t into = start_.start_step() - epoch * steps_per_epoch;
  if (into <= 0 || into >= steps_per_epoch) return 0;
  Log(absl::StrCat("resuming epoch ", epoch + 1, " at step ", into, " of ", steps_per_epoch));
  return into;
}

// Asks until every tail handed out is trained (the epoch ends for this
// member with that answer).
absl::Status AssignmentRun::TrainTails(int epoch, int64_t epoch_length, EpochStats* stats) {
  int tails_done = 0;
  for (;;) {
    PSTRAIN_ASSIGN_OR_RETURN(v1::EpochPlanResponse plan,
                             AskEpochPlan(epoch, epoch_length, /*share_done=*/true, tails_done));
    if (plan.tails_size() <= tails_done) return absl::OkStatus();
    for (; tails_done < plan.tails_size(); ++tails_done) {
      const v1::WorkSegment& t = plan.tails(tails_done);
      const data::WorkSegment segment{{t.epoch(), t.begin(), t.end()}, t.steps()};
      Log(absl::StrCat("epoch ", epoch + 1, ": training ", segment.range.size(),
                       " samples a lost worker left (epoch ", t.epoch() + 1, " positions ",
                       t.begin(), "..", t.end(), ", ", t.steps(), " steps)"));
      SegmentOptions tail;
      tail.tail = true;
      tail.tail_index = tails_done;
      tail.progress_every = 0;
      PSTRAIN_ASSIGN_OR_RETURN(EpochStats tail_stats,
                               trainer_->RunSegment(epoch, segment, nullptr, tail));
      trained_[t.epoch()] += tail_stats.applied_samples;
      stats->samples += tail_stats.samples;
      stats->seconds += tail_stats.seconds;
    }
  }
}

void AssignmentRun::ReportEpochEnd(int epoch, const EpochStats& stats) {
  v1::ReportProgressRequest report = NewReport();
  report.set_generation(Snapshot().generation());
  report.set_epoch(epoch + 1);
  report.set_step(global_step_);
  report.set_loss(stats.mean_loss);
  report.set_train_accuracy(stats.train_accuracy);
  report.set_samples_per_sec(stats.samples_per_sec);
  report.set_steps_per_epoch(trainer_->steps_per_epoch());
  // Not dropped for a periodic report still in flight: the epoch's
  // checkpoint waits for this one.
  AwaitNoReport(absl::Now() + options_.rpc_timeout);
  ReportProgressAsync(std::move(report));
  options_.metrics->ObserveEpoch(stats);
  options_.log(
      absl::StrFormat("%s: epoch %d/%d  loss %.4f  train_acc %.4f  %.1f samples/s  %.1f s  "
                      "(%d samples trained)",
                      job_id_, epoch + 1, job_.epochs(), stats.mean_loss, stats.train_accuracy,
                      stats.samples_per_sec, stats.seconds, trained_[epoch]));
}

// --- Hooks ---------------------------------------------------------------------------

void AssignmentRun::OnStep(const StepTimings& t) {
  steps_.fetch_add(1);
  if (options_.bench_only_fixed_compute > absl::ZeroDuration()) {
    // One line per step for bench/cluster_emulation.sh (BENCH ONLY runs).
    options_.log(absl::StrFormat(
        "%s: BENCH ONLY bench_only_fixed_compute_ms=%d step %d end_unix_us %d total_ms %.3f "
        "pull_wait_ms %.3f compute_ms %.3f push_wait_ms %.3f",
        job_id_, absl::ToInt64Milliseconds(options_.bench_only_fixed_compute), t.step,
        absl::ToUnixMicros(absl::Now()), 1e3 * t.total_seconds, 1e3 * t.pull_wait_seconds,
        1e3 * t.compute_seconds, 1e3 * t.push_wait_seconds));
  }
  TrainingMetrics& metrics = *options_.metrics;
  metrics.ObserveStep(t);
  metrics.ObservePrecision(*setup_->model, &overflowed_seen_);
  if (trainer_ != nullptr) {
    metrics.ObserveData(trainer_->last_data_wait_seconds(), trainer_->prefetch_queue_depth());
  }
  if (updater_ != nullptr) metrics.ObserveResyncs(updater_->resyncs(), &resyncs_seen_);
}

void AssignmentRun::OnProgress(int epoch, const StepProgress& p) {
  options_.metrics->ObserveProgress(p);
  v1::ReportProgressRequest report = NewReport();
  report.set_generation(Snapshot().generation());
  // The epoch counts as done only after its tails: an epoch checkpoint, and
  // a re-formed run, must not start before them.
  report.set_epoch(epoch);
  report.set_step(p.global_step);
  report.set_loss(p.mean_loss);
  report.set_train_accuracy(p.train_accuracy);
  report.set_samples_per_sec(p.samples_per_sec);
  report.set_steps_per_epoch(p.steps_in_epoch);
  ReportProgressAsync(std::move(report));
  WriteScalars(p.global_step, {{"train/loss", p.mean_loss},
                               {"train/accuracy", p.train_accuracy},
                               {"train/samples_per_sec", p.samples_per_sec}});
}

void AssignmentRun::WriteScalars(int64_t step, const std::vector<TfScalar>& scalars) {
  if (tensorboard_ == nullptr) return;
  absl::Status status = tensorboard_->WriteScalars(step, scalars);
  if (status.ok()) status = tensorboard_->Flush();
  if (!status.ok()) {
    Log(absl::StrCat("no more TensorBoard output: ", status.message()));
    tensorboard_.reset();
  }
}

// --- The coordinator ---------------------------------------------------------------

v1::ReportProgressRequest AssignmentRun::NewReport() const {
  v1::ReportProgressRequest report;
  report.set_worker_id(options_.worker_id);
  report.set_job_id(job_id_);
  report.set_run_id(run_id_);
  return report;
}

absl::StatusOr<v1::EpochPlanResponse> AssignmentRun::AskEpochPlan(int epoch, int64_t epoch_length,
                                                                  bool share_done, int tails_done) {
  v1::EpochPlanRequest request;
  request.set_worker_id(options_.worker_id);
  request.set_job_id(job_id_);
  request.set_run_id(run_id_);
  request.set_epoch(epoch);
  request.set_epoch_length(epoch_length);
  request.set_share_done(share_done);
  request.set_tails_done(tails_done);
  request.set_batch_size(job_.batch_size());
  for (const auto& [e, samples] : trained_) {
    v1::EpochSamples* t = request.add_trained();
    t->set_epoch(e);
    t->set_samples(samples);
  }
  // A loss being redistributed answers `wait`; the coordinator may restart.
  // Both are bounded by the parameter-server deadline (a sync step waits as
  // long for a lost member).
  const absl::Time give_up = absl::Now() + options_.ps_rpc_timeout;
  absl::Duration backoff = absl::Milliseconds(20);
  for (;;) {
    if (stop_.load()) return absl::CancelledError("the job was stopped");
    v1::EpochPlanResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(options_.rpc_timeout));
    grpc::Status status = options_.coordinator->EpochPlan(&ctx, request, &response);
    if (status.ok() && !response.wait()) return response;
    // ABORTED, NOT_FOUND, FAILED_PRECONDITION: this run was replaced (server
    // 0 restarted, the job went back to the queue); the heartbeat stops this
    // run within a second, so wait for that rather than fail.
    const bool replaced = status.error_code() == grpc::StatusCode::ABORTED ||
                          status.error_code() == grpc::StatusCode::NOT_FOUND ||
                          status.error_code() == grpc::StatusCode::FAILED_PRECONDITION;
    if (!status.ok() && !Transient(status) && !replaced) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          absl::StrCat("epoch plan: ", status.error_message()));
    }
    if (absl::Now() + backoff > give_up) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no plan for epoch ", epoch + 1, " within ",
          absl::FormatDuration(options_.ps_rpc_timeout),
          status.ok() ? " (the coordinator kept redistributing a lost member's samples)"
                      : absl::StrCat(": ", status.error_message())));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
}

bool AssignmentRun::BeginReport() {
  absl::MutexLock lock(&mu_);
  if (report_in_flight_) return false;
  report_in_flight_ = true;
  return true;
}

void AssignmentRun::EndReport() {
  absl::MutexLock lock(&mu_);
  report_in_flight_ = false;
}

bool AssignmentRun::AwaitNoReport(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(absl::Condition(this, &AssignmentRun::NoReportInFlight), deadline);
}

void AssignmentRun::ReportProgressAsync(v1::ReportProgressRequest request) {
  if (!BeginReport()) return;  // One at a time; this one is dropped.
  struct Call {
    grpc::ClientContext ctx;
    v1::ReportProgressRequest request;
    v1::ReportProgressResponse response;
  };
  auto* call = new Call;
  call->request = std::move(request);
  call->ctx.set_deadline(DeadlineFromNow(options_.rpc_timeout));
  options_.coordinator->async()->ReportProgress(
      &call->ctx, &call->request, &call->response,
      [self = shared_from_this(), call](grpc::Status status) {
        if (status.ok() && call->response.stop()) {
          self->Log("the coordinator says stop");
          self->Cancel();
        }
        delete call;
        self->EndReport();
      });
}

void AssignmentRun::SendFinalReport(v1::ReportProgressRequest request) {
  // Wait for a periodic report still in flight, so that the final one is last.
  // Its call ends by its own deadline (rpc_timeout); past that and a margin
  // the final report goes anyway.
  if (!AwaitNoReport(absl::Now() + options_.rpc_timeout + absl::Seconds(5))) {
    Log("a progress report is still in flight; final report sent");
  }
  absl::Duration backoff = absl::Milliseconds(100);
  const absl::Time give_up = absl::Now() + absl::Minutes(2);
  for (;;) {
    v1::ReportProgressResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(options_.rpc_timeout));
    grpc::Status status = options_.coordinator->ReportProgress(&ctx, request, &response);
    if (status.ok()) return;
    if (!Transient(status) || absl::Now() + backoff > give_up) {
      Log(absl::StrCat("final report not delivered: ", status.error_message()));
      return;
    }
    // Stopped: replaced, or the daemon shuts down (Shutdown() cancels the run).
    if (stop_.load()) return;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

void AssignmentRun::ReportFailure(const absl::Status& status) {
  v1::ReportProgressRequest report = NewReport();
  report.set_generation(Snapshot().generation());
  report.set_error(absl::StrCat(options_.hostname, ": ", status.ToString()));
  SendFinalReport(std::move(report));
}

}  // namespace pstrain
