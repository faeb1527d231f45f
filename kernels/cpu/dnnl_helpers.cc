#include "kernels/cpu/dnnl_helpers.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pstrain::cpu_internal {

absl::Status DnnlToStatus(dnnl_status_t status, absl::string_view what) {
  switch (status) {
    case dnnl_success:
      return absl::OkStatus();
    case dnnl_out_of_memory:
      return absl::ResourceExhaustedError(absl::StrCat(what, ": oneDNN out of memory"));
    case dnnl_invalid_arguments:
      return absl::InvalidArgumentError(absl::StrCat(what, ": oneDNN rejected the arguments"));
    case dnnl_unimplemented:
      return absl::UnimplementedError(
          absl::StrCat(what, ": oneDNN has no implementation for this configuration"));
    default:
      return absl::InternalError(
          absl::StrCat(what, ": oneDNN error ", static_cast<int>(status)));
  }
}

absl::StatusOr<std::shared_ptr<DnnlContext>> DnnlContext::Create() {
  auto ctx = std::make_shared<DnnlContext>();
  dnnl_engine_t engine = nullptr;
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_engine_create(&engine, dnnl_cpu, 0), "cpu engine");
  ctx->engine = DnnlEngine(engine);
  dnnl_stream_t stream = nullptr;
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_stream_create(&stream, engine, dnnl_stream_default_flags),
                               "cpu stream");
  ctx->stream = DnnlStream(stream);
  return ctx;
}

absl::StatusOr<dnnl_memory_desc_t> PlainDesc(const std::vector<int64_t>& dims,
                                             dnnl_format_tag_t tag) {
  dnnl_memory_desc_t md;
  dnnl_dims_t d;
  for (size_t i = 0; i < dims.size(); ++i) d[i] = dims[i];
  PSTRAIN_RETURN_IF_DNNL_ERROR(
      dnnl_memory_desc_init_by_tag(&md, static_cast<int>(dims.size()), d, dnnl_f32, tag),
      "memory descriptor");
  return md;
}

int ChannelBlock(const dnnl_memory_desc_t& md) {
  if (md.ndims != 4 || md.data_type != dnnl_f32) return 0;
  for (const dnnl_format_tag_t tag : {dnnl_aBcd8b, dnnl_aBcd16b}) {
    dnnl_memory_desc_t want;
    if (dnnl_memory_desc_init_by_tag(&want, 4, md.dims, dnnl_f32, tag) != dnnl_success) continue;
    if (dnnl_memory_desc_equal(&want, &md)) return tag == dnnl_aBcd8b ? 8 : 16;
  }
  return 0;
}

absl::StatusOr<DnnlPrimitiveDesc> CreatePrimitiveDesc(const_dnnl_op_desc_t op_desc,
                                                      const DnnlContext& ctx,
                                                      const_dnnl_primitive_desc_t hint,
                                                      absl::string_view what,
                                                      const_dnnl_primitive_attr_t attr) {
  dnnl_primitive_desc_t pd = nullptr;
  PSTRAIN_RETURN_IF_DNNL_ERROR(
      dnnl_primitive_desc_create(&pd, op_desc, attr, ctx.engine.get(), hint), what);
  return DnnlPrimitiveDesc(pd);
}

absl::StatusOr<DnnlMemory> CreateMemory(const dnnl_memory_desc_t& md, const DnnlContext& ctx,
                                        bool allocate, absl::string_view what) {
  dnnl_memory_t memory = nullptr;
  PSTRAIN_RETURN_IF_DNNL_ERROR(
      dnnl_memory_create(&memory, &md, ctx.engine.get(),
                         allocate ? DNNL_MEMORY_ALLOCATE : DNNL_MEMORY_NONE),
      what);
  return DnnlMemory(memory);
}

absl::Status Bind(const DnnlMemory& memory, const void* data, absl::string_view what) {
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_memory_set_data_handle(memory.get(), const_cast<void*>(data)),
                               what);
  return absl::OkStatus();
}

absl::StatusOr<DnnlPrimitive> DnnlPrimitive::Create(DnnlPrimitiveDesc pd, absl::string_view what) {
  dnnl_primitive_t primitive = nullptr;
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_primitive_create(&primitive, pd.get()), what);
  DnnlPrimitive out;
  out.pd_ = std::move(pd);
  out.primitive_.reset(primitive);
  return out;
}

const dnnl_memory_desc_t& DnnlPrimitive::Md(dnnl_query_t query, int index) const {
  static const dnnl_memory_desc_t kZero{};  // What oneDNN returns for "not used".
  const dnnl_memory_desc_t* md = dnnl_primitive_desc_query_md(pd_.get(), query, index);
  return md != nullptr ? *md : kZero;
}

absl::Status DnnlPrimitive::Execute(const DnnlContext& ctx,
                                    const std::vector<dnnl_exec_arg_t>& args,
                                    absl::string_view what) const {
  PSTRAIN_RETURN_IF_DNNL_ERROR(
      dnnl_primitive_execute(primitive_.get(), ctx.stream.get(), static_cast<int>(args.size()),
                             args.data()),
      what);
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_stream_wait(ctx.stream.get()), what);
  return absl::OkStatus();
}

absl::StatusOr<LayoutBridge> LayoutBridge::Create(const DnnlContext& ctx,
                                                  const dnnl_memory_desc_t& user_md,
                                                  const dnnl_memory_desc_t& primitive_md,
                                                  bool to_primitive, absl::string_view what) {
  LayoutBridge bridge;
  bridge.to_primitive_ = to_primitive;
  PSTRAIN_ASSIGN_OR_RETURN(bridge.user_, CreateMemory(user_md, ctx, /*allocate=*/false, what));
  if (dnnl_memory_desc_equal(&user_md, &primitive_md)) return bridge;
  PSTRAIN_ASSIGN_OR_RETURN(bridge.primitive_,
                           CreateMemory(primitive_md, ctx, /*allocate=*/true, what));
  const dnnl_memory_desc_t& src = to_primitive ? user_md : primitive_md;
  const dnnl_memory_desc_t& dst = to_primitive ? primitive_md : user_md;
  dnnl_primitive_desc_t pd = nullptr;
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_reorder_primitive_desc_create(&pd, &src, ctx.engine.get(), &dst,
                                                                  ctx.engine.get(), nullptr),
                               what);
  PSTRAIN_ASSIGN_OR_RETURN(bridge.reorder_, DnnlPrimitive::Create(DnnlPrimitiveDesc(pd), what));
  return bridge;
}

absl::StatusOr<dnnl_memory_t> LayoutBridge::In(const DnnlContext& ctx, const void* user) {
  PSTRAIN_RETURN_IF_ERROR(Bind(user_, user, "bind input"));
  if (!reorder_) return user_.get();
  PSTRAIN_RETURN_IF_ERROR(reorder_.Execute(
      ctx, {{DNNL_ARG_FROM, user_.get()}, {DNNL_ARG_TO, primitive_.get()}}, "reorder input"));
  return primitive_.get();
}

absl::StatusOr<dnnl_memory_t> LayoutBridge::OutTarget(void* user) {
  PSTRAIN_RETURN_IF_ERROR(Bind(user_, user, "bind output"));
  return reorder_ ? primitive_.get() : user_.get();
}

absl::Status LayoutBridge::OutFinish(const DnnlContext& ctx) {
  if (!reorder_) return absl::OkStatus();
  return reorder_.Execute(ctx, {{DNNL_ARG_FROM, primitive_.get()}, {DNNL_ARG_TO, user_.get()}},
                          "reorder output");
}

}  // namespace pstrain::cpu_internal
