// The loops of blocked_loops.h, in AVX2 intrinsics (kernels/ builds for
// x86-64-v3): 8 channels per register, a 16-channel block as two.
#include "kernels/cpu/blocked_loops.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pstrain::cpu_internal {
namespace {

// Work is handed out to threads only when there is this much of it.
constexpr int64_t kParallelElements = int64_t{1} << 14;

// Outputs of one row that the pool loops keep on the stack.
constexpr int kPoolTile = 32;

// One window's maximum over 8 channels, and where any of them saw a NaN.
// kWindow is the window's side when known at compile time, else 0 and `k`
// says it. Elements of a window row are `lane_stride` floats apart, rows
// `row_stride`. With kWinner, also where the gradient of the ReLU of that
// maximum goes back (pool_winners below): a later element takes over only
// when it is greater, so the first maximum (row by row) wins ties.
template <int kWindow, bool kWinner>
inline void WindowMax8(const float* window, int64_t lane_stride, int64_t row_stride, int k,
                       __m256* best, __m256* nan, __m256i* winner) {
  const int side = kWindow != 0 ? kWindow : k;
  __m256 m = _mm256_loadu_ps(window);
  __m256 any_nan = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
  __m256i at = _mm256_setzero_si256();
  for (int i = 0; i < side; ++i) {
    for (int j = i == 0 ? 1 : 0; j < side; ++j) {
      const __m256 v = _mm256_loadu_ps(window + i * row_stride + j * lane_stride);
      if constexpr (kWinner) {
        at = _mm256_blendv_epi8(at, _mm256_set1_epi32(i * side + j),
                                _mm256_castps_si256(_mm256_cmp_ps(v, m, _CMP_GT_OQ)));
      }
      m = _mm256_max_ps(v, m);  // v > m ? v : m
      any_nan = _mm256_or_ps(any_nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  }
  *best = m;
  *nan = any_nan;
  if constexpr (kWinner) {
    // Nothing flows back where the window held a NaN or its maximum (the
    // ReLU's input) was not positive.
    const __m256 flows =
        _mm256_andnot_ps(any_nan, _mm256_cmp_ps(m, _mm256_setzero_ps(), _CMP_GT_OQ));
    *winner = _mm256_blendv_epi8(_mm256_set1_epi32(kNoPoolWinner), at, _mm256_castps_si256(flows));
  }
}

// Where a row of pooled outputs lies: output row p of channel block `block`
// of sample `sample`.
struct PoolRow {
  int64_t sample;
  int block, p, lanes;  // lanes: the block's real channels.
};

template <int kLanes>
PoolRow RowAt(const BlockedPoolShape& s, int64_t row) {
  PoolRow r;
  r.p = static_cast<int>(row % s.out_h());
  const int64_t block_index = row / s.out_h();
  r.block = static_cast<int>(block_index % s.blocks());
  r.sample = block_index / s.blocks();
  r.lanes = std::min(kLanes, s.channels - r.block * kLanes);
  return r;
}

// Stores 8 lanes' winners (each below 256) as 8 bytes.
inline void StoreWinners8(__m256i winner, uint8_t* dst) {
  const __m256i words = _mm256_packus_epi32(winner, winner);  // Per 128-bit half.
  const __m256i bytes = _mm256_packus_epi16(words, words);
  const uint32_t low = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(bytes)));
  const uint32_t high =
      static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_extracti128_si256(bytes, 1)));
  std::memcpy(dst, &low, sizeof(low));
  std::memcpy(dst + 4, &high, sizeof(high));
}

