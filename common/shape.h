// Tensor shapes: a small value type with the helpers layers need.
//
//   Shape s{64, 1, 28, 28};
//   s.num_elements();   // 50176
//   s.ToString();       // "[64, 1, 28, 28]"
#ifndef PSTRAIN_COMMON_SHAPE_H_
#define PSTRAIN_COMMON_SHAPE_H_

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

namespace pstrain {

// Overflow-checked int64 arithmetic for sizes: the result, or nullopt when
// it does not fit in int64_t.
inline std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}
inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// Dimensions outermost first (NCHW for images). A value type; thread-compatible.
class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) : dims_(dims) {}
  explicit Shape(std::vector<int64_t> dims) : dims_(std::move(dims)) {}

  int rank() const { return static_cast<int>(dims_.size()); }
  int64_t dim(int i) const { return dims_[i]; }
  int64_t operator[](int i) const { return dims_[i]; }
  const std::vector<int64_t>& dims() const { return dims_; }

  // Product of all dimensions; 1 for a scalar (rank 0).
  int64_t num_elements() const {
    int64_t n = 1;
    for (int64_t d : dims_) n *= d;
    return n;
  }
  // num_elements(), or nullopt when a dimension is negative or the product
  // overflows int64_t. Use it on shapes that come from input (specs, wire).
  std::optional<int64_t> CheckedNumElements() const {
    int64_t n = 1;
    for (int64_t d : dims_) {
      if (d < 0) return std::nullopt;
      std::optional<int64_t> next = CheckedMul(n, d);
      if (!next) return std::nullopt;
      n = *next;
    }
    return n;
  }

  std::string ToString() const {
    std::string out = "[";
    for (size_t i = 0; i < dims_.size(); ++i) {
      if (i) out += ", ";
      out += std::to_string(dims_[i]);
    }
    return out + "]";
  }

  friend bool operator==(const Shape& a, const Shape& b) { return a.dims_ == b.dims_; }
  friend bool operator!=(const Shape& a, const Shape& b) { return !(a == b); }

 private:
  std::vector<int64_t> dims_;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_SHAPE_H_
