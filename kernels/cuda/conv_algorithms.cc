#include "kernels/cuda/conv_algorithms.h"

#include <algorithm>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/cudnn_plans.h"

namespace pstrain::cuda {
namespace {

// Which fp32 algorithms the options let run: FFT and Winograd transforms as
// options.fft_transforms and options.winograd_transforms say, the others
// always.
bool Allowed(cudnnConvolutionFwdAlgo_t algo, const CudaBackendOptions& options) {
  switch (algo) {
    case CUDNN_CONVOLUTION_FWD_ALGO_FFT:
    case CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING:
      return options.fft_transforms;
    case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD:
    case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED:
      return options.winograd_transforms;
    default:
      return true;
  }
}
bool Allowed(cudnnConvolutionBwdDataAlgo_t algo, const CudaBackendOptions& options) {
  switch (algo) {
    case CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT:
    case CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING:
      return options.fft_transforms;
    case CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD:
    case CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED:
      return options.winograd_transforms;
    default:
      return true;
  }
}
bool Allowed(cudnnConvolutionBwdFilterAlgo_t algo, const CudaBackendOptions& options) {
  switch (algo) {
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT:
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING:
      return options.fft_transforms;
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD:
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED:
      return options.winograd_transforms;
    default:
      return true;
  }
}

bool IsTransform(cudnnConvolutionFwdAlgo_t algo) {
  return algo == CUDNN_CONVOLUTION_FWD_ALGO_FFT || algo == CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING ||
         algo == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD ||
         algo == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED;
}
bool IsTransform(cudnnConvolutionBwdDataAlgo_t algo) {
  return algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT ||
         algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING ||
         algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD ||
         algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED;
}
bool IsTransform(cudnnConvolutionBwdFilterAlgo_t algo) {
  return algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT ||
         algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING ||
         algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED;
}

// Picks from cuDNN's results (measured by cudnnFind*, or ranked by its
// heuristics when measuring failed) among the usable ones that are FMA-only
// (no TF32 tensor ops), Allowed and within kMaxConvWorkspaceBytes: the
// fastest, unless a deterministic one is within 10% of it (then that one, so
// that runs repeat bit for bit when it costs little). Heuristic results carry
// no time; their rank stands in for it. Returns false when none qualifies.
//
// `tensor_ops` (bf16 and fp16 plans) admits tensor-core algorithms, and no
// FFT or Winograd ones, which would hold their transformed intermediates in
// the reduced type and lose more than the one rounding of the output that
// the parity tests allow; fp32 plans never take tensor-core algorithms (they
// would round the inputs to TF32).
template <typename Perf, typename Algo>
bool PickAlgorithm(const std::vector<Perf>& perfs, int returned, bool measured, bool tensor_ops,
                   const CudaBackendOptions& options, Algo* algo) {
  const Perf* fastest = nullptr;
  const Perf* fastest_deterministic = nullptr;
  for (int i = 0; i < returned; ++i) {
    const Perf& p = perfs[i];
    if (p.status != CUDNN_STATUS_SUCCESS) continue;
    if (tensor_ops ? IsTransform(p.algo) : !Allowed(p.algo, options)) continue;
    if (!tensor_ops && (p.mathType == CUDNN_TENSOR_OP_MATH ||
                        p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION)) {
      continue;
    }
    if (p.memory > kMaxConvWorkspaceBytes) continue;
    if (fastest == nullptr || (measured && p.time < fastest->time)) fastest = &p;
    if (p.determinism == CUDNN_DETERMINISTIC &&
        (fastest_deterministic == nullptr || (measured && p.time < fastest_deterministic->time))) {
      fastest_deterministic = &p;
    }
  }
  if (fastest == nullptr) return false;
  const bool deterministic_is_close =
      fastest_deterministic != nullptr &&
      (!measured || fastest_deterministic->time <= 1.1f * fastest->time);
  *algo = deterministic_is_close ? fastest_deterministic->algo : fastest->algo;
  return true;
}

}  // namespace

absl::Status ChooseConvAlgorithms(cudnnHandle_t h, const CudaBackendOptions& options,
                                  bool tensor_ops, ConvSetup* s) {
  int max_count = 0;
  int returned = 0;

  PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionForwardAlgorithmMaxCount(h, &max_count));
  std::vector<cudnnConvolutionFwdAlgoPerf_t> fwd(std::max(max_count, 1));
  bool measured = cudnnFindConvolutionForwardAlgorithm(
                      h, s->x.get(), s->w.get(), s->conv.get(), s->y.get(),
                      static_cast<int>(fwd.size()), &returned, fwd.data()) == CUDNN_STATUS_SUCCESS;
  if (!measured) {
    PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionForwardAlgorithm_v7(
        h, s->x.get(), s->w.get(), s->conv.get(), s->y.get(), static_cast<int>(fwd.size()),
        &returned, fwd.data()));
  }
  if (!PickAlgorithm(fwd, returned, measured, tensor_ops, options, &s->forward)) {
    s->forward = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;  // Needs no workspace.
  }

  PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(h, &max_count));
  std::vector<cudnnConvolutionBwdDataAlgoPerf_t> bwd_data(std::max(max_count, 1));
  measured =
      cudnnFindConvolutionBackwardDataAlgorithm(h, s->w.get(), s->y.get(), s->conv.get(),
                                                s->x.get(), static_cast<int>(bwd_data.size()),
                                                &returned, bwd_data.data()) == CUDNN_STATUS_SUCCESS;
  if (!measured) {
    PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionBackwardDataAlgorithm_v7(
        h, s->w.get(), s->y.get(), s->conv.get(), s->x.get(), static_cast<int>(bwd_data.size()),
        &returned, bwd_data.data()));
  }
  if (!PickAlgorithm(bwd_data, returned, measured, tensor_ops, options, &s->backward_data)) {
    s->backward_data = CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
  }

  PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(h, &max_count));
  std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> bwd_filter(std::max(max_count, 1));
  measured =
      cudnnFindConvolutionBackwardFilterAlgorithm(
          h, s->x.get(), s->y.get(), s->conv.get(), s->w.get(), static_cast<int>(bwd_filter.size()),
          &returned, bwd_filter.data()) == CUDNN_STATUS_SUCCESS;
  if (!measured) {
    PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
        h, s->x.get(), s->y.get(), s->conv.get(), s->w.get(), static_cast<int>(bwd_filter.size()),
        &returned, bwd_filter.data()));
  }
  if (!PickAlgorithm(bwd_filter, returned, measured, tensor_ops, options, &s->backward_filter)) {
    s->backward_filter = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;
  }
  (void)cudaGetLastError();  // A failed measurement leaves nothing to report.
  return absl::OkStatus();
}

}  // namespace pstrain::cuda
