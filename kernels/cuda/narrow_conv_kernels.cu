// pstrain's own tensor-core kernels for narrow channels-last convolutions in
// bf16 and fp16: the forward pass and the weight gradient of a convolution
// whose channels and filters are multiples of 16 and whose weights are small
// (resnet-small's first stages: 16 and 32 channels at 64x64 and 32x32).
//
// Why: cuDNN's kernels fill an H100/H200 poorly at 16 channels. On an H200
// (cuDNN 9.19, docs/BENCHMARKS.md), resnet-small's 16-to-16-channel 3x3
// convolution at 64x64, batch 128, takes 0.22 ms forward in bf16 (0.066 ms in
// fp16, the same work) and 0.30-0.37 ms for the weight gradient, which
// reduces 524,288 positions into 2,304 weights.
//
// How: both are one GEMM per filter tap over output positions, computed with
// WMMA 16x16x16 tiles (fp32 accumulation) from shared memory. A block stages
// one output row at a time: the R input rows it reads (zero-padded) and, for
// the weight gradient, the row of dy. Positions are taken 16 at a time; a
// row of OW positions is padded to a multiple of 16 with zeros in dy (the
// weight gradient) or with outputs that are not stored (forward).
//   forward:  y[p, k]            = sum over tap, c of x[p + tap, c] * w[k, tap, c]
//   weights:  dw[k, tap, c]      = sum over p of dy[p, k] * x[p + tap, c]
// The weight gradient's blocks each keep their share of dw in registers
// across the rows they take, write it to a scratch buffer, and a second
// kernel adds the blocks' shares in a fixed order: the same bits every run.
// Each output is rounded to the data type once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.cuh"

namespace pstrain::cuda {
namespace {

namespace wmma = ::nvcuda::wmma;

constexpr int kTile = 16;                  // WMMA's M = N = K.
constexpr int kTileElems = kTile * kTile;  // 256
constexpr int kVec = 8;                    // 16-bit elements per 16-byte access.
constexpr int kForwardWarps = 4;
constexpr int kMaxFilterWarps = 4;
constexpr int kMaxFragsPerWarp = 16;
constexpr int kReduceLanes = 32;
constexpr int kReduceSlices = 32;
// A block's dynamic shared memory (the kernels have no static shared memory)
// stays within what every block may use without opting in (48 KiB).
constexpr size_t kMaxSharedBytes = 48 * 1024;

// The sizes a kernel needs, in int (every count is checked on the host to
// fit; offsets into global memory are computed in 64 bits).
struct Geometry {
  int n, c, h, w, k, r, s;
  int stride_h, stride_w, pad_h, pad_w;
  int out_h, out_w;
  int groups;   // ceil(out_w / 16): 16-position groups per output row.
  int xc;       // Columns of the staged input rows: (groups * 16 - 1) * stride_w + s.
  int xc_used;  // Of those, the ones an actual output position reads.
  int ct, kt;   // c / 16, k / 16.
  int frags;    // Weight-gradient tiles: kt * r * s * ct.
};

Geometry MakeGeometry(const Conv2dConfig& c) {
  Geometry g{};
  g.n = c.n;
  g.c = c.c;
  g.h = c.h;
  g.w = c.w;
  g.k = c.filters;
  g.r = c.kernel_h;
  g.s = c.kernel_w;
  g.stride_h = c.stride_h;
  g.stride_w = c.stride_w;
  g.pad_h = c.pad_h;
  g.pad_w = c.pad_w;
  g.out_h = c.out_h();
  g.out_w = c.out_w();
  g.groups = (g.out_w + kTile - 1) / kTile;
  g.xc = (g.groups * kTile - 1) * g.stride_w + g.s;
  g.xc_used = (g.out_w - 1) * g.stride_w + g.s;
  g.ct = g.c / kTile;
  g.kt = g.k / kTile;
  g.frags = g.kt * g.r * g.s * g.ct;
  return g;
}

// Shared-memory sizes in bytes; each region starts 128-byte aligned. Called
// on the host (launch sizes) and in the kernels (where each region starts).
__host__ __device__ constexpr size_t AlignUp(size_t bytes) { return (bytes + 127) / 128 * 128; }
__host__ __device__ inline size_t StagedInputBytes(const Geometry& g, size_t element) {
  return AlignUp(size_t{1} * g.r * g.xc * g.c * element);
}
__host__ __device__ inline size_t StagedDyBytes(const Geometry& g, size_t element) {
  return AlignUp(size_t{1} * g.groups * kTile * g.k * element);
}
__host__ __device__ inline size_t StagedWeightBytes(const Geometry& g, size_t element) {
  return AlignUp(size_t{1} * g.k * g.r * g.s * g.c * element);
}
__host__ __device__ inline size_t ForwardSharedBytes(const Geometry& g, size_t element) {
  return StagedWeightBytes(g, element) + StagedInputBytes(g, element) +
         size_t{kForwardWarps} * kTileElems * sizeof(float);
}
__host__ __device__ inline size_t FilterSharedBytes(const Geometry& g, size_t element) {
  return StagedInputBytes(g, element) + StagedDyBytes(g, element);
}

int FilterWarps(const Geometry& g) { return std::min(kMaxFilterWarps, g.frags); }
int FilterFragsPerWarp(const Geometry& g) {
  const int warps = FilterWarps(g);
  return (g.frags + warps - 1) / warps;
}

// The R input rows output row `oh` of sample `n` reads, as xs[r][j][c] with
// column j holding input column j - pad_w; zero outside the input and in the
// columns only padded positions read.
template <typename T>
__device__ __forceinline__ void StageInputRows(const T* __restrict__ x, T* xs, const Geometry& g,
                                               int n, int oh) {
  const int vecs_per_pixel = g.c / kVec;
  const int total = g.r * g.xc * vecs_per_pixel;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int v = i % vecs_per_pixel;
    const int pixel = i / vecs_per_pixel;
    const int j = pixel % g.xc;
    const int r = pixel / g.xc;
    const int ih = oh * g.stride_h - g.pad_h + r;
    const int iw = j - g.pad_w;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (ih >= 0 && ih < g.h && iw >= 0 && iw < g.w && j < g.xc_used) {
      value = *reinterpret_cast<const uint4*>(
          x + ((static_cast<int64_t>(n) * g.h + ih) * g.w + iw) * g.c + v * kVec);
    }
    *reinterpret_cast<uint4*>(xs + (r * g.xc + j) * g.c + v * kVec) = value;
  }
}

// dys[q][k] = dy[n][oh][q][k] for q < out_w, zero up to groups * 16.
template <typename T>
__device__ __forceinline__ void StageDyRow(const T* __restrict__ dy, T* dys, const Geometry& g,
                                           int n, int oh) {
  const int vecs_per_pos = g.k / kVec;
  const int total = g.groups * kTile * vecs_per_pos;
  const int64_t row_base = (static_cast<int64_t>(n) * g.out_h + oh) * g.out_w * g.k;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int v = i % vecs_per_pos;
    const int q = i / vecs_per_pos;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (q < g.out_w) {
      value = *reinterpret_cast<const uint4*>(dy + row_base + int64_t{q} * g.k + v * kVec);
    }
    *reinterpret_cast<uint4*>(dys + q * g.k + v * kVec) = value;
  }
}

