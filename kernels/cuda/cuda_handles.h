// Move-only owners of CUDA, cuBLAS and cuDNN handles: a stream, an event, a
// cuBLAS or cuDNN context, and cuDNN descriptors. Each is created by a factory
// that returns a Status instead of aborting, and destroyed exactly once.
//
//   PSTRAIN_ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::Create());
//   PSTRAIN_ASSIGN_OR_RETURN(cuda::TensorDescriptor desc,
//                            cuda::TensorDescriptor::Create());
//   cudnnSetTensor4dDescriptor(desc.get(), ...);
//
// Threads: a handle object is thread-compatible (like a std::unique_ptr); the
// CUDA rules for the underlying handle apply (one cuBLAS/cuDNN handle per
// thread at a time).
#ifndef PSTRAIN_KERNELS_CUDA_CUDA_HANDLES_H_
#define PSTRAIN_KERNELS_CUDA_CUDA_HANDLES_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <utility>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_status.h"

namespace pstrain::cuda {

// Owns one handle of type T, released with Destroy(T) (whose result is
// ignored: nothing useful can be done about a failed release).
template <typename T, auto Destroy>
class UniqueHandle {
 public:
  UniqueHandle() = default;
  explicit UniqueHandle(T handle) : handle_(handle) {}
  ~UniqueHandle() { Reset(); }
  UniqueHandle(UniqueHandle&& other) noexcept : handle_(std::exchange(other.handle_, T{})) {}
  UniqueHandle& operator=(UniqueHandle&& other) noexcept {
    if (this != &other) {
      Reset();
      handle_ = std::exchange(other.handle_, T{});
    }
    return *this;
  }
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;

  T get() const { return handle_; }
  explicit operator bool() const { return handle_ != T{}; }
  void Reset() {
    if (handle_ != T{}) (void)Destroy(handle_);
    handle_ = T{};
  }

 private:
  T handle_{};
};

// A non-blocking stream (it does not synchronise with the legacy default
// stream).
class Stream : public UniqueHandle<cudaStream_t, cudaStreamDestroy> {
 public:
  using UniqueHandle::UniqueHandle;
  static absl::StatusOr<Stream> Create() {
    cudaStream_t stream = nullptr;
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return Stream(stream);
  }
};

// An event without timing (the cheapest kind, for ordering and waiting),
// or with it (CreateTimed, for cudaEventElapsedTime).
class CudaEvent : public UniqueHandle<cudaEvent_t, cudaEventDestroy> {
 public:
  using UniqueHandle::UniqueHandle;
  static absl::StatusOr<CudaEvent> Create() {
    cudaEvent_t event = nullptr;
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return CudaEvent(event);
  }
  static absl::StatusOr<CudaEvent> CreateTimed() {
    cudaEvent_t event = nullptr;
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaEventCreate(&event));
    return CudaEvent(event);
  }
};

class CublasHandle : public UniqueHandle<cublasHandle_t, cublasDestroy> {
 public:
  using UniqueHandle::UniqueHandle;
  static absl::StatusOr<CublasHandle> Create() {
    cublasHandle_t handle = nullptr;
    PSTRAIN_RETURN_IF_CUBLAS_ERROR(cublasCreate(&handle));
    return CublasHandle(handle);
  }
};

class CudnnHandle : public UniqueHandle<cudnnHandle_t, cudnnDestroy> {
 public:
  using UniqueHandle::UniqueHandle;
  static absl::StatusOr<CudnnHandle> Create() {
    cudnnHandle_t handle = nullptr;
    PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnCreate(&handle));
    return CudnnHandle(handle);
  }
};

#define PSTRAIN_CUDNN_DESCRIPTOR_(Name, Type, CreateFn, DestroyFn) \
  class Name : public UniqueHandle<Type, DestroyFn> {              \
   public:                                                         \
    using UniqueHandle::UniqueHandle;                              \
    static absl::StatusOr<Name> Create() {                         \
      Type desc = nullptr;                                         \
      PSTRAIN_RETURN_IF_CUDNN_ERROR(CreateFn(&desc));              \
      return Name(desc);                                           \
    }                                                              \
  }

PSTRAIN_CUDNN_DESCRIPTOR_(TensorDescriptor, cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor,
                          cudnnDestroyTensorDescriptor);
PSTRAIN_CUDNN_DESCRIPTOR_(FilterDescriptor, cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor,
                          cudnnDestroyFilterDescriptor);
PSTRAIN_CUDNN_DESCRIPTOR_(ConvolutionDescriptor, cudnnConvolutionDescriptor_t,
                          cudnnCreateConvolutionDescriptor, cudnnDestroyConvolutionDescriptor);
PSTRAIN_CUDNN_DESCRIPTOR_(PoolingDescriptor, cudnnPoolingDescriptor_t, cudnnCreatePoolingDescriptor,
                          cudnnDestroyPoolingDescriptor);

#undef PSTRAIN_CUDNN_DESCRIPTOR_

}  // namespace pstrain::cuda

#endif  // PSTRAIN_KERNELS_CUDA_CUDA_HANDLES_H_