template <int kLanes, int kWindow>
void PoolReluForward(const BlockedPoolShape& s, const float* conv, float* y, uint8_t* winners) {
  static_assert(kLanes % 8 == 0);
  const int out_h = s.out_h(), out_w = s.out_w();
  const int64_t out_plane = int64_t{out_h} * out_w;
  const int64_t row_stride = int64_t{s.w} * kLanes;
  const int64_t rows = s.n * s.blocks() * out_h;
#pragma omp parallel for schedule(static) \
    num_threads(s.num_threads) if (rows * out_w * kLanes >= kParallelElements)
  for (int64_t row = 0; row < rows; ++row) {
    const PoolRow r = RowAt<kLanes>(s, row);
    const float* in = conv + (row / out_h) * s.h * row_stride + int64_t{r.p} * s.k * row_stride;
    float* out =
        y + (r.sample * s.channels + int64_t{r.block} * kLanes) * out_plane + int64_t{r.p} * out_w;
    uint8_t* row_winners = winners != nullptr ? winners + row * out_w * kLanes : nullptr;
    for (int q0 = 0; q0 < out_w; q0 += kPoolTile) {
      const int count = std::min(kPoolTile, out_w - q0);
      alignas(32) float tile[kLanes][kPoolTile];
      for (int q = 0; q < count; ++q) {
        for (int g = 0; g < kLanes; g += 8) {
          const float* window = in + int64_t{q0 + q} * s.k * kLanes + g;
          __m256 best, nan;
          if (row_winners != nullptr) {
            __m256i winner;
            WindowMax8<kWindow, true>(window, kLanes, row_stride, s.k, &best, &nan, &winner);
            StoreWinners8(winner, row_winners + int64_t{q0 + q} * kLanes + g);
          } else {
            WindowMax8<kWindow, false>(window, kLanes, row_stride, s.k, &best, &nan, nullptr);
          }
          alignas(32) float relu[8];
          _mm256_store_ps(relu, _mm256_andnot_ps(nan, _mm256_max_ps(best, _mm256_setzero_ps())));
          for (int b = 0; b < 8; ++b) tile[g + b][q] = relu[b];
        }
      }
      for (int b = 0; b < r.lanes; ++b) {
        std::memcpy(out + b * out_plane + q0, tile[b], sizeof(float) * count);
      }
    }
  }
}

// The gradient of pooled row `row` ([sample][block][p]), written from
// `d_rows`: the first of the row's k convolution rows of its block.
template <int kLanes, int kWindow>
void PoolReluBackwardRow(const BlockedPoolShape& s, int64_t row, const uint8_t* winners,
                         const float* dy, float* d_rows) {
  static_assert(kLanes % 8 == 0);
  const int out_h = s.out_h(), out_w = s.out_w();
  const int64_t out_plane = int64_t{out_h} * out_w;
  const int64_t row_stride = int64_t{s.w} * kLanes;
  const int side = kWindow != 0 ? kWindow : s.k;
  const PoolRow r = RowAt<kLanes>(s, row);
  const float* g_row =
      dy + (r.sample * s.channels + int64_t{r.block} * kLanes) * out_plane + int64_t{r.p} * out_w;
  const uint8_t* row_winners = winners + row * out_w * kLanes;
  for (int q0 = 0; q0 < out_w; q0 += kPoolTile) {
    const int count = std::min(kPoolTile, out_w - q0);
    alignas(32) float g_tile[kPoolTile][kLanes] = {};
    for (int b = 0; b < r.lanes; ++b) {
      const float* plane = g_row + b * out_plane + q0;
      for (int q = 0; q < count; ++q) g_tile[q][b] = plane[q];
    }
    for (int q = 0; q < count; ++q) {
      for (int g = 0; g < kLanes; g += 8) {
        float* window = d_rows + int64_t{q0 + q} * s.k * kLanes + g;
        const __m256i winner = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(row_winners + int64_t{q0 + q} * kLanes + g)));
        const __m256 grad = _mm256_load_ps(&g_tile[q][g]);
        for (int i = 0; i < side; ++i) {
          for (int j = 0; j < side; ++j) {
            const __m256i wins = _mm256_cmpeq_epi32(winner, _mm256_set1_epi32(i * side + j));
            _mm256_storeu_ps(window + i * row_stride + int64_t{j} * kLanes,
                             _mm256_and_ps(grad, _mm256_castsi256_ps(wins)));
          }
        }
      }
    }
  }
}

template <int kLanes, int kWindow>
void PoolReluBackward(const BlockedPoolShape& s, const uint8_t* winners, const float* dy,
                      float* d_conv) {
  const int out_h = s.out_h();
  const int64_t row_stride = int64_t{s.w} * kLanes;
  const int64_t rows = s.n * s.blocks() * out_h;
#pragma omp parallel for schedule(static) \
    num_threads(s.num_threads) if (rows * s.out_w() * kLanes >= kParallelElements)
  for (int64_t row = 0; row < rows; ++row) {
    PoolReluBackwardRow<kLanes, kWindow>(
        s, row, winners, dy,
        d_conv + (row / out_h) * s.h * row_stride + (row % out_h) * s.k * row_stride);
  }
}