// y = conv(x, w): x [N, H, W, C], w as [K, R, S, C], y [N, OH, OW, K].
// A block of kForwardWarps warps stages w once, then takes output rows
// blockIdx.x, blockIdx.x + gridDim.x, ...; a warp computes the 16x16 output
// tiles (16 positions x 16 filters) warp, warp + kForwardWarps, ... of a row.
template <typename T>
__global__ void __launch_bounds__(kForwardWarps * 32)
    NarrowConvForwardKernel(const T* __restrict__ x, const T* __restrict__ w_krsc,
                            T* __restrict__ y, Geometry g) {
  extern __shared__ __align__(128) unsigned char shared[];
  T* ws = reinterpret_cast<T*>(shared);
  T* xs = reinterpret_cast<T*>(shared + StagedWeightBytes(g, sizeof(T)));
  float* out = reinterpret_cast<float*>(shared + StagedWeightBytes(g, sizeof(T)) +
                                        StagedInputBytes(g, sizeof(T)));
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  float* my_out = out + warp * kTileElems;

  const int weight_vecs = g.k * g.r * g.s * g.c / kVec;
  for (int i = threadIdx.x; i < weight_vecs; i += blockDim.x) {
    reinterpret_cast<uint4*>(ws)[i] = reinterpret_cast<const uint4*>(w_krsc)[i];
  }
  const int taps = g.r * g.s;
  const int weight_ld = taps * g.c;   // Between filters in [K, R, S, C].
  const int x_ld = g.stride_w * g.c;  // Between consecutive positions in xs.
  const int tiles = g.groups * g.kt;
  const int rows = g.n * g.out_h;
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    const int n = row / g.out_h;
    const int oh = row % g.out_h;
    __syncthreads();  // The previous row's reads of xs are done.
    StageInputRows(x, xs, g, n, oh);
    __syncthreads();
    for (int t = warp; t < tiles; t += kForwardWarps) {
      const int group = t / g.kt;
      const int kt = t % g.kt;
      wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float> acc;
      wmma::fill_fragment(acc, 0.f);
      for (int tap = 0; tap < taps; ++tap) {
        const int r = tap / g.s;
        const int s = tap % g.s;
        const T* a_base = xs + (r * g.xc + group * kTile * g.stride_w + s) * g.c;
        const T* b_base = ws + (kt * kTile) * weight_ld + tap * g.c;
        for (int ct = 0; ct < g.ct; ++ct) {
          wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, T, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, wmma::col_major> b;
          wmma::load_matrix_sync(a, a_base + ct * kTile, x_ld);
          wmma::load_matrix_sync(b, b_base + ct * kTile, weight_ld);
          wmma::mma_sync(acc, a, b, acc);
        }
      }
      wmma::store_matrix_sync(my_out, acc, kTile, wmma::mem_row_major);
      __syncwarp();
      // Lane l stores 8 filters of position l / 2 as one 16-byte access.
      const int p = lane / 2;
      const int q = group * kTile + p;
      if (q < g.out_w) {
        const int half = (lane % 2) * kVec;
        alignas(16) T packed[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) packed[i] = FromFloat<T>(my_out[p * kTile + half + i]);
        const int64_t offset =
            ((static_cast<int64_t>(n) * g.out_h + oh) * g.out_w + q) * g.k + kt * kTile + half;
        *reinterpret_cast<uint4*>(y + offset) = *reinterpret_cast<const uint4*>(packed);
      }
      __syncwarp();  // my_out is read before the next tile overwrites it.
    }
  }
}

