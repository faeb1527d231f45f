// Counter-based random numbers that every backend computes identically, so
// that dropout masks (and anything else random on the device) match bit for
// bit between the CPU and CUDA backends and the parity tests can compare them.
//
//   float u = pstrain::UniformFloat(seed, i);        // in [0, 1)
//   bool keep = pstrain::DropoutKeep(seed, i, 0.4f);
//
// Header-only and free of dependencies so that host code, CUDA kernels and
// the server all share it.
#ifndef PSTRAIN_COMMON_RNG_H_
#define PSTRAIN_COMMON_RNG_H_

#include <cstdint>

#if defined(__CUDACC__)
#define PSTRAIN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PSTRAIN_HOST_DEVICE inline
#endif

namespace pstrain {

// SplitMix64 finaliser over (seed, index): a strong 64-bit mix.
PSTRAIN_HOST_DEVICE uint64_t MixBits(uint64_t seed, uint64_t index) {
  uint64_t z = seed + (index + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [0, 1) with 24 bits of resolution.
PSTRAIN_HOST_DEVICE float UniformFloat(uint64_t seed, uint64_t index) {
  return static_cast<float>(MixBits(seed, index) >> 40) * (1.0f / 16777216.0f);
}

// True when element `index` survives dropout with drop probability `rate`.
PSTRAIN_HOST_DEVICE bool DropoutKeep(uint64_t seed, uint64_t index, float rate) {
  return UniformFloat(seed, index) >= rate;
}

// DropoutKeep in integers, for loops that vectorise (no 64-bit integer to
// float conversion): UniformFloat is h * 2^-24 with h = MixBits >> 40 exact
// in a float, and rate * 2^24 is exact too, so u >= rate exactly when
// h >= ceil(rate * 2^24). For rate in [0, 1).
PSTRAIN_HOST_DEVICE uint32_t DropoutKeepThreshold(float rate) {
  const float scaled = rate * 16777216.0f;
  const uint32_t floor = static_cast<uint32_t>(scaled);
  return static_cast<float>(floor) == scaled ? floor : floor + 1;
}
PSTRAIN_HOST_DEVICE bool DropoutKeepBits(uint64_t seed, uint64_t index, uint32_t threshold) {
  return (MixBits(seed, index) >> 40) >= threshold;
}

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_RNG_H_
