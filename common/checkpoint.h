// Checkpoint files: atomic, checksummed storage of a v1::Checkpoint.
//
//   v1::Checkpoint ckpt;
//   *ckpt.mutable_job() = job;
//   *ckpt.add_parameters() = MakeTensorProto("fc1/weight", {10, 784}, host_w);
//   ckpt.set_step(step);
//   PSTRAIN_RETURN_IF_ERROR(WriteCheckpointFile("/var/lib/pstrain/job-7.ckpt", ckpt));
//   ...
//   PSTRAIN_ASSIGN_OR_RETURN(v1::Checkpoint loaded,
//                            ReadCheckpointFile("/var/lib/pstrain/job-7.ckpt"));
//   PSTRAIN_ASSIGN_OR_RETURN(std::vector<float> w,
//                            TensorProtoToFloats(loaded.parameters(0)));
//
// On disk a checkpoint is written in parts (format 2, checkpoint.proto): a
// manifest, the tensors in slices of at most 64 MiB, and an end mark, each
// with its own zlib CRC-32, so that neither the checkpoint nor one tensor has
// a size limit and memory holds one part at a time beyond the checkpoint.
// Files of format 1 (one v1::CheckpointFile envelope, at most 2 GiB) are
// still read. A write goes to a temporary file beside the target, part by
// part, is fsync'ed, renamed over the target and the directory is fsync'ed,
// so a reader sees either the old checkpoint or the new one, never a mix,
// even when the writer is killed between two parts.
//
// Threads: every function here is thread-safe. Concurrent writers of the same
// path each use their own temporary file; the last rename wins.
#ifndef PSTRAIN_COMMON_CHECKPOINT_H_
#define PSTRAIN_COMMON_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pstrain/v1/checkpoint.pb.h"
#include "pstrain/v1/tensor.pb.h"

namespace pstrain {

// The envelope version of format-1 files (read, no longer written).
inline constexpr uint32_t kCheckpointFormatVersion = 1;
// The first bytes of a format-2 (parts) file.
inline constexpr char kCheckpointPartsMagic[] = "PSTCKPT2";

struct CheckpointWriteOptions {
  // Largest slice of tensor data in one part (> 0); tests make it small.
  int64_t max_part_bytes = int64_t{64} << 20;
  // Called after each part is written (its number, from 0), before the
  // next: tests kill the process there.
  std::function<void(int part)> after_part;
};

// Atomically replaces `path` with `ckpt`. The data goes to
// "<path>.tmp.<pid>.<n>" first (n distinguishes writers within one process);
// on any failure that file is removed and an existing checkpoint at `path` is
// left untouched. Every tensor must pass ValidateTensorProto and tensor names
// must be unique, and the checkpoint must not be entirely empty
// (INVALID_ARGUMENT otherwise, nothing written). I/O failures come back with
// the path and the system error in the message: NOT_FOUND (missing
// directory), PERMISSION_DENIED, RESOURCE_EXHAUSTED (disk full, quota), else
// INTERNAL.
absl::Status WriteCheckpointFile(const std::string& path, const v1::Checkpoint& ckpt,
                                 const CheckpointWriteOptions& options = {});

// Reads and verifies a checkpoint written by WriteCheckpointFile (format 2,
// any size) or by an older build (format 1, up to 2 GiB - 1).
// Errors: NOT_FOUND (no such file), DATA_LOSS (unparsable envelope, part or
// payload, missing payload or end part, "checksum mismatch: file is
// corrupt", a tensor whose byte count does not match its shape and dtype,
// negative dimensions, duplicate tensor names), FAILED_PRECONDITION (a
// format_version this build does not read).
absl::StatusOr<v1::Checkpoint> ReadCheckpointFile(const std::string& path);

// A DTYPE_F32 tensor holding `product(shape)` floats read from `data`
// (little-endian bytes; `data` may be null only when the product is 0).
v1::TensorProto MakeTensorProto(const std::string& name, const std::vector<int64_t>& shape,
                                const float* data);

// Width in bytes of one element of `dtype`; 0 for DTYPE_UNSPECIFIED or an
// unknown value.
int DTypeWidth(v1::DType dtype);

// Checks that `t` has a known dtype, no negative dimension, an element count
// that does not overflow, and exactly product(shape) * width bytes of data.
// INVALID_ARGUMENT naming the tensor otherwise.
absl::Status ValidateTensorProto(const v1::TensorProto& t);

// The elements of a valid DTYPE_F32 tensor. Other dtypes are UNIMPLEMENTED
// for now; an invalid tensor is INVALID_ARGUMENT.
absl::StatusOr<std::vector<float>> TensorProtoToFloats(const v1::TensorProto& t);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CHECKPOINT_H_