// Per-block shares of dw: partial[block][frag][16 x 16], frag = (kt * R * S
// + tap) * CT + ct, each tile dw[kt*16 + i][tap][ct*16 + j] at i * 16 + j.
// A warp owns frags warp, warp + warps, ... (at most kFrags) for every row
// its block takes.
template <typename T, int kFrags>
__global__ void __launch_bounds__(kMaxFilterWarps * 32)
    NarrowConvWeightGradKernel(const T* __restrict__ x, const T* __restrict__ dy,
                               float* __restrict__ partial, Geometry g) {
  extern __shared__ __align__(128) unsigned char shared[];
  T* xs = reinterpret_cast<T*>(shared);
  T* dys = reinterpret_cast<T*>(shared + StagedInputBytes(g, sizeof(T)));
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  const int taps = g.r * g.s;
  const int x_ld = g.stride_w * g.c;

  wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float> acc[kFrags];
  int a_offset[kFrags];  // Into a 16-position group of dys.
  int b_offset[kFrags];  // Into a 16-position group of xs.
#pragma unroll
  for (int i = 0; i < kFrags; ++i) {
    wmma::fill_fragment(acc[i], 0.f);
    const int frag = warp + i * warps;
    const int ct = frag % g.ct;
    const int tap = (frag / g.ct) % taps;
    const int kt = frag / (g.ct * taps);
    a_offset[i] = kt * kTile;
    b_offset[i] = ((tap / g.s) * g.xc + tap % g.s) * g.c + ct * kTile;
  }
  const int rows = g.n * g.out_h;
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    const int n = row / g.out_h;
    const int oh = row % g.out_h;
    __syncthreads();
    StageInputRows(x, xs, g, n, oh);
    StageDyRow(dy, dys, g, n, oh);
    __syncthreads();
    for (int group = 0; group < g.groups; ++group) {
      const T* a_group = dys + group * kTile * g.k;
      const T* b_group = xs + group * kTile * x_ld;
#pragma unroll
      for (int i = 0; i < kFrags; ++i) {
        if (warp + i * warps < g.frags) {
          // A: 16 filters x 16 positions of dy (dys is [q][k]: column-major).
          wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, T, wmma::col_major> a;
          // B: 16 positions x 16 channels of the tap's input.
          wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, wmma::row_major> b;
          wmma::load_matrix_sync(a, a_group + a_offset[i], g.k);
          wmma::load_matrix_sync(b, b_group + b_offset[i], x_ld);
          wmma::mma_sync(acc[i], a, b, acc[i]);
        }
      }
    }
  }
  float* block_partial = partial + static_cast<int64_t>(blockIdx.x) * g.frags * kTileElems;
#pragma unroll
  for (int i = 0; i < kFrags; ++i) {
    const int frag = warp + i * warps;
    if (frag < g.frags) {
      wmma::store_matrix_sync(block_partial + frag * kTileElems, acc[i], kTile,
                              wmma::mem_row_major);
    }
  }
}