// The accumulators of one kernel row: for every kw, the sum over the output
// pixels of dy * x, 8 filters per register. x is the sample's image padded
// with zeros (row length `padded_w`), dy its block of filters.
template <int kLanes, int kKernelW>
void AccumulateKernelRow(const Conv2dConfig& c, const float* padded_x, int64_t padded_w,
                         const float* dy, int r, float* partial) {
  const int out_h = c.out_h(), out_w = c.out_w();
  // G registers of 8 channels at a time, each x broadcast once for the G:
  // the whole block where its sums fit in the 16 registers with room for
  // the operands, else 8 channels at a time. Each sum runs over p, q in
  // the same order either way.
  constexpr int G = kLanes / 8 * kKernelW <= 12 ? kLanes / 8 : 1;
  for (int g = 0; g < kLanes; g += 8 * G) {
    __m256 acc[kKernelW][G];
    for (int s = 0; s < kKernelW; ++s) {
      for (int h = 0; h < G; ++h) acc[s][h] = _mm256_setzero_ps();
    }
    for (int p = 0; p < out_h; ++p) {
      const float* x_row = padded_x + (int64_t{p} * c.stride_h + r) * padded_w;
      const float* dy_row = dy + int64_t{p} * out_w * kLanes + g;
      for (int q = 0; q < out_w; ++q) {
        __m256 d[G];
        for (int h = 0; h < G; ++h) d[h] = _mm256_loadu_ps(dy_row + int64_t{q} * kLanes + 8 * h);
        const float* xs = x_row + int64_t{q} * c.stride_w;
        for (int s = 0; s < kKernelW; ++s) {
          const __m256 x = _mm256_broadcast_ss(xs + s);
          for (int h = 0; h < G; ++h) acc[s][h] = _mm256_fmadd_ps(d[h], x, acc[s][h]);
        }
      }
    }
    for (int s = 0; s < kKernelW; ++s) {
      for (int h = 0; h < G; ++h) {
        float* out = partial + s * kLanes + g + 8 * h;
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), acc[s][h]));
      }
    }
  }
}

// The sum of dy over the output pixels of one block, added to `partial`.
template <int kLanes>
void AccumulateBias(const Conv2dConfig& c, const float* dy, float* partial) {
  const int64_t pixels = int64_t{c.out_h()} * c.out_w();
  for (int g = 0; g < kLanes; g += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < pixels; ++i)
      acc = _mm256_add_ps(acc, _mm256_loadu_ps(dy + i * kLanes + g));
    _mm256_storeu_ps(partial + g, _mm256_add_ps(_mm256_loadu_ps(partial + g), acc));
  }
}

// Where WeightGrad reads a block's dy: in memory, or made block by block
// from the pool's winners and pooled gradient into the thread's scratch.
struct DySource {
  // [n][blocks][out_h][out_w][lanes]; nullptr: made by the pool's backward.
  const float* dy = nullptr;
  const BlockedPoolShape* pool = nullptr;
  const uint8_t* winners = nullptr;
  const float* pooled_dy = nullptr;
  void (*pool_row)(const BlockedPoolShape&, int64_t, const uint8_t*, const float*,
                   float*) = nullptr;
};

