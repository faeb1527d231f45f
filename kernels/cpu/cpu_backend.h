// The CPU Backend: oneDNN for convolution, pooling and GEMM, OpenMP loops for
// everything element-wise. Ops run synchronously on the calling thread (and
// the OpenMP team it forks), so Synchronize() and events are trivially done.
//
//   std::unique_ptr<Backend> cpu = CreateCpuBackend();          // defaults
//   CpuBackendOptions options;
//   options.num_threads = 1;                                    // leave a core free
//   std::unique_ptr<Backend> lean = CreateCpuBackend(options);
//   PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Conv2dPlan> conv, cpu->CreateConv2d(config));
//
// Threads: like every Backend, one thread at a time uses a backend and its
// plans. Every op asks OpenMP for the backend's team size (and sets it with
// omp_set_num_threads() on the calling thread before oneDNN calls, which read
// it), so backends with different sizes can be used one after the other.
// One exception, which the parameter server relies on: the host copies,
// Synchronize and the optimizer updates (SgdUpdate, AdamUpdate) keep no
// backend state, so they may run on several threads at once on disjoint
// buffers (tests/server/parameter_shard_test runs them so under TSan).
//
// Performance (bench/cpu_ops_bench, 2-core AVX-512 machine, fmnist-cnn batch
// 64, SGD momentum): ~14.8 ms per training step, ~4300 samples/s when the
// cores are free. When another busy process shares the cores, libgomp's
// default spin-waiting at every barrier makes two spinning teams starve each
// other (measured: 336 ms per step). Daemons that share cores should start
// with OMP_WAIT_POLICY=passive (32 ms per step under the same contention, but
// ~10% slower when quiet) or GOMP_SPINCOUNT=1000 (36 ms); libgomp reads these
// once when it loads, so they must be in the environment before the process
// starts: a library cannot change them.
#ifndef PSTRAIN_KERNELS_CPU_CPU_BACKEND_H_
#define PSTRAIN_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "kernels/backend.h"

namespace pstrain {

// Memory layout the convolution primitives run in. The plan API always takes
// plain NCHW activations and [K, C, R, S] weights; a blocked layout adds a
// reorder in and out of the plan but lets oneDNN use its direct kernels.
enum class CpuConvLayout {
  kAuto,     // Per primitive, whichever measured faster on this machine (see .cc).
  kPlain,    // nchw / oihw throughout (im2col + GEMM inside oneDNN).
  kBlocked,  // oneDNN's preferred blocked layouts (format_tag any) + reorders.
};

// Which oneDNN routine runs a large GEMM (>= 2^20 multiply-adds; smaller ones
// always run on dnnl_sgemm).
enum class CpuGemmChoice {
  // Per shape, whichever of the two ran faster when the shape was first
  // seen (a few timed trials into scratch memory; see cpu_plans.h). The
  // choice holds for the backend's life, so one process computes each shape
  // the same way every step; two processes may choose differently when the
  // two are close, and their results then differ in the last bits.
  kMeasured,
  kMatmul,  // The matmul primitive (brgemm kernels) for every large shape.
  kSgemm,   // dnnl_sgemm for every shape.
};

// Which algorithm computes the convolutions' passes.
enum class CpuConvAlgorithm {
  // Winograd's F(4x4, 5x5) (kernels/cpu/winograd.h) for the forward and
  // backward-data passes of 5x5 stride-1 "same" convolutions whose channel
  // counts are multiples of 16, in the blocked layouts, where it was
  // measured faster (winograd.h's WinogradApplies: up to 256 x 256
  // channels, from 2^26 multiply-adds), and for their weight gradients up
  // to 64 x 64 channels (WinogradWeightGradApplies; bench/cpu_ops_bench and
  // bench/conv_algorithm_bench, docs/BENCHMARKS.md); oneDNN's direct
  // kernels for the rest. Results differ from the direct kernels' in the
  // last bits (WinogradTest bounds by how much).
  kAuto,
  // oneDNN's kernels for every pass (direct in the blocked layouts, im2col
  // + GEMM in kPlain).
  kDirect,
};

// The register width of pstrain's own convolution loops where the CPU has
// AVX-512 (Winograd's products: winograd.h). Both widths give the same
// bits; only the speed differs, and by the core: one with two 512-bit FMA
// units (Intel's server cores) does twice the multiply-adds a cycle in 512
// bits, one that runs them as two 256-bit halves (AMD's Zen 4) none more.
enum class CpuVectorWidth {
  // Per pass, whichever width its first calls measured faster: they
  // alternate for a few calls, then 512 bits hold only if they were
  // clearly faster (cpu_plans.h's VectorWidthChoice).
  kMeasured,
  k256,
  k512,  // Where the CPU has AVX-512; 256 bits on the others.
};

struct CpuBackendOptions {
  // OpenMP threads for every op; 0: omp_get_max_threads() as it was when the
  // first CPU backend was created (the cores, or OMP_NUM_THREADS).
  int num_threads = 0;
  CpuConvLayout conv_layout = CpuConvLayout::kAuto;
  CpuGemmChoice gemm = CpuGemmChoice::kMeasured;
  CpuConvAlgorithm conv_algorithm = CpuConvAlgorithm::kAuto;
  CpuVectorWidth vector_width = CpuVectorWidth::kMeasured;
};

// Never fails: CreateCpuBackend() in backend.h is this with default options.
std::unique_ptr<Backend> CreateCpuBackend(const CpuBackendOptions& options);

}  // namespace pstrain

#endif  // PSTRAIN_KERNELS_CPU_CPU_BACKEND_H_
