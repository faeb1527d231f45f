// Who gets in: every RPC of every pstrain service against a real gRPC server
// with TLS, mTLS and tokens (deploy/local/make-certs.sh makes the CA, the
// certificates and the tokens), and the worker credential that binds a
// worker id to the caller that registered it.
#include "common/rpc/security.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/chunking.h"
#include "common/model_graph.h"
#include "common/rpc/channel.h"
#include "common/rpc/wire.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "pstrain/v1/service.grpc.pb.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/parameter_shard.h"
#include "server/ps_service.h"
#include "server/state_epoch.h"
#include "server/shard_controller.h"
#include "tests/testing/raw_call.h"
#include "tests/testing/shard_fixtures.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;
using ::pstrain::testing::RawCall;
using ::testing::HasSubstr;
using ::testing::Not;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  return text;
}

// A CA, certificates and tokens made by the script users run.
std::string MakeCerts(const std::string& name) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/security_test_", getpid(), "_", name);
  fs::remove_all(dir);
  const std::string command =
      absl::StrCat(PSTRAIN_SOURCE_DIR, "/deploy/local/make-certs.sh ", dir, " --force >/dev/null");
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  return dir;
}

// The peer token: the first "peer" line of the servers' token file.
std::string PeerToken(const std::string& dir) {
  std::ifstream in(dir + "/tokens");
  std::string role, token;
  while (in >> role) {
    if (role == "#") {
      std::getline(in, token);
      continue;
    }
    in >> token;
    if (role == "peer") return token;
  }
  return "";
}