// dw [K, C, R, S] = the blocks' shares added in block order: a block of
// kReduceLanes x kReduceSlices threads takes kReduceLanes elements; slice s
// adds blocks s, s + kReduceSlices, ..., then slice 0 adds the slices in
// order.
template <typename T>
__global__ void __launch_bounds__(kReduceLanes* kReduceSlices)
    NarrowConvWeightGradReduceKernel(const float* __restrict__ partial, int blocks,
                                     T* __restrict__ dw, Geometry g) {
  __shared__ float sums[kReduceSlices][kReduceLanes];
  const int lane = threadIdx.x % kReduceLanes;
  const int slice = threadIdx.x / kReduceLanes;
  const int elements = g.frags * kTileElems;
  const int e = blockIdx.x * kReduceLanes + lane;
  float sum = 0.f;
  if (e < elements) {
#pragma unroll 4
    for (int b = slice; b < blocks; b += kReduceSlices) {
      sum += partial[static_cast<int64_t>(b) * elements + e];
    }
  }
  sums[slice][lane] = sum;
  __syncthreads();
  if (slice != 0 || e >= elements) return;
  float total = 0.f;
#pragma unroll
  for (int s = 0; s < kReduceSlices; ++s) total += sums[s][lane];
  const int frag = e / kTileElems;
  const int i = (e % kTileElems) / kTile;
  const int j = e % kTile;
  const int taps = g.r * g.s;
  const int ct = frag % g.ct;
  const int tap = (frag / g.ct) % taps;
  const int kt = frag / (g.ct * taps);
  const int k = kt * kTile + i;
  const int c = ct * kTile + j;
  dw[(static_cast<int64_t>(k) * g.c + c) * taps + tap] = FromFloat<T>(total);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename Fn>
absl::Status DispatchReduced(const char* op, DataType dtype, Fn&& fn) {
  switch (dtype) {
    case DataType::kBF16:
      return fn(static_cast<__nv_bfloat16*>(nullptr));
    case DataType::kF16:
      return fn(static_cast<__half*>(nullptr));
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": bf16 or fp16 only, got ", DataTypeName(dtype)));
  }
}

// Calls fn(std::integral_constant<int, F>{}) with F the smallest of 1, 2,
// 4, 8, 16 that holds `frags_per_warp`.
template <typename Fn>
absl::Status DispatchFrags(int frags_per_warp, Fn&& fn) {
  if (frags_per_warp <= 1) return fn(std::integral_constant<int, 1>{});
  if (frags_per_warp <= 2) return fn(std::integral_constant<int, 2>{});
  if (frags_per_warp <= 4) return fn(std::integral_constant<int, 4>{});
  if (frags_per_warp <= 8) return fn(std::integral_constant<int, 8>{});
  return fn(std::integral_constant<int, 16>{});
}

}  // namespace

// --- Host side -----------------------------------------------------------------

namespace {

// What both passes need: a reduced type, channels last, channels and
// filters in whole tiles, and sizes whose products fit an int.
bool CommonSupported(const Conv2dConfig& c) {
  if (c.dtype != DataType::kBF16 && c.dtype != DataType::kF16) return false;
  if (c.layout != TensorLayout::kNHWC) return false;
  if (c.n <= 0 || c.c <= 0 || c.filters <= 0 || c.c % kTile != 0 || c.filters % kTile != 0) {
    return false;
  }
  if (c.kernel_h <= 0 || c.kernel_w <= 0 || c.stride_h <= 0 || c.stride_w <= 0 || c.pad_h < 0 ||
      c.pad_w < 0 || c.out_h() <= 0 || c.out_w() <= 0) {
    return false;
  }
  const int64_t x_count = int64_t{c.n} * c.c * c.h * c.w;
  const int64_t y_count = int64_t{c.n} * c.filters * c.out_h() * c.out_w();
  const int64_t w_count = int64_t{c.filters} * c.c * c.kernel_h * c.kernel_w;
  return x_count < kMax32BitCount && y_count < kMax32BitCount && w_count < kMax32BitCount;
}

size_t ElementBytes(const Conv2dConfig& c) { return DataTypeBytes(c.dtype); }

}  // namespace

bool NarrowConvForwardSupported(const Conv2dConfig& c) {
  if (!CommonSupported(c)) return false;
  return ForwardSharedBytes(MakeGeometry(c), ElementBytes(c)) <= kMaxSharedBytes;
}

