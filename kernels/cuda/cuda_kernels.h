// Launchers for pstrain's own CUDA kernels (elementwise_kernels.cu,
// loss_kernels.cu, optimizer_kernels.cu). Each launcher checks its arguments
// on the host, enqueues one or two kernels on `stream`, checks the launch,
// and returns without waiting for the device. The semantics are those of the
// Backend op of the same name in kernels/backend.h; pointers are device
// pointers.
//
//   PSTRAIN_RETURN_IF_ERROR(cuda::LaunchAxpy(0.5f, x, y, count, stream));
//
// Adding a kernel: write the __global__ function and its launcher next to it
// in the .cu file (arguments checked, explicit stream, launch checked),
// declare the launcher here, and call it from CudaBackend.
//
// Threads: launchers are thread-safe; ordering is that of `stream`.
#ifndef PSTRAIN_KERNELS_CUDA_CUDA_KERNELS_H_
#define PSTRAIN_KERNELS_CUDA_CUDA_KERNELS_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace pstrain::cuda {

// --- elementwise_kernels.cu ------------------------------------------------
// Pointers hold `dtype` elements (fp32, bf16 or fp16; kernels compute in
// fp32 and round once when they store).
absl::Status LaunchAddBias(DataType dtype, void* y, const void* bias, int64_t outer,
                           int64_t channels, int64_t inner, cudaStream_t stream);
absl::Status LaunchBiasGrad(DataType dtype, const void* dy, void* dbias, int64_t outer,
                            int64_t channels, int64_t inner, cudaStream_t stream);
absl::Status LaunchActivationForward(DataType dtype, Activation kind, float alpha, const void* x,
                                     void* y, int64_t count, cudaStream_t stream);
absl::Status LaunchActivationBackward(DataType dtype, Activation kind, float alpha, const void* x,
                                      const void* y, const void* dy, void* dx, int64_t count,
                                      cudaStream_t stream);
absl::Status LaunchDropoutForward(DataType dtype, const void* x, void* y, void* mask, int64_t count,
                                  float rate, uint64_t seed, cudaStream_t stream);
absl::Status LaunchMultiply(DataType dtype, const void* a, const void* b, void* y, int64_t count,
                            cudaStream_t stream);
absl::Status LaunchAdd(DataType dtype, const void* a, const void* b, void* y, int64_t count,
                       cudaStream_t stream);
absl::Status LaunchAxpy(DataType dtype, float alpha, const void* x, void* y, int64_t count,
                        cudaStream_t stream);
absl::Status LaunchScale(float alpha, float* x, int64_t count, cudaStream_t stream);
absl::Status LaunchFill(float* x, float value, int64_t count, cudaStream_t stream);
// Backend::Convert: y = scale * x, read as `from`, stored as `to`; a
// non-finite result stores 1 in *nonfinite unless it is null.
absl::Status LaunchConvert(DataType from, const void* x, DataType to, void* y, int64_t count,
                           float scale, int32_t* nonfinite, cudaStream_t stream);

// y[b][c][r] = x[b][r][c] (Backend::Transpose); x and y must not overlap.
absl::Status LaunchTranspose(DataType dtype, const void* x, void* y, int64_t batch, int64_t rows,
                             int64_t cols, cudaStream_t stream);
// sums[c] = the sum over r of x[r * cols + c], in a fixed order (the same
// result every run), through `scratch`: device memory of
// ColumnSumScratchFloats(rows, cols) floats. A convolution's bias gradient
// in NHWC (rows = N*P*Q, cols = K).
size_t ColumnSumScratchFloats(int64_t rows, int64_t cols);
absl::Status LaunchColumnSums(DataType dtype, const void* x, void* sums, int64_t rows, int64_t cols,
                              float* scratch, cudaStream_t stream);

// --- loss_kernels.cu --------------------------------------------------------
// Softmax cross-entropy (see Backend::SoftmaxCrossEntropy) of `dtype` logits;
// dlogits (`dtype`, unless null) are multiplied by dlogits_scale, and probs
// (fp32, unless null) are the softmax. `row_loss` is device scratch of at
// least n floats. A label outside [0, classes) cannot be detected on the
// host: the kernel then records the first offending row as label_error[0] =
// row + 1 and label_error[1] = the label (label_error must hold 2 int32 and
// start at 0; it is never cleared by the kernel), writes NaN as that row's
// loss and softmax / n as its dlogits.
absl::Status LaunchSoftmaxCrossEntropy(DataType dtype, const void* logits, const int32_t* labels,
                                       int64_t n, int64_t classes, float* loss, void* dlogits,
                                       float* probs, float dlogits_scale, float* row_loss,
                                       int32_t* label_error, cudaStream_t stream);