grpc::ByteBuffer Bytes(const std::string& data) {
  grpc::Slice slice(data);
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer Frame(const v1::ChunkHeader& header, const std::vector<float>& values) {
  grpc::ByteBuffer out;
  EXPECT_OK(EncodeFrame(header, values.data(), values.size() * 4, &out, true));
  return out;
}

// The role each method needs: the contract of docs/SECURITY.md.
Role RequiredRole(const std::string& service, const std::string& method) {
  if (service == "pstrain.v1.ShardControl") return Role::kPeer;
  if (service == "pstrain.v1.ParameterService") return Role::kWorker;
  if (method == "RegisterWorker" || method == "Heartbeat" || method == "ReportProgress" ||
      method == "EpochPlan" || method == "DeclareModel") {
    return Role::kWorker;
  }
  return Role::kAdmin;
}

TlsOptions Tls(const std::string& cert, const std::string& key, const std::string& ca,
               bool require_client_cert = false) {
  TlsOptions tls;
  tls.cert_file = cert;
  tls.key_file = key;
  tls.ca_file = ca;
  tls.require_client_cert = require_client_cert;
  return tls;
}

struct Method {
  std::string service, name;
  std::string path() const { return absl::StrCat("/", service, "/", name); }
};

// Every method of the three services, from the compiled proto: a method added
// later is covered without touching this test.
std::vector<Method> EveryMethod() {
  std::vector<Method> out;
  for (const char* service :
       {"pstrain.v1.Coordinator", "pstrain.v1.ParameterService", "pstrain.v1.ShardControl"}) {
    const google::protobuf::ServiceDescriptor* d =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(service);
    EXPECT_NE(d, nullptr) << service;
    if (d == nullptr) continue;
    for (int i = 0; i < d->method_count(); ++i) out.push_back({service, d->method(i)->name()});
  }
  return out;
}

// Server 0 in one process: coordinator, shard, both services, one TLS port.
class SecureServer {
 public:
  // A fresh state directory (removed again at the end), or `state_dir`,
  // kept, when given: a server restarted on the same state.
  SecureServer(const std::string& certs, bool require_client_cert,
               const std::string& state_dir = "")
      : shard_({.shard_index = 0}),
        authorizer_(*Authorizer::FromTokenFile(certs + "/tokens")),
        services_(&shard_, ServicesOptions(authorizer_)),
        fresh_state_(state_dir.empty()) {
    std::vector<std::unique_ptr<ShardClient>> clients;
    clients.push_back(MakeLocalShardClient(&shard_));
    controller_ = std::make_unique<ShardController>(std::move(clients));
    state_dir_ = fresh_state_ ? absl::StrCat(::testing::TempDir(), "/security_state_", getpid())
                              : state_dir;
    if (fresh_state_) fs::remove_all(state_dir_);
    Coordinator::Options options;
    options.state_dir = state_dir_;
    options.start_background_thread = false;
    options.log = [](const std::string&) {};
    coordinator_ = *Coordinator::Create(std::move(options), controller_.get());
    // As pstrain-server: worker credentials are bound to the state directory.
    absl::StatusOr<std::string> epoch = LoadOrCreateStateEpoch(state_dir_);
    EXPECT_OK(epoch);
    authorizer_->SetStateEpoch(epoch.value_or(""));
    coordinator_service_ = std::make_unique<CoordinatorService>(
        coordinator_.get(),
        CoordinatorService::Options{.max_message_bytes = 64 << 20, .authorizer = authorizer_});
    const TlsOptions tls = Tls(certs + "/server.pem", certs + "/server-key.pem", certs + "/ca.pem",
                               require_client_cert);
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
        ServerCredentialsFor(tls);
    EXPECT_OK(credentials);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", *credentials, &port_);
    services_.Register(&builder);
    builder.RegisterService(coordinator_service_.get());
    server_ = builder.BuildAndStart();
  }
  ~SecureServer() {
    server_->Shutdown(DeadlineFromNow(absl::Seconds(5)));
    if (fresh_state_) fs::remove_all(state_dir_);
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  bool started() const { return server_ != nullptr && port_ != 0; }
  ParameterShard& shard() { return shard_; }

 private:
  static ShardServices::Options ServicesOptions(std::shared_ptr<Authorizer> authorizer) {
    ShardServices::Options options;
    options.tune_allocator = false;
    options.authorizer = std::move(authorizer);
    return options;
  }

  ParameterShard shard_;
  std::shared_ptr<Authorizer> authorizer_;
  ShardServices services_;
  std::unique_ptr<ShardController> controller_;
  const bool fresh_state_;
  std::string state_dir_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<CoordinatorService> coordinator_service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    certs_ = new std::string(MakeCerts("a"));
    other_certs_ = new std::string(MakeCerts("b"));
  }
  static void TearDownTestSuite() {
    fs::remove_all(*certs_);
    fs::remove_all(*other_certs_);
    delete certs_;
    delete other_certs_;
  }

  void SetUp() override {
    server_ = std::make_unique<SecureServer>(*certs_, /*require_client_cert=*/true);
    ASSERT_TRUE(server_->started());
    tokens_[Role::kAdmin] = ReadFile(*certs_ + "/admin.token");
    tokens_[Role::kWorker] = ReadFile(*certs_ + "/worker.token");
    tokens_[Role::kPeer] = PeerToken(*certs_);
    for (const auto& [role, token] : tokens_) ASSERT_GE(token.size(), 32u) << RoleName(role);
  }

  // A channel with mTLS (the worker certificate of `cert_dir`, trusting
  // `ca_dir`'s CA), the token and the worker credential ("" = none).
  std::shared_ptr<grpc::Channel> Channel(const std::string& token,
                                         const std::string& credential = "",
                                         const std::string& cert_dir = "",
                                         const std::string& ca_dir = "") {
    const std::string certs = cert_dir.empty() ? *certs_ : cert_dir;
    const TlsOptions tls = Tls(certs + "/worker.pem", certs + "/worker-key.pem",
                               (ca_dir.empty() ? *certs_ : ca_dir) + "/ca.pem");
    ChannelOptions options;
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
        ChannelCredentialsFor(tls);
    EXPECT_OK(credentials);
    options.credentials = *credentials;
    auto identity = std::make_shared<CallIdentity>();
    identity->token = token;
    identity->set_worker_credential(credential);
    options.identity = identity;
    return CreateChannel(server_->address(), options);
  }

  grpc::Status Call(const std::shared_ptr<grpc::Channel>& channel, const Method& m) {
    grpc::GenericStub stub(channel);
    return RawCall::Run(&stub, m.path(), {Bytes("")});
  }

  // Registers a worker over gRPC; returns its id and credential. With a
  // previous id and its credential, asks for that id back.
  std::pair<std::string, std::string> Register(const std::string& previous_id = "",
                                               const std::string& previous_credential = "") {
    auto stub =
        v1::Coordinator::NewStub(Channel(tokens_[Role::kWorker], previous_credential));
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(absl::Seconds(10)));
    v1::RegisterWorkerRequest request;
    request.set_previous_worker_id(previous_id);
    v1::RegisterWorkerResponse response;
    grpc::Status status = stub->RegisterWorker(&ctx, request, &response);
    EXPECT_OK(status);
    EXPECT_FALSE(response.worker_credential().empty());
    return {response.worker_id(), response.worker_credential()};
  }

  static std::string* certs_;
  static std::string* other_certs_;
  std::unique_ptr<SecureServer> server_;
  std::map<Role, std::string> tokens_;
};

