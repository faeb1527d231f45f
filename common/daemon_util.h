// Start-up helpers shared by the daemons' main() functions.
//
//   int main(int argc, char** argv) {
//     // First: may re-execute. main reads the environment, not this library.
//     pstrain::EnsurePassiveOpenMpWait(argv, std::getenv("OMP_WAIT_POLICY") != nullptr);
//     std::vector<std::string> storage;
//     pstrain::InstallVersionFlag();               // --version prints the build id
//     std::vector<char*> args = pstrain::NormalizeFlagSpelling(argc, argv, &storage);
//     absl::ParseCommandLine(static_cast<int>(args.size()) - 1, args.data());
#ifndef PSTRAIN_COMMON_DAEMON_UTIL_H_
#define PSTRAIN_COMMON_DAEMON_UTIL_H_

#include <functional>
#include <string>
#include <vector>

namespace pstrain {

// libgomp reads OMP_WAIT_POLICY once, when it loads. A daemon that shares its
// cores with network threads and other processes must not spin at every
// barrier (two spinning processes on two cores ran 20x slower: see
// kernels/cpu/cpu_backend.h). When the user did not set the variable
// (`policy_given`, read by main), sets it to passive and re-executes the
// binary (by its real path, so the process keeps its name) once. Returns
// only if nothing had to change or exec failed.
void EnsurePassiveOpenMpWait(char** argv, bool policy_given);

// Abseil flags are spelled with underscores; this accepts the documented
// dashes too ("--metrics-port 9100" == "--metrics_port 9100"). Returns an
// argv-style vector (nullptr-terminated) pointing into `storage`.
std::vector<char*> NormalizeFlagSpelling(int argc, char** argv, std::vector<std::string>* storage);

// Makes Abseil's built-in --version print this build's identity
// (common/build_info.h) followed by `extra` (e.g. what the worker found of
// the CUDA module), then exit 0, and --help list the flags defined in the
// daemon's *_main.cc. Call before absl::ParseCommandLine.
void InstallVersionFlag(std::function<std::string()> extra = nullptr);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_DAEMON_UTIL_H_