// --- batch_norm_kernels.cu -------------------------------------------------
// Spatial batch norm of x viewed as [n, c, spatial], or as [n * spatial, c]
// when `layout` is kNHWC and spatial > 1 (x, y, dy, dx in dtype; gamma,
// beta, the statistics and dgamma, dbeta in fp32), with the semantics of
// BatchNormPlan in kernels/backend.h. Training and backward use `scratch`:
// device memory of BatchNormScratchFloats(n, c, spatial, layout) floats, not
// used by anything else while the stream runs them.
int BatchNormBlocks(int64_t n, int64_t c, int64_t spatial, TensorLayout layout);
size_t BatchNormScratchFloats(int64_t n, int64_t c, int64_t spatial, TensorLayout layout);
absl::Status LaunchBatchNormForwardTraining(DataType dtype, const void* x, void* y,
                                            const float* gamma, const float* beta,
                                            float* running_mean, float* running_var,
                                            float* save_mean, float* save_inv_std, int64_t n,
                                            int64_t c, int64_t spatial, float epsilon,
                                            float momentum, float* scratch, TensorLayout layout,
                                            cudaStream_t stream);
absl::Status LaunchBatchNormForwardInference(DataType dtype, const void* x, void* y,
                                             const float* gamma, const float* beta,
                                             const float* running_mean, const float* running_var,
                                             int64_t n, int64_t c, int64_t spatial, float epsilon,
                                             TensorLayout layout, cudaStream_t stream);
absl::Status LaunchBatchNormBackward(DataType dtype, const void* x, const void* dy, void* dx,
                                     const float* gamma, const float* save_mean,
                                     const float* save_inv_std, float* dgamma, float* dbeta,
                                     int64_t n, int64_t c, int64_t spatial, float* scratch,
                                     TensorLayout layout, cudaStream_t stream);

// --- narrow_conv_kernels.cu -------------------------------------------------
// pstrain's own tensor-core kernels for narrow convolutions (Conv2dPlan's
// semantics, no bias): bf16 or fp16, channels last, channels and filters
// multiples of 16, and what a block stages (input rows, dy row, weights)
// within 48 KiB of shared memory. The weight gradient sums in fp32 in a
// fixed order and rounds once; the forward pass rounds each output once.
bool NarrowConvForwardSupported(const Conv2dConfig& config);
bool NarrowConvWeightGradSupported(const Conv2dConfig& config);
// Blocks each kernel runs with on the device (0: that pass is not
// supported), and the fp32 scratch the weight gradient needs.
struct NarrowConvGrids {
  int forward_blocks = 0;
  int filter_blocks = 0;
  size_t filter_scratch_floats = 0;
};
absl::StatusOr<NarrowConvGrids> NarrowConvLaunchGrids(const Conv2dConfig& config,
                                                      int device_ordinal);
// y [N, OH, OW, K] from x [N, H, W, C] and w as [K, R, S, C]. Every pointer
// 16-byte aligned.
absl::Status LaunchNarrowConvForward(const Conv2dConfig& config, const NarrowConvGrids& grids,
                                     const void* x, const void* w_krsc, void* y,
                                     cudaStream_t stream);
// dw as [K, C, R, S] from x and dy (NHWC), through `scratch`
// (grids.filter_scratch_floats floats). x, dy and scratch 16-byte aligned.
absl::Status LaunchNarrowConvWeightGrad(const Conv2dConfig& config, const NarrowConvGrids& grids,
                                        const void* x, const void* dy, void* dw_kcrs,
                                        float* scratch, cudaStream_t stream);

// --- optimizer_kernels.cu ---------------------------------------------------
absl::Status LaunchSgdUpdate(float* param, const float* grad, float* velocity, int64_t count,
                             const SgdHyper& hyper, cudaStream_t stream);
absl::Status LaunchAdamUpdate(float* param, const float* grad, float* m, float* v, int64_t count,
                              const AdamHyper& hyper, cudaStream_t stream);

}  // namespace pstrain::cuda

#endif  // PSTRAIN_KERNELS_CUDA_CUDA_KERNELS_H_