std::string* SecurityTest::certs_ = nullptr;
std::string* SecurityTest::other_certs_ = nullptr;

TEST_F(SecurityTest, EveryRpcWithoutATokenIsUnauthenticated) {
  auto channel = Channel("");
  const std::vector<Method> methods = EveryMethod();
  ASSERT_EQ(methods.size(), 20u);  // 13 Coordinator, 2 ParameterService, 5 ShardControl.
  for (const Method& m : methods) {
    grpc::Status status = Call(channel, m);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << m.path() << ": " << status.error_message();
  }
}

TEST_F(SecurityTest, EveryRpcWithAnUnknownTokenIsUnauthenticated) {
  auto channel = Channel(std::string(64, 'f'));
  for (const Method& m : EveryMethod()) {
    grpc::Status status = Call(channel, m);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << m.path();
    EXPECT_THAT(status.error_message(), Not(HasSubstr(std::string(64, 'f'))));
  }
}

TEST_F(SecurityTest, EveryRpcWithAnotherRolesTokenIsPermissionDenied) {
  for (Role role : {Role::kAdmin, Role::kWorker, Role::kPeer}) {
    auto channel = Channel(tokens_[role]);
    for (const Method& m : EveryMethod()) {
      if (RequiredRole(m.service, m.name) == role) continue;
      grpc::Status status = Call(channel, m);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED)
          << m.path() << " with the " << RoleName(role) << " token: " << status.error_message();
    }
  }
}

