// pstrain._native: the worker protocol of worker/job_worker.h and the modes
// of worker/external_updater.h for Python (pstrain.torch), over pybind11.
// Thin on purpose: protobuf messages cross as serialised bytes (the Python
// side decodes them with pstrain.v1), tensors as the address of their fp32
// host memory (torch's data_ptr(): no copy), and every call that waits
// releases the GIL. A failed call raises pstrain._native.Error, whose
// `code` is the absl status code's name ("UNAVAILABLE", ...).
//
//   w = _native.JobWorker("127.0.0.1:7070", "job-3", token="...")
//   w.declare_model(model_bytes, [p.data_ptr() for p in tensors])
//   assignment = v1.Assignment.FromString(w.await_start(300.0))
//   u = _native.Updater(w, overlap_pulls=True)
//   u.start([p.data_ptr() for p in tensors])
//   u.gradient_ready(i, grad.data_ptr()); u.step(); u.finish()
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/data/dataset.h"
#include "common/data/epoch_work.h"
#include "common/model_graph.h"
#include "common/rpc/security.h"
#include "worker/external_updater.h"
#include "worker/job_worker.h"

namespace py = pybind11;

namespace pstrain {
namespace {

py::object* g_error = nullptr;  // pstrain._native.Error, set at import.

[[noreturn]] void Raise(const absl::Status& status) {
  py::object error = (*g_error)(std::string(status.message()));
  error.attr("code") = absl::StatusCodeToString(status.code());
  PyErr_SetObject(g_error->ptr(), error.ptr());
  throw py::error_already_set();
}

void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

template <typename T>
T Value(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

// Runs `call` without the GIL (it may block); the status is raised, if at
// all, with the GIL held again.
template <typename F>
absl::Status Released(F&& call) {
  py::gil_scoped_release release;
  return call();
}

std::string Serialize(const google::protobuf::Message& message) {
  std::string out;
  message.SerializeToString(&out);
  return out;
}

// A worker bound to one job, with the tensors it declared.
class PyJobWorker {
 public:
  PyJobWorker(const std::string& coordinator, const std::string& job_id, const std::string& tls_ca,
              const std::string& tls_cert, const std::string& tls_key,
              const std::string& tls_server_name, const std::string& token_file,
              const std::string& hostname, const std::string& device_info, double rpc_timeout_s,
              double ps_rpc_timeout_s, double connect_timeout_s, const std::string& launched_by) {
    JobWorker::Options options;
    options.coordinator_address = coordinator;
    options.job_id = job_id;
    TlsOptions tls;
    tls.ca_file = tls_ca;
    tls.cert_file = tls_cert;
    tls.key_file = tls_key;
    tls.server_name = tls_server_name;
    if (tls.enabled()) {
      options.channel.credentials = Value(ChannelCredentialsFor(tls));
      options.channel.tls_server_name = tls_server_name;
    }
    options.identity = std::make_shared<CallIdentity>();
    // The token is read here from its file: it never passes through Python,
    // where an error message could show it.
    if (!token_file.empty()) options.identity->token = Value(ReadTokenFile(token_file));
    options.channel.identity = options.identity;
    options.info.set_hostname(hostname);
    options.info.set_backend("cpu");
    options.info.set_device_info(device_info);
    options.info.set_launched_by(launched_by);
    options.rpc_timeout = absl::Seconds(rpc_timeout_s);
    options.ps_rpc_timeout = absl::Seconds(ps_rpc_timeout_s);
    options.connect_timeout = absl::Seconds(connect_timeout_s);
    absl::StatusOr<std::unique_ptr<JobWorker>> worker;
    {
      py::gil_scoped_release release;
      worker = JobWorker::Create(std::move(options));
    }
    worker_ = Value(std::move(worker));
  }

  bool DeclareModel(const py::bytes& model_bytes, std::vector<uintptr_t> values) {
    v1::ExternalModel model;
    if (!model.ParseFromString(std::string(model_bytes))) {
      Raise(absl::InvalidArgumentError("declare_model: not a serialised ExternalModel"));
    }
    if (static_cast<int>(values.size()) != model.tensors_size()) {
      Raise(absl::InvalidArgumentError(absl::StrCat("declare_model: ", model.tensors_size(),
                                                    " tensors but ", values.size(), " values")));
    }
    std::vector<absl::Span<const float>> spans;
    for (int i = 0; i < model.tensors_size(); ++i) {
      int64_t n = 1;
      for (int64_t d : model.tensors(i).shape()) n *= d;
      spans.emplace_back(reinterpret_cast<const float*>(values[i]), static_cast<size_t>(n));
    }
    absl::StatusOr<bool> declared;
    {
      py::gil_scoped_release release;
      declared = worker_->DeclareModel(
          model, [spans = std::move(spans)](int i) { return spans[static_cast<size_t>(i)]; });
    }
    return Value(std::move(declared));
  }

  py::bytes AwaitStart(double timeout_s) {
    absl::StatusOr<v1::Assignment> assignment;
    {
      py::gil_scoped_release release;
      assignment = worker_->AwaitStart(absl::Seconds(timeout_s));
    }
    return py::bytes(Serialize(Value(std::move(assignment))));
  }

  py::bytes Assignment() { return py::bytes(Serialize(worker_->assignment())); }

  py::bytes EpochPlan(const py::bytes& request_bytes) {
    v1::EpochPlanRequest request;
    if (!request.ParseFromString(std::string(request_bytes))) {
      Raise(absl::InvalidArgumentError("epoch_plan: not a serialised EpochPlanRequest"));
    }
    absl::StatusOr<v1::EpochPlanResponse> response;
    {
      py::gil_scoped_release release;
      response = worker_->EpochPlan(std::move(request));
    }
    return py::bytes(Serialize(Value(std::move(response))));
  }

  bool ReportProgress(const py::bytes& request_bytes) {
    v1::ReportProgressRequest request;
    if (!request.ParseFromString(std::string(request_bytes))) {
      Raise(absl::InvalidArgumentError("report_progress: not a serialised ReportProgressRequest"));
    }
    absl::StatusOr<bool> stop;
    {
      py::gil_scoped_release release;
      stop = worker_->ReportProgress(std::move(request));
    }
    return Value(std::move(stop));
  }

  JobWorker& worker() { return *worker_; }

 private:
  std::unique_ptr<JobWorker> worker_;
};

// The job's mode over the declared tensors, through this worker's shards.
class PyUpdater {
 public:
  PyUpdater(PyJobWorker& worker, bool overlap_pulls) {
    const v1::Assignment assignment = worker.worker().assignment();
    absl::StatusOr<std::shared_ptr<PsClient>> client;
    {
      py::gil_scoped_release release;
      client = worker.worker().ConnectShards();
    }
    client_ = Value(std::move(client));
    graph_ = Value(BuildJobGraph(assignment.spec()));
    ExternalUpdater::Options options =
        ExternalUpdater::OptionsFromJob(assignment.spec(), assignment.rank());
    options.overlap_pulls = overlap_pulls;
    updater_ = std::make_unique<ExternalUpdater>(options, graph_, client_.get());
  }
  ~PyUpdater() {
    py::gil_scoped_release release;
    updater_.reset();
  }

  void Start(std::vector<uintptr_t> params) {
    std::vector<float*> pointers;
    for (uintptr_t p : params) pointers.push_back(reinterpret_cast<float*>(p));
    Check(Released([&] { return updater_->Start(std::move(pointers)); }));
  }
  void GradientReady(int param, uintptr_t grad) {
    Check(Released(
        [&] { return updater_->GradientReady(param, reinterpret_cast<const float*>(grad)); }));
  }
  void Step() {
    Check(Released([&] { return updater_->Step(); }));
  }
  void Finish() {
    Check(Released([&] { return updater_->Finish(); }));
  }
  void WaitParams(const std::vector<int>& params) {
    Check(Released([&] { return updater_->WaitParams(params); }));
  }
  void Settle() {
    Check(Released([&] { return updater_->Settle(); }));
  }
  void Cancel() { updater_->Cancel(); }
  void SetRank(int rank) { updater_->SetRank(rank); }
  int64_t version() const { return updater_->version(); }
  int resyncs() const { return updater_->resyncs(); }

 private:
  std::shared_ptr<PsClient> client_;
  ModelGraph graph_;
  std::unique_ptr<ExternalUpdater> updater_;
};

}  // namespace
}  // namespace pstrain

PYBIND11_MODULE(_native, m) {
  using namespace pstrain;
  m.doc() = "pstrain's worker protocol (C++) for pstrain.torch";
  static py::object error = py::reinterpret_borrow<py::object>(
      PyErr_NewException("pstrain._native.Error", PyExc_RuntimeError, nullptr));
  g_error = &error;
  m.attr("Error") = error;

  py::class_<PyJobWorker>(m, "JobWorker")
      .def(py::init<const std::string&, const std::string&, const std::string&, const std::string&,
                    const std::string&, const std::string&, const std::string&, const std::string&,
                    const std::string&, double, double, double, const std::string&>(),
           py::arg("coordinator"), py::arg("job_id"), py::arg("tls_ca") = "",
           py::arg("tls_cert") = "", py::arg("tls_key") = "", py::arg("tls_server_name") = "",
           py::arg("token_file") = "", py::arg("hostname") = "", py::arg("device_info") = "",
           py::arg("rpc_timeout_s") = 10.0, py::arg("ps_rpc_timeout_s") = 120.0,
           py::arg("connect_timeout_s") = 60.0, py::arg("launched_by") = "")
      .def("declare_model", &PyJobWorker::DeclareModel)
      .def("await_start", &PyJobWorker::AwaitStart)
      .def("assignment", &PyJobWorker::Assignment)
      .def("epoch_plan", &PyJobWorker::EpochPlan)
      .def("report_progress", &PyJobWorker::ReportProgress)
      .def("set_run_steps", [](PyJobWorker& w, int64_t steps) { w.worker().SetRunSteps(steps); })
      .def("shutdown",
           [](PyJobWorker& w) {
             py::gil_scoped_release release;
             w.worker().Shutdown();
           })
      .def_property_readonly("worker_id", [](PyJobWorker& w) { return w.worker().worker_id(); })
      .def_property_readonly("stopped", [](PyJobWorker& w) { return w.worker().stopped(); })
      .def_property_readonly("run_number", [](PyJobWorker& w) { return w.worker().run_number(); })
      .def("await_new_run",
           [](PyJobWorker& w, int64_t from, double timeout_s) {
             py::gil_scoped_release release;
             return w.worker().AwaitNewRun(from, absl::Seconds(timeout_s));
           })
      .def_property_readonly("stop_reason",
                             [](PyJobWorker& w) { return w.worker().stop_reason(); });

  py::class_<PyUpdater>(m, "Updater")
      .def(py::init<PyJobWorker&, bool>(), py::arg("worker"), py::arg("overlap_pulls") = false,
           py::keep_alive<1, 2>())
      .def("start", &PyUpdater::Start)
      .def("gradient_ready", &PyUpdater::GradientReady)
      .def("step", &PyUpdater::Step)
      .def("finish", &PyUpdater::Finish)
      .def("wait_params", &PyUpdater::WaitParams)
      .def("settle", &PyUpdater::Settle)
      .def("cancel", &PyUpdater::Cancel)
      .def("set_rank", &PyUpdater::SetRank)
      .def_property_readonly("version", &PyUpdater::version)
      .def_property_readonly("resyncs", &PyUpdater::resyncs);

  // The epoch's sample order (shuffled from the job's seed), the same on
  // every machine as the C++ workers' (common/data/dataset.h).
  m.def("epoch_order", [](int64_t n, uint64_t seed, int epoch) {
    return data::EpochOrder(n, seed, epoch, 0, 1, /*shuffle=*/true);
  });
  // Rank's share [begin, end) of an epoch, and the cumulative samples after
  // each of `steps` steps over `size` samples (common/data/epoch_work.h).
  m.def("base_range", [](int64_t length, int epoch, int rank, int world_size) {
    const data::WorkRange r = data::BaseRange(length, epoch, rank, world_size);
    return std::make_pair(r.begin, r.end);
  });
  m.def("batch_ends",
        [](int64_t size, int64_t steps, int batch) { return data::BatchEnds(size, steps, batch); });
}
