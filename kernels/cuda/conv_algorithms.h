// How a cuDNN convolution plan (conv_plan.cc) chooses its forward,
// backward-data and backward-filter algorithms for one data type: measured
// on the plan's shape (cudnnFind*, as PyTorch's cudnn.benchmark does), among
// those the backend's options allow. Internal to kernels/cuda/.
//
//   ConvSetup setup;   // descriptors filled in by the plan
//   PSTRAIN_RETURN_IF_ERROR(ChooseConvAlgorithms(cudnn, options, tensor_ops, &setup));
//   cudnnConvolutionForward(..., setup.forward, ...);
//
// Threads: one thread at a time per cuDNN handle, as for every plan.
#ifndef PSTRAIN_KERNELS_CUDA_CONV_ALGORITHMS_H_
#define PSTRAIN_KERNELS_CUDA_CONV_ALGORITHMS_H_

#include <cudnn.h>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_handles.h"
#include "kernels/cuda_backend_options.h"

namespace pstrain::cuda {

// cuDNN's descriptors and chosen algorithms for a convolution in one data type.
struct ConvSetup {
  TensorDescriptor x;
  TensorDescriptor y;
  FilterDescriptor w;
  ConvolutionDescriptor conv;
  cudnnConvolutionFwdAlgo_t forward = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
  cudnnConvolutionBwdDataAlgo_t backward_data = CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
  cudnnConvolutionBwdFilterAlgo_t backward_filter = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;
};

// Measures every algorithm of each pass on setup's descriptors once
// (cudnnFind*, which runs them on scratch buffers of its own) and stores the
// choice in setup->forward, ->backward_data and ->backward_filter; falls
// back to cuDNN's heuristic ranking when measuring fails (e.g. no memory for
// its scratch buffers), and to an algorithm that needs no workspace when
// nothing qualifies.
//
// fp32 (`tensor_ops` false): FMA-only algorithms, with FFT and Winograd
// transforms as options.fft_transforms and options.winograd_transforms
// allow. Winograd transforms trade accuracy for speed: on an H200 they put
// forward, backward-data and backward-filter results 4e-3 to 6e-3 away from
// the CPU backend's, where the FMA and FFT algorithms agree with it to 1e-4
// (the parity test's bound), so by default they are left out and pstrain's
// fp32 keeps the CPU backend's numbers. bf16 and fp16 (`tensor_ops` true):
// tensor-core algorithms, never FFT or Winograd ones, whatever the options.
absl::Status ChooseConvAlgorithms(cudnnHandle_t cudnn, const CudaBackendOptions& options,
                                  bool tensor_ops, ConvSetup* setup);

}  // namespace pstrain::cuda

#endif  // PSTRAIN_KERNELS_CUDA_CONV_ALGORITHMS_H_