bool NarrowConvWeightGradSupported(const Conv2dConfig& c) {
  if (!CommonSupported(c)) return false;
  const Geometry g = MakeGeometry(c);
  return g.frags <= kMaxFilterWarps * kMaxFragsPerWarp &&
         FilterSharedBytes(g, ElementBytes(c)) <= kMaxSharedBytes;
}

absl::StatusOr<NarrowConvGrids> NarrowConvLaunchGrids(const Conv2dConfig& c, int device_ordinal) {
  constexpr const char* kOp = "NarrowConvLaunchGrids";
  int sms = 0;
  PSTRAIN_RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_ordinal));
  const Geometry g = MakeGeometry(c);
  const int rows = g.n * g.out_h;
  NarrowConvGrids grids;
  PSTRAIN_RETURN_IF_ERROR(DispatchReduced(kOp, c.dtype, [&](auto* tag) -> absl::Status {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (NarrowConvForwardSupported(c)) {
      int per_sm = 0;
      PSTRAIN_RETURN_IF_CUDA_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &per_sm, NarrowConvForwardKernel<T>, kForwardWarps * 32,
          ForwardSharedBytes(g, sizeof(T))));
      grids.forward_blocks = std::clamp(sms * per_sm, 1, rows);
    }
    if (NarrowConvWeightGradSupported(c)) {
      return DispatchFrags(FilterFragsPerWarp(g), [&](auto frags) -> absl::Status {
        constexpr int kFrags = decltype(frags)::value;
        int per_sm = 0;
        PSTRAIN_RETURN_IF_CUDA_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &per_sm, NarrowConvWeightGradKernel<T, kFrags>, FilterWarps(g) * 32,
            FilterSharedBytes(g, sizeof(T))));
        // More blocks than 4 per SM add to the reduction more than they hide.
        grids.filter_blocks = std::clamp(sms * std::min(per_sm, 4), 1, rows);
        grids.filter_scratch_floats = size_t{1} * grids.filter_blocks * g.frags * kTileElems;
        return absl::OkStatus();
      });
    }
    return absl::OkStatus();
  }));
  return grids;
}

absl::Status LaunchNarrowConvForward(const Conv2dConfig& c, const NarrowConvGrids& grids,
                                     const void* x, const void* w_krsc, void* y,
                                     cudaStream_t stream) {
  constexpr const char* kOp = "NarrowConvForward";
  if (!NarrowConvForwardSupported(c) || grids.forward_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": not a narrow channels-last bf16/fp16 convolution"));
  }
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x, w_krsc, y}));
  if (!Aligned16(x) || !Aligned16(w_krsc) || !Aligned16(y)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": pointers must be 16-byte aligned"));
  }
  const Geometry g = MakeGeometry(c);
  return DispatchReduced(kOp, c.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    NarrowConvForwardKernel<T>
        <<<grids.forward_blocks, kForwardWarps * 32, ForwardSharedBytes(g, sizeof(T)), stream>>>(
            static_cast<const T*>(x), static_cast<const T*>(w_krsc), static_cast<T*>(y), g);
    PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
    return absl::OkStatus();
  });
}

absl::Status LaunchNarrowConvWeightGrad(const Conv2dConfig& c, const NarrowConvGrids& grids,
                                        const void* x, const void* dy, void* dw_kcrs,
                                        float* scratch, cudaStream_t stream) {
  constexpr const char* kOp = "NarrowConvWeightGrad";
  if (!NarrowConvWeightGradSupported(c) || grids.filter_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": not a narrow channels-last bf16/fp16 convolution"));
  }
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x, dy, dw_kcrs, scratch}));
  if (!Aligned16(x) || !Aligned16(dy) || !Aligned16(scratch)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": pointers must be 16-byte aligned"));
  }
  const Geometry g = MakeGeometry(c);
  return DispatchReduced(kOp, c.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return DispatchFrags(FilterFragsPerWarp(g), [&](auto frags) -> absl::Status {
      constexpr int kFrags = decltype(frags)::value;
      NarrowConvWeightGradKernel<T, kFrags>
          <<<grids.filter_blocks, FilterWarps(g) * 32, FilterSharedBytes(g, sizeof(T)), stream>>>(
              static_cast<const T*>(x), static_cast<const T*>(dy), scratch, g);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      const int elements = g.frags * kTileElems;
      NarrowConvWeightGradReduceKernel<T>
          <<<(elements + kReduceLanes - 1) / kReduceLanes, kReduceLanes * kReduceSlices, 0,
             stream>>>(scratch, grids.filter_blocks, static_cast<T*>(dw_kcrs), g);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      return absl::OkStatus();
    });
  });
}

}  // namespace pstrain::cuda
