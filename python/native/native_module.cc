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
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/checkpoint.h"
#include "common/data/dataset.h"
#include "common/data/epoch_work.h"
#include "common/data/image_codec.h"
#include "common/data/packed_format.h"
#include "common/model_graph.h"
#include "common/rpc/security.h"
#include "common/storage/s3_flags.h"
#include "common/storage/storage.h"
#include "worker/daemon.h"
#include "worker/evaluation.h"
#include "worker/external_updater.h"
#include "worker/job_setup.h"
#include "worker/job_worker.h"
#include "worker/model.h"

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

// TLS for `channel` (when a CA or certificate is given) and the token from
// its file into `identity` (the token never passes through Python, where an
// error message could show it); channel.identity becomes `identity`.
void SecureChannel(const std::string& tls_ca, const std::string& tls_cert,
                   const std::string& tls_key, const std::string& tls_server_name,
                   const std::string& token_file, ChannelOptions& channel,
                   std::shared_ptr<CallIdentity>& identity) {
  TlsOptions tls;
  tls.ca_file = tls_ca;
  tls.cert_file = tls_cert;
  tls.key_file = tls_key;
  tls.server_name = tls_server_name;
  if (tls.enabled()) {
    channel.credentials = Value(ChannelCredentialsFor(tls));
    channel.tls_server_name = tls_server_name;
  }
  identity = std::make_shared<CallIdentity>();
  if (!token_file.empty()) identity->token = Value(ReadTokenFile(token_file));
  channel.identity = identity;
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
    SecureChannel(tls_ca, tls_cert, tls_key, tls_server_name, token_file, options.channel,
                  options.identity);
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

// Storage options from the process's AWS environment (the S3 flags'
// defaults). Without S3 settings: local paths only, and `problem` says why
// an s3:// URI cannot be reached.
storage::StorageOptions EnvironmentStorage(absl::Status* problem) {
  absl::StatusOr<storage::StorageOptions> options =
      storage::StorageOptionsFromFlags(/*log=*/nullptr);
  if (options.ok()) return *std::move(options);
  *problem = absl::FailedPreconditionError(
      absl::StrCat("no S3 settings for s3:// URIs: ", options.status().message()));
  return storage::StorageOptions{};
}

// Storage for s3:// and local URIs (EnvironmentStorage); an s3:// URI without
// S3 settings is refused with the reason.
class Store {
 public:
  static Store& Get() {
    static Store* store = new Store();
    return *store;
  }
  storage::Storage& For(const std::string& uri) {
    if (storage::IsS3Uri(uri) && !s3_problem_.ok()) Raise(s3_problem_);
    return *store_;
  }

 private:
  Store() { store_ = Value(storage::OpenStorage(EnvironmentStorage(&s3_problem_))); }
  absl::Status s3_problem_;
  std::unique_ptr<storage::Storage> store_;
};

// A worker daemon bound to one job (WorkerDaemon::Options::job_id): the C++
// trainer for a ModelSpec job, in this process (a Spark barrier task).
class PyBoundWorker {
 public:
  PyBoundWorker(const std::string& coordinator, const std::string& job_id,
                const std::string& tls_ca, const std::string& tls_cert, const std::string& tls_key,
                const std::string& tls_server_name, const std::string& token_file,
                const std::string& device, int threads, std::vector<std::string> data_roots,
                const std::string& hostname, double rpc_timeout_s, double ps_rpc_timeout_s,
                int progress_every_steps) {
    WorkerDaemon::Options options;
    options.coordinator_address = coordinator;
    options.job_id = job_id;
    SecureChannel(tls_ca, tls_cert, tls_key, tls_server_name, token_file, options.channel,
                  options.identity);
    options.device = device;
    options.num_threads = threads;
    options.data_roots = std::move(data_roots);
    options.hostname = hostname;
    options.rpc_timeout = absl::Seconds(rpc_timeout_s);
    options.ps_rpc_timeout = absl::Seconds(ps_rpc_timeout_s);
    options.progress_every_steps = progress_every_steps;
    // A data root in a store that cannot be reached fails here, saying why,
    // not later as the job's failure.
    absl::Status s3_problem;
    options.storage = EnvironmentStorage(&s3_problem);
    for (const std::string& root : options.data_roots) {
      if (storage::IsS3Uri(root) && !s3_problem.ok()) Raise(s3_problem);
    }
    absl::StatusOr<std::unique_ptr<WorkerDaemon>> daemon;
    {
      py::gil_scoped_release release;
      daemon = WorkerDaemon::Create(std::move(options));
    }
    daemon_ = Value(std::move(daemon));
  }
  ~PyBoundWorker() {
    py::gil_scoped_release release;
    daemon_.reset();
  }
  // Until the job has ended (or shutdown()); the number of runs of it this
  // worker finished.
  int Run() {
    Check(Released([&] { return daemon_->Run(); }));
    return daemon_->jobs_finished();
  }
  void Shutdown() { daemon_->Shutdown(); }
  std::string worker_id() const { return daemon_->worker_id(); }

 private:
  std::unique_ptr<WorkerDaemon> daemon_;
};

// A trained ModelSpec checkpoint on the CPU engine: the logits of images
// given as CHW bytes, preprocessed as in training (the job's DatasetSpec).
class PyPredictor {
 public:
  PyPredictor(const std::string& checkpoint_path, int threads) {
    const v1::Checkpoint ckpt = Value(ReadCheckpointFile(checkpoint_path));
    if (!ckpt.job().has_model()) {
      Raise(absl::InvalidArgumentError(
          absl::StrCat(checkpoint_path,
                       ": the checkpoint's model is not a ModelSpec (a PyTorch model "
                       "predicts with its module: pstrain.Checkpoint.load_into)")));
    }
    backend_ = Value(OpenBackend("cpu", threads));
    model_ = Value(Model::Create(ckpt.job().model(), backend_.get()));
    Check(model_->ImportParameters(
        std::vector<v1::TensorProto>(ckpt.parameters().begin(), ckpt.parameters().end())));
    // An image model's input is (C, H, W); any other is fed as one channel
    // of its elements (features packed as 1 x 1 x N).
    const ModelGraph& graph = model_->graph();
    if (graph.input_shape.rank() == 3) {
      channels_ = static_cast<int>(graph.input_shape[0]);
      height_ = static_cast<int>(graph.input_shape[1]);
      width_ = static_cast<int>(graph.input_shape[2]);
    } else {
      channels_ = height_ = 1;
      width_ = static_cast<int>(graph.input_shape.num_elements());
    }
    classes_ = graph.num_classes;
    preprocess_ = Value(data::Preprocess::FromSpec(ckpt.job().dataset(), channels_));
  }

  // `pixels`: n samples of C*H*W bytes; returns n*classes logits.
  std::vector<float> Logits(const py::bytes& pixels) {
    std::string_view bytes = pixels;
    const int64_t sample = int64_t{channels_} * height_ * width_;
    if (bytes.size() % static_cast<size_t>(sample) != 0) {
      Raise(absl::InvalidArgumentError(
          absl::StrCat(bytes.size(), " bytes are not whole samples of ", sample, " (", channels_,
                       "x", height_, "x", width_, ")")));
    }
    data::ImageDataset ds;
    ds.channels = channels_;
    ds.height = height_;
    ds.width = width_;
    ds.num_classes = classes_;
    ds.labels.assign(bytes.size() / static_cast<size_t>(sample), 0);
    ds.pixels.assign(bytes.begin(), bytes.end());
    std::vector<float> logits;
    EvaluateOptions options;
    options.logits = &logits;
    if (ds.labels.empty()) return logits;
    Check(Released([&] { return Evaluate(*model_, ds, preprocess_, options).status(); }));
    return logits;
  }
  int channels() const { return channels_; }
  int height() const { return height_; }
  int width() const { return width_; }
  int classes() const { return classes_; }

 private:
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Model> model_;
  data::Preprocess preprocess_;
  int channels_ = 0, height_ = 0, width_ = 0, classes_ = 0;
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

  py::class_<PyBoundWorker>(m, "BoundWorker")
      .def(py::init<const std::string&, const std::string&, const std::string&, const std::string&,
                    const std::string&, const std::string&, const std::string&, const std::string&,
                    int, std::vector<std::string>, const std::string&, double, double, int>(),
           py::arg("coordinator"), py::arg("job_id"), py::arg("tls_ca") = "",
           py::arg("tls_cert") = "", py::arg("tls_key") = "", py::arg("tls_server_name") = "",
           py::arg("token_file") = "", py::arg("device") = "cpu", py::arg("threads") = 0,
           py::arg("data_roots") = std::vector<std::string>(), py::arg("hostname") = "",
           py::arg("rpc_timeout_s") = 10.0, py::arg("ps_rpc_timeout_s") = 120.0,
           py::arg("progress_every_steps") = 20)
      .def("run", &PyBoundWorker::Run)
      .def("shutdown", &PyBoundWorker::Shutdown)
      .def_property_readonly("worker_id", &PyBoundWorker::worker_id);

  py::class_<PyPredictor>(m, "Predictor")
      .def(py::init<const std::string&, int>(), py::arg("checkpoint_path"), py::arg("threads") = 0)
      .def("logits", &PyPredictor::Logits)
      .def_property_readonly("channels", &PyPredictor::channels)
      .def_property_readonly("height", &PyPredictor::height)
      .def_property_readonly("width", &PyPredictor::width)
      .def_property_readonly("classes", &PyPredictor::classes);

  // An image's bytes (JPEG or PNG, by their magic) as C*H*W pixels,
  // resized by nearest neighbour (common/data/image_codec.h); `name`
  // starts the error of an undecodable one.
  m.def("decode_image", [](const py::bytes& bytes, int channels, int height, int width,
                           const std::string& name) {
    if (channels != 1 && channels != 3) {
      Raise(absl::InvalidArgumentError(absl::StrCat("channels must be 1 or 3, got ", channels)));
    }
    if (height <= 0 || width <= 0 || int64_t{height} * width > data::kMaxDecodedPixels) {
      Raise(absl::InvalidArgumentError(
          absl::StrCat("an image size of ", height, "x", width, " is out of range")));
    }
    std::string_view view = bytes;
    std::string out(static_cast<size_t>(channels) * height * width, '\0');
    {
      py::gil_scoped_release release;
      absl::StatusOr<data::DecodedImage> image = data::DecodeImage(view, name);
      if (!image.ok()) {
        py::gil_scoped_acquire acquire;
        Raise(image.status());
      }
      data::ResizeToChw(*image, channels, height, width, reinterpret_cast<uint8_t*>(out.data()));
    }
    return py::bytes(out);
  });

  // One shard of a packed split, and its labels object
  // (common/data/packed_format.h: WritePackedShard, WritePackedLabels).
  // Labels are int32 bytes (numpy's astype("<i4").tobytes()).
  m.def("write_packed_shard",
        [](const std::string& dir, const std::string& split, int channels, int height, int width,
           int num_classes, int index, int count, int64_t first_sample, const py::bytes& labels,
           const py::bytes& pixels) {
          std::string_view l = labels, p = pixels;
          if (l.size() % 4 != 0) Raise(absl::InvalidArgumentError("labels: not int32 bytes"));
          std::vector<int32_t> values(l.size() / 4);
          std::memcpy(values.data(), l.data(), l.size());
          storage::Storage& store = Store::Get().For(dir);
          Check(Released([&] {
            return data::WritePackedShard(
                store, dir, split, {channels, height, width, num_classes},
                {.index = index, .count = count, .first_sample = first_sample}, values,
                absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(p.data()), p.size()));
          }));
        });
  m.def("write_packed_labels", [](const std::string& dir, const std::string& split,
                                  const py::bytes& labels, int num_classes) {
    std::string_view l = labels;
    if (l.size() % 4 != 0) Raise(absl::InvalidArgumentError("labels: not int32 bytes"));
    std::vector<int32_t> values(l.size() / 4);
    std::memcpy(values.data(), l.data(), l.size());
    storage::Storage& store = Store::Get().For(dir);
    Check(
        Released([&] { return data::WritePackedLabels(store, dir, split, values, num_classes); }));
  });
  // Whole small objects or files (a manifest, classes.csv) by URI.
  m.def("storage_write", [](const std::string& uri, const py::bytes& bytes) {
    std::string copy = bytes;
    storage::Storage& store = Store::Get().For(uri);
    Check(Released([&] { return store.Write(uri, copy); }));
  });
  m.def("storage_read", [](const std::string& uri, int64_t max_bytes) {
    storage::Storage& store = Store::Get().For(uri);
    absl::StatusOr<std::string> read;
    {
      py::gil_scoped_release release;
      read = storage::ReadAtMost(store, uri, max_bytes);
    }
    return py::bytes(Value(std::move(read)));
  });
  // The names of the files or objects directly under `dir`.
  m.def("storage_list", [](const std::string& dir) {
    storage::Storage& store = Store::Get().For(dir);
    absl::StatusOr<std::vector<storage::ObjectInfo>> listed;
    {
      py::gil_scoped_release release;
      listed = store.List(dir);
    }
    std::vector<std::string> names;
    for (const storage::ObjectInfo& o : Value(std::move(listed))) names.push_back(o.key);
    return names;
  });
  m.def("storage_exists", [](const std::string& uri) {
    storage::Storage& store = Store::Get().For(uri);
    absl::StatusOr<storage::ObjectInfo> info;
    {
      py::gil_scoped_release release;
      info = store.Stat(uri);
    }
    if (absl::IsNotFound(info.status())) return false;
    Check(info.status());
    return true;
  });

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
