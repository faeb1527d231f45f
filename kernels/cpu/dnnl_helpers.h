// Internal to kernels/cpu/: thin RAII over oneDNN's C API, which reports
// errors as status codes (the C++ API would throw, and pstrain builds no code
// that throws). Not for use outside kernels/cpu/.
//
//   PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<DnnlContext> ctx, DnnlContext::Create());
//   PSTRAIN_ASSIGN_OR_RETURN(DnnlPrimitive prim, DnnlPrimitive::Create(pd.get(), "Conv2d"));
//   PSTRAIN_RETURN_IF_ERROR(prim.Execute(*ctx, args, "Conv2d.Forward"));
//
// Threads: same as the Backend: one thread at a time.
#ifndef PSTRAIN_KERNELS_CPU_DNNL_HELPERS_H_
#define PSTRAIN_KERNELS_CPU_DNNL_HELPERS_H_

#include <memory>
#include "absl/strings/string_view.h"
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "oneapi/dnnl/dnnl.h"

namespace pstrain::cpu_internal {

// OK for dnnl_success, else an error naming `what` and the oneDNN status.
absl::Status DnnlToStatus(dnnl_status_t status, absl::string_view what);

#define PSTRAIN_RETURN_IF_DNNL_ERROR(expr, what)                                         \
  do {                                                                                   \
    dnnl_status_t _pstrain_dnnl_status = (expr);                                         \
    if (_pstrain_dnnl_status != dnnl_success) {                                          \
      return ::pstrain::cpu_internal::DnnlToStatus(_pstrain_dnnl_status, (what));        \
    }                                                                                    \
  } while (0)

// Move-only owner of one oneDNN C handle, destroyed with `Destroy`.
template <typename Handle, dnnl_status_t (*Destroy)(Handle)>
class DnnlHandle {
 public:
  DnnlHandle() = default;
  explicit DnnlHandle(Handle handle) : handle_(handle) {}
  ~DnnlHandle() { Reset(); }
  DnnlHandle(DnnlHandle&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  DnnlHandle& operator=(DnnlHandle&& other) noexcept {
    if (this != &other) {
      Reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  DnnlHandle(const DnnlHandle&) = delete;
  DnnlHandle& operator=(const DnnlHandle&) = delete;

  Handle get() const { return handle_; }
  explicit operator bool() const { return handle_ != nullptr; }
  void Reset() {
    if (handle_ != nullptr) Destroy(handle_);
    handle_ = nullptr;
  }

 private:
  Handle handle_ = nullptr;
};

using DnnlEngine = DnnlHandle<dnnl_engine_t, dnnl_engine_destroy>;
using DnnlStream = DnnlHandle<dnnl_stream_t, dnnl_stream_destroy>;
using DnnlPrimitiveDesc = DnnlHandle<dnnl_primitive_desc_t, dnnl_primitive_desc_destroy>;
using DnnlMemory = DnnlHandle<dnnl_memory_t, dnnl_memory_destroy>;

// The CPU engine and its in-order stream, shared by a backend and its plans
// (plans hold a shared_ptr, so they may outlive the backend safely).
struct DnnlContext {
  static absl::StatusOr<std::shared_ptr<DnnlContext>> Create();

  DnnlEngine engine;
  DnnlStream stream;
};

// A plain (user-layout) memory descriptor with the given dims and tag.
absl::StatusOr<dnnl_memory_desc_t> PlainDesc(const std::vector<int64_t>& dims,
                                             dnnl_format_tag_t tag);

// 8 or 16 when `md` is an fp32 4-d tensor in oneDNN's plain channel-blocked
// layout (nChw8c, nChw16c: dense, no offset; the loops of blocked_loops.h
// read it), else 0.
int ChannelBlock(const dnnl_memory_desc_t& md);

using DnnlAttr = DnnlHandle<dnnl_primitive_attr_t, dnnl_primitive_attr_destroy>;
using DnnlPostOps = DnnlHandle<dnnl_post_ops_t, dnnl_post_ops_destroy>;

// A primitive descriptor from an op descriptor; `hint` is the forward pd for
// backward primitives (or nullptr); `attr` may be nullptr.
absl::StatusOr<DnnlPrimitiveDesc> CreatePrimitiveDesc(const_dnnl_op_desc_t op_desc,
                                                      const DnnlContext& ctx,
                                                      const_dnnl_primitive_desc_t hint,
                                                      absl::string_view what,
                                                      const_dnnl_primitive_attr_t attr = nullptr);

// A memory object over `md`: owning a library-allocated buffer when `allocate`,
// else with no buffer (bind one with Bind before each execution).
absl::StatusOr<DnnlMemory> CreateMemory(const dnnl_memory_desc_t& md, const DnnlContext& ctx,
                                        bool allocate, absl::string_view what);

// Points `memory` at `data` (const is cast away: oneDNN only reads inputs).
absl::Status Bind(const DnnlMemory& memory, const void* data, absl::string_view what);

// A created primitive plus its descriptor.
class DnnlPrimitive {
 public:
  static absl::StatusOr<DnnlPrimitive> Create(DnnlPrimitiveDesc pd, absl::string_view what);
  DnnlPrimitive() = default;
  DnnlPrimitive(DnnlPrimitive&&) noexcept = default;
  DnnlPrimitive& operator=(DnnlPrimitive&&) noexcept = default;

  const_dnnl_primitive_desc_t desc() const { return pd_.get(); }
  // The memory descriptor the primitive expects for `query` (e.g.
  // dnnl_query_src_md), index `index`; a zero descriptor when it has none.
  const dnnl_memory_desc_t& Md(dnnl_query_t query, int index = 0) const;
  // Executes on ctx's stream and waits for completion.
  absl::Status Execute(const DnnlContext& ctx, const std::vector<dnnl_exec_arg_t>& args,
                       absl::string_view what) const;
  explicit operator bool() const { return static_cast<bool>(primitive_); }

 private:
  struct PrimitiveDestroy {
    void operator()(dnnl_primitive_t p) const { dnnl_primitive_destroy(p); }
  };
  DnnlPrimitiveDesc pd_;
  std::unique_ptr<dnnl_primitive, PrimitiveDestroy> primitive_;
};

// One argument of a primitive seen from the user's plain buffer: when the
// primitive wants the plain layout, the user's pointer is bound directly;
// otherwise an owned buffer in the primitive's layout plus a reorder.
class LayoutBridge {
 public:
  // `user_md` is the plain layout the caller passes; `primitive_md` what the
  // primitive expects. `to_primitive`: input (user -> primitive) or output.
  static absl::StatusOr<LayoutBridge> Create(const DnnlContext& ctx,
                                             const dnnl_memory_desc_t& user_md,
                                             const dnnl_memory_desc_t& primitive_md,
                                             bool to_primitive, absl::string_view what);
  LayoutBridge() = default;
  LayoutBridge(LayoutBridge&&) noexcept = default;
  LayoutBridge& operator=(LayoutBridge&&) noexcept = default;

  bool needs_reorder() const { return static_cast<bool>(reorder_); }
  // Input: binds `user` and reorders into the primitive buffer when needed.
  // Returns the memory to pass to the primitive.
  absl::StatusOr<dnnl_memory_t> In(const DnnlContext& ctx, const void* user);
  // Output, before the primitive runs: the memory the primitive writes to.
  absl::StatusOr<dnnl_memory_t> OutTarget(void* user);
  // Output, after the primitive ran: reorders into `user` when needed.
  absl::Status OutFinish(const DnnlContext& ctx);

 private:
  DnnlMemory user_;       // Bound to the caller's pointer per call.
  DnnlMemory primitive_;  // Owned buffer in the primitive's layout (reorder only).
  DnnlPrimitive reorder_;
  bool to_primitive_ = true;
};

}  // namespace pstrain::cpu_internal

#endif  // PSTRAIN_KERNELS_CPU_DNNL_HELPERS_H_