// Each thread sums a contiguous range of samples into its own partial sums
// ([blocks][kernel_h][kernel_w][kLanes] and [blocks][kLanes]); the partials
// are then added in thread order.
template <int kLanes, int kKernelW>
void WeightGrad(const Conv2dConfig& c, int num_threads, const float* x, const DySource& source,
                float* dw, float* dbias, std::vector<float>* scratch) {
  const int blocks = (c.filters + kLanes - 1) / kLanes;
  const int out_h = c.out_h(), out_w = c.out_w();
  const int64_t padded_h = c.h + 2 * int64_t{c.pad_h}, padded_w = c.w + 2 * int64_t{c.pad_w};
  const int64_t image = padded_h * padded_w;
  const int64_t weights = int64_t{blocks} * c.kernel_h * kKernelW * kLanes;
  const int64_t biases = int64_t{blocks} * kLanes;
  const int64_t dy_block = int64_t{out_h} * out_w * kLanes;
  // A block's gradient when the pool makes it: L2-sized (50 KB for 28x28).
  const int64_t made_dy = source.dy == nullptr ? dy_block : 0;
  const int64_t per_thread = image + weights + biases + made_dy;
  const int64_t work = c.n * dy_block * c.kernel_h * kKernelW;
  const int threads = work >= kParallelElements ? std::max(num_threads, 1) : 1;
  scratch->assign(static_cast<size_t>(per_thread * threads), 0.f);
  int team = 1;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int count = omp_get_num_threads();
#pragma omp single
    team = count;
    float* padded_x = scratch->data() + t * per_thread;
    float* partial_w = padded_x + image;
    float* partial_b = partial_w + weights;
    float* block_dy = partial_b + biases;
    const int64_t begin = c.n * t / count, end = c.n * (t + 1) / count;
    for (int64_t sample = begin; sample < end; ++sample) {
      // The borders stay zero from the assign above; only the inside moves.
      const float* in = x + sample * c.h * c.w;
      for (int i = 0; i < c.h; ++i) {
        std::memcpy(padded_x + (i + c.pad_h) * padded_w + c.pad_w, in + int64_t{i} * c.w,
                    sizeof(float) * c.w);
      }
      for (int block = 0; block < blocks; ++block) {
        const float* dy_b = block_dy;
        if (source.dy != nullptr) {
          dy_b = source.dy + (sample * blocks + block) * dy_block;
        } else {
          const BlockedPoolShape& pool = *source.pool;
          const int64_t first_row = (sample * blocks + block) * pool.out_h();
          const int64_t rows_apart = int64_t{pool.k} * pool.w * kLanes;
          for (int p = 0; p < pool.out_h(); ++p) {
            source.pool_row(pool, first_row + p, source.winners, source.pooled_dy,
                            block_dy + p * rows_apart);
          }
        }
        for (int r = 0; r < c.kernel_h; ++r) {
          AccumulateKernelRow<kLanes, kKernelW>(
              c, padded_x, padded_w, dy_b, r,
              partial_w + (int64_t{block} * c.kernel_h + r) * kKernelW * kLanes);
        }
        if (dbias != nullptr) AccumulateBias<kLanes>(c, dy_b, partial_b + int64_t{block} * kLanes);
      }
    }
  }
  // dw[k][0][r][s] from [block][r][s][lane], the threads' sums in order.
  for (int k = 0; k < c.filters; ++k) {
    const int block = k / kLanes, lane = k % kLanes;
    for (int r = 0; r < c.kernel_h; ++r) {
      for (int s = 0; s < kKernelW; ++s) {
        const int64_t at =
            image + ((int64_t{block} * c.kernel_h + r) * kKernelW + s) * kLanes + lane;
        float sum = (*scratch)[at];
        for (int t = 1; t < team; ++t) sum += (*scratch)[t * per_thread + at];
        dw[(int64_t{k} * c.kernel_h + r) * kKernelW + s] = sum;
      }
    }
    if (dbias != nullptr) {
      const int64_t at = image + weights + int64_t{block} * kLanes + lane;
      float sum = (*scratch)[at];
      for (int t = 1; t < team; ++t) sum += (*scratch)[t * per_thread + at];
      dbias[k] = sum;
    }
  }
}

template <int kLanes>
void WeightGradForLanes(const Conv2dConfig& c, int num_threads, const float* x, const DySource& dy,
                        float* dw, float* dbias, std::vector<float>* scratch) {
  switch (c.kernel_w) {
    case 1:
      return WeightGrad<kLanes, 1>(c, num_threads, x, dy, dw, dbias, scratch);
    case 2:
      return WeightGrad<kLanes, 2>(c, num_threads, x, dy, dw, dbias, scratch);
    case 3:
      return WeightGrad<kLanes, 3>(c, num_threads, x, dy, dw, dbias, scratch);
    case 4:
      return WeightGrad<kLanes, 4>(c, num_threads, x, dy, dw, dbias, scratch);
    case 5:
      return WeightGrad<kLanes, 5>(c, num_threads, x, dy, dw, dbias, scratch);
    case 6:
      return WeightGrad<kLanes, 6>(c, num_threads, x, dy, dw, dbias, scratch);
    case 7:
      return WeightGrad<kLanes, 7>(c, num_threads, x, dy, dw, dbias, scratch);
    default:
      return WeightGrad<kLanes, 8>(c, num_threads, x, dy, dw, dbias, scratch);
  }
}

}  // namespace