TEST_F(SecurityTest, EveryRpcWithItsOwnRolesTokenGetsPastAuthorization) {
  for (const Method& m : EveryMethod()) {
    auto channel = Channel(tokens_[RequiredRole(m.service, m.name)]);
    grpc::Status status = Call(channel, m);
    // An empty request is then invalid or unknown, but never refused for who sent it.
    EXPECT_NE(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << m.path();
    EXPECT_NE(status.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << m.path() << ": " << status.error_message();
    EXPECT_NE(status.error_code(), grpc::StatusCode::UNAVAILABLE) << m.path();
  }
}

TEST_F(SecurityTest, WithoutAClientCertificateTheHandshakeFails) {
  ChannelOptions options;
  options.credentials = *ChannelCredentialsFor(Tls("", "", *certs_ + "/ca.pem"));
  auto identity = std::make_shared<CallIdentity>();
  identity->token = tokens_[Role::kAdmin];
  options.identity = identity;
  grpc::GenericStub stub(CreateChannel(server_->address(), options));
  grpc::Status status = RawCall::Run(&stub, "/pstrain.v1.Coordinator/ListJobs", {Bytes("")});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
}

TEST_F(SecurityTest, AClientCertificateFromAnotherCaFailsTheHandshake) {
  // Signed by the other CA; the client still trusts the server's CA.
  auto channel = Channel(tokens_[Role::kAdmin], "", /*cert_dir=*/*other_certs_, /*ca_dir=*/*certs_);
  grpc::Status status = Call(channel, {"pstrain.v1.Coordinator", "ListJobs"});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
}

TEST_F(SecurityTest, AServerCertificateFromAnotherCaIsRefusedByTheClient) {
  auto channel = Channel(tokens_[Role::kAdmin], "", /*cert_dir=*/*certs_, /*ca_dir=*/*other_certs_);
  grpc::Status status = Call(channel, {"pstrain.v1.Coordinator", "ListJobs"});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
}

TEST_F(SecurityTest, HeartbeatsAreAcceptedOnlyWithTheRegisteredWorkersCredential) {
  const auto [w1, c1] = Register();
  const auto [w2, c2] = Register();
  ASSERT_NE(c1, c2);
  auto heartbeat = [&](const std::string& worker, const std::string& credential) {
    auto stub = v1::Coordinator::NewStub(Channel(tokens_[Role::kWorker], credential));
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(absl::Seconds(10)));
    v1::HeartbeatRequest request;
    request.set_worker_id(worker);
    v1::HeartbeatResponse response;
    return stub->Heartbeat(&ctx, request, &response);
  };
  EXPECT_OK(heartbeat(w2, c2));
  grpc::Status forged = heartbeat(w2, c1);
  EXPECT_EQ(forged.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(forged.error_message(), HasSubstr("registered as"));
  EXPECT_EQ(heartbeat(w2, "").error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

// Issue 43: a worker credential stayed valid against a server started on a
// fresh state directory with the same tokens. That server numbers workers
// anew, so a stale process could act as the new process that got its id.
TEST_F(SecurityTest, ACredentialFromAnotherStateDirectoryIsRefusedAndItsHolderRegistersAgain) {
  auto heartbeat = [&](const std::string& worker, const std::string& credential,
                       v1::HeartbeatResponse* response) {
    auto stub = v1::Coordinator::NewStub(Channel(tokens_[Role::kWorker], credential));
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(absl::Seconds(10)));
    v1::HeartbeatRequest request;
    request.set_worker_id(worker);
    return stub->Heartbeat(&ctx, request, response);
  };
  auto report = [&](const std::string& worker, const std::string& credential) {
    auto stub = v1::Coordinator::NewStub(Channel(tokens_[Role::kWorker], credential));
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(absl::Seconds(10)));
    v1::ReportProgressRequest request;
    request.set_worker_id(worker);
    request.set_job_id("job-1");
    v1::ReportProgressResponse response;
    return stub->ReportProgress(&ctx, request, &response);
  };
  const auto [stale_id, stale_credential] = Register();

  // Server 0 starts again on a new state directory with the same tokens, and
  // another process registers: it gets the same id.
  server_.reset();
  server_ = std::make_unique<SecureServer>(*certs_, /*require_client_cert=*/true);
  ASSERT_TRUE(server_->started());
  const auto [new_id, new_credential] = Register();
  ASSERT_EQ(new_id, stale_id);
  EXPECT_NE(new_credential, stale_credential);

  v1::HeartbeatResponse response;
  ASSERT_OK(heartbeat(new_id, new_credential, &response));
  EXPECT_NE(response.action(), v1::HeartbeatResponse::ACTION_REREGISTER);
  // The stale holder is told to register again, not taken for the new one.
  response.Clear();
  ASSERT_OK(heartbeat(stale_id, stale_credential, &response));
  EXPECT_EQ(response.action(), v1::HeartbeatResponse::ACTION_REREGISTER);
  const grpc::Status refused = report(stale_id, stale_credential);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.error_message(), HasSubstr("another state directory"));
  EXPECT_THAT(refused.error_message(), HasSubstr("register again"));
  // Asking for its old id back with the stale credential gives a new one.
  const auto [again_id, again_credential] = Register(stale_id, stale_credential);
  EXPECT_NE(again_id, stale_id);
  EXPECT_NE(report(again_id, again_credential).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

// A restart on the same state directory keeps the credentials valid: the
// workers keep their ids across a restart of server 0.
TEST_F(SecurityTest, ACredentialSurvivesARestartOnTheSameStateDirectory) {
  const std::string state_dir = absl::StrCat(::testing::TempDir(), "/security_kept_", getpid());
  fs::remove_all(state_dir);
  server_.reset();
  server_ = std::make_unique<SecureServer>(*certs_, /*require_client_cert=*/true, state_dir);
  ASSERT_TRUE(server_->started());
  const auto [id, credential] = Register();
  server_.reset();
  server_ = std::make_unique<SecureServer>(*certs_, /*require_client_cert=*/true, state_dir);
  ASSERT_TRUE(server_->started());
  const auto [again_id, again_credential] = Register(id, credential);
  EXPECT_EQ(again_id, id);  // The previous id is given back to its holder.
  EXPECT_EQ(again_credential, credential);
  server_.reset();
  fs::remove_all(state_dir);
}

// Regression (issue 8): worker ids and generations were plain header fields,
// so anyone could push as any member.
TEST_F(SecurityTest, APushOrPullAsAnotherWorkerIsRefusedAndTheModelStaysBitIdentical) {
  const auto [w1, c1] = Register();
  const auto [w2, c2] = Register();
  // A job whose members are the two registered workers, on the shard.
  const v1::JobSpec spec = testing::DenseJob("tiny", 64, 10, 7, v1::CONSISTENCY_ASYNC);
  const ModelGraph graph = *BuildModelGraph(spec.model());
  const ChunkPlan plan = *PlanChunks(graph, 1, 256);
  ShardJobConfig config;
  config.job_id = "job-x";
  config.spec = spec;
  config.num_shards = 1;
  config.chunk_bytes = 256;
  config.members = {w1, w2};
  config.generation = 1;
  ASSERT_OK(server_->shard().ConfigureJob(config, testing::InitialChunks(graph, plan, 0)));
  auto snapshot = [&] {
    std::vector<std::string> out;
    absl::StatusOr<std::vector<v1::ChunkValues>> chunks = server_->shard().ReadChunks("job-x");
    EXPECT_OK(chunks);
    if (chunks.ok()) {
      for (const v1::ChunkValues& c : *chunks) out.push_back(c.SerializeAsString());
    }
    return out;
  };
  const std::vector<std::string> before = snapshot();

  v1::ChunkHeader push;
  push.set_job_id("job-x");
  push.set_worker_id(w2);
  push.set_generation(1);
  push.set_chunk_id(0);
  push.set_kind(v1::ChunkHeader::KIND_GRADIENT);
  push.set_dtype(v1::DTYPE_F32);
  push.set_num_elements(plan.chunks[0].count);
  const std::vector<float> gradient(plan.chunks[0].count, 1.0f);
  const Method push_method{"pstrain.v1.ParameterService", "Push"};
  const Method pull_method{"pstrain.v1.ParameterService", "Pull"};

  // w1's credential, w2's id: refused, nothing applied.
  {
    grpc::GenericStub stub(Channel(tokens_[Role::kWorker], c1));
    grpc::Status status = RawCall::Run(&stub, push_method.path(), {Frame(push, gradient)});
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
    v1::ChunkHeader pull;
    pull.set_job_id("job-x");
    pull.set_worker_id(w2);
    pull.set_generation(1);
    status = RawCall::Run(&stub, pull_method.path(), {Frame(pull, {})});
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
  }
  EXPECT_EQ(snapshot(), before);
  // A stream that starts as w1 (its own credential) and then names w2.
  {
    grpc::GenericStub stub(Channel(tokens_[Role::kWorker], c1));
    v1::ChunkHeader own = push;
    own.set_worker_id(w1);
    v1::ChunkHeader other = push;
    other.set_chunk_id(1);
    other.set_num_elements(plan.chunks[1].count);
    grpc::Status status = RawCall::Run(
        &stub, push_method.path(),
        {Frame(own, gradient), Frame(other, std::vector<float>(plan.chunks[1].count, 1.0f))});
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
  }
  // w2 with its own credential: applied.
  {
    grpc::GenericStub stub(Channel(tokens_[Role::kWorker], c2));
    grpc::Status status = RawCall::Run(&stub, push_method.path(), {Frame(push, gradient)});
    EXPECT_OK(status);
  }
  EXPECT_NE(snapshot()[0], before[0]);
}

// ---- The pieces, without a server -----------------------------------------------

TEST(AuthorizerTest, TokenFilesAreParsedStrictlyWithoutEchoingSecrets) {
  const std::string peer(32, 'p'), admin(32, 'a');
  EXPECT_OK(Authorizer::FromText(absl::StrCat("# c\npeer ", peer, "\nadmin ", admin, "\n"), "f"));
  auto no_peer = Authorizer::FromText(absl::StrCat("admin ", admin), "f");
  EXPECT_THAT(no_peer.status().message(), HasSubstr("no peer token"));
  auto bad_role = Authorizer::FromText(absl::StrCat("peer ", peer, "\nroot ", admin), "f");
  EXPECT_THAT(bad_role.status().message(), HasSubstr("line 2"));
  EXPECT_THAT(bad_role.status().message(), Not(HasSubstr(admin)));
  auto short_token = Authorizer::FromText("peer short", "f");
  EXPECT_THAT(short_token.status().message(), HasSubstr("at least 16 bytes"));
  EXPECT_THAT(short_token.status().message(), Not(HasSubstr("short")));
  auto shared = Authorizer::FromText(absl::StrCat("peer ", peer, "\nadmin ", peer), "f");
  EXPECT_THAT(shared.status().message(), HasSubstr("one role only"));
}

TEST(AuthorizerTest, AStateEpochBindsCredentialsToOneStateAndShardsCheckOnlyTheSignature) {
  const std::string tokens = absl::StrCat("peer ", std::string(32, 'p'));
  auto server_a = *Authorizer::FromText(tokens, "a");
  server_a->SetStateEpoch(std::string(32, 'a'));
  auto server_b = *Authorizer::FromText(tokens, "b");  // Same tokens, another state.
  server_b->SetStateEpoch(std::string(32, 'b'));
  auto shard = *Authorizer::FromText(tokens, "shard");  // No epoch: signature only.
  auto other_cluster = *Authorizer::FromText(absl::StrCat("peer ", std::string(32, 'q')), "q");
  other_cluster->SetStateEpoch(std::string(32, 'a'));

  const std::string credential = server_a->IssueWorkerCredential("worker-1");
  EXPECT_EQ(credential.substr(0, 33), std::string(32, 'a') + ":");
  EXPECT_OK(server_a->CheckWorkerCredential(credential, "worker-1"));
  EXPECT_OK(shard->CheckWorkerCredential(credential, "worker-1"));
  const grpc::Status stale = server_b->CheckWorkerCredential(credential, "worker-1");
  EXPECT_EQ(stale.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(stale.error_message(), HasSubstr("another state directory"));
  // A credential from before state epochs is stale too, once one is set.
  EXPECT_EQ(server_a->CheckWorkerCredential(shard->IssueWorkerCredential("worker-1"), "worker-1")
                .error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  // Forgeries stay PERMISSION_DENIED: another id, another cluster's key, or
  // an epoch changed without the key.
  EXPECT_EQ(server_a->CheckWorkerCredential(credential, "worker-2").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(server_a->CheckWorkerCredential(other_cluster->IssueWorkerCredential("worker-1"),
                                            "worker-1")
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  std::string moved = credential;
  moved.replace(0, 32, std::string(32, 'b'));
  EXPECT_EQ(server_b->CheckWorkerCredential(moved, "worker-1").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

TEST(AuthorizerTest, WorkerCredentialsDependOnTheIdAndThePeerToken) {
  auto a = *Authorizer::FromText(absl::StrCat("peer ", std::string(32, 'p')), "a");
  auto b = *Authorizer::FromText(absl::StrCat("peer ", std::string(32, 'q')), "b");
  EXPECT_EQ(a->IssueWorkerCredential("worker-1").size(), 64u);
  EXPECT_NE(a->IssueWorkerCredential("worker-1"), a->IssueWorkerCredential("worker-2"));
  EXPECT_NE(a->IssueWorkerCredential("worker-1"), b->IssueWorkerCredential("worker-1"));
  EXPECT_OK(a->CheckWorkerCredential(a->IssueWorkerCredential("worker-1"), "worker-1"));
  EXPECT_FALSE(a->CheckWorkerCredential(b->IssueWorkerCredential("worker-1"), "worker-1").ok());
  EXPECT_FALSE(a->CheckWorkerCredential("", "worker-1").ok());
  EXPECT_OK(Authorizer::Disabled()->CheckWorkerCredential("", "worker-1"));
}

TEST(ListenPolicyTest, NonLoopbackNeedsTlsAndTokensOrInsecure) {
  for (const char* a : {"127.0.0.1:7070", "127.1.2.3:1", "localhost:7070", "[::1]:7070"}) {
    EXPECT_TRUE(IsLoopbackAddress(a)) << a;
  }
  for (const char* a : {"0.0.0.0:7070", "10.0.0.1:7070", "[::]:7070", "pstrain-server:7070"}) {
    EXPECT_FALSE(IsLoopbackAddress(a)) << a;
  }
  std::string warning;
  EXPECT_OK(CheckListenPolicy("--listen", "127.0.0.1:1", false, false, false, &warning));
  EXPECT_OK(CheckListenPolicy("--listen", "0.0.0.0:1", true, true, false, &warning));
  absl::Status refused = CheckListenPolicy("--listen", "0.0.0.0:1", true, false, false, &warning);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("--token-file"));
  EXPECT_THAT(refused.message(), HasSubstr("--insecure"));
  EXPECT_OK(CheckListenPolicy("--listen", "0.0.0.0:1", false, false, true, &warning));
  EXPECT_THAT(warning, HasSubstr("WARNING"));
}

TEST(TokenFileTest, AClientTakesItsFirstToken) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/token_", getpid());
  std::ofstream(path) << "# mine\n\n  " << std::string(40, 'x') << "  \n";
  EXPECT_EQ(*ReadTokenFile(path), std::string(40, 'x'));
  std::ofstream(path) << "worker " << std::string(40, 'y') << "\n";
  EXPECT_EQ(*ReadTokenFile(path), std::string(40, 'y'));
  std::ofstream(path) << "# nothing\n";
  EXPECT_THAT(ReadTokenFile(path).status().message(), HasSubstr("holds no token"));
  fs::remove(path);
  EXPECT_EQ(ReadTokenFile(path).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pstrain