bool BlockedPoolShapeIsValid(const BlockedPoolShape& s) {
  return (s.lanes == 8 || s.lanes == 16) && s.n > 0 && s.channels > 0 && s.k > 0 &&
         s.k <= kMaxBlockedPoolWindow && s.h > 0 && s.w > 0 && s.h % s.k == 0 && s.w % s.k == 0 &&
         s.num_threads > 0;
}

int64_t BlockedPoolWinnersSize(const BlockedPoolShape& s) {
  return s.n * s.blocks() * s.out_h() * int64_t{s.out_w()} * s.lanes;
}

void BlockedMaxPoolReluForward(const BlockedPoolShape& s, const float* conv, float* y,
                               uint8_t* winners) {
  if (s.lanes == 8) {
    s.k == 2 ? PoolReluForward<8, 2>(s, conv, y, winners)
             : PoolReluForward<8, 0>(s, conv, y, winners);
  } else {
    s.k == 2 ? PoolReluForward<16, 2>(s, conv, y, winners)
             : PoolReluForward<16, 0>(s, conv, y, winners);
  }
}

void BlockedMaxPoolReluBackward(const BlockedPoolShape& s, const uint8_t* winners, const float* dy,
                                float* d_conv) {
  if (s.lanes == 8) {
    s.k == 2 ? PoolReluBackward<8, 2>(s, winners, dy, d_conv)
             : PoolReluBackward<8, 0>(s, winners, dy, d_conv);
  } else {
    s.k == 2 ? PoolReluBackward<16, 2>(s, winners, dy, d_conv)
             : PoolReluBackward<16, 0>(s, winners, dy, d_conv);
  }
}

bool OneChannelConvWeightGradApplies(const Conv2dConfig& c) {
  return c.c == 1 && c.kernel_w >= 1 && c.kernel_w <= 8 && c.dtype == DataType::kF32 &&
         c.layout == TensorLayout::kNCHW;
}

void OneChannelConvWeightGrad(const Conv2dConfig& c, int lanes, int num_threads, const float* x,
                              const float* dy, float* dw, float* dbias,
                              std::vector<float>* scratch) {
  const DySource source{.dy = dy};
  if (lanes == 8) {
    WeightGradForLanes<8>(c, num_threads, x, source, dw, dbias, scratch);
  } else {
    WeightGradForLanes<16>(c, num_threads, x, source, dw, dbias, scratch);
  }
}

bool OneChannelConvWeightGradThroughPoolApplies(const Conv2dConfig& c,
                                                const BlockedPoolShape& pool) {
  return OneChannelConvWeightGradApplies(c) && BlockedPoolShapeIsValid(pool) && pool.n == c.n &&
         pool.channels == c.filters && pool.h == c.out_h() && pool.w == c.out_w();
}

void OneChannelConvWeightGradThroughPool(const Conv2dConfig& c, const BlockedPoolShape& pool,
                                         int num_threads, const float* x, const uint8_t* winners,
                                         const float* pooled_dy, float* dw, float* dbias,
                                         std::vector<float>* scratch) {
  DySource source{.pool = &pool, .winners = winners, .pooled_dy = pooled_dy};
  if (pool.lanes == 8) {
    source.pool_row = pool.k == 2 ? PoolReluBackwardRow<8, 2> : PoolReluBackwardRow<8, 0>;
    WeightGradForLanes<8>(c, num_threads, x, source, dw, dbias, scratch);
  } else {
    source.pool_row = pool.k == 2 ? PoolReluBackwardRow<16, 2> : PoolReluBackwardRow<16, 0>;
    WeightGradForLanes<16>(c, num_threads, x, source, dw, dbias, scratch);
  }
}

}  // namespace pstrain::cpu_internal
