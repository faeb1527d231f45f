// ONNX export of a trained model: the inference graph of a checkpoint's
// ModelSpec, with the checkpoint's weights as initializers, in Debian's ONNX
// protobuf schema (libonnx-dev, onnx/onnx_pb.h).
//
//   PSTRAIN_ASSIGN_OR_RETURN(v1::Checkpoint ckpt, ReadCheckpointFile("job-1.ckpt"));
//   PSTRAIN_ASSIGN_OR_RETURN(onnx::ModelProto model, ExportOnnx(ckpt));
//   PSTRAIN_RETURN_IF_ERROR(WriteOnnxFile(model, "model.onnx"));
//
// The graph (opset 13, IR version 7, what onnxruntime and Debian's onnx 1.12
// both read):
//   input          float [batch, C, H, W] (or [batch, F]): the normalised
//                  input, x = (pixel / 255 - mean[c]) / std[c] with the job's
//                  dataset mean and std (recorded in metadata_props
//                  "pstrain.mean" and "pstrain.std"), as training saw it;
//   logits         float [batch, num_classes]: what softmax_cross_entropy
//                  reads (what `pstrain-worker --evaluate --logits-out` writes);
//   probabilities  Softmax of the logits over axis 1.
// Layers map one to one: conv2d -> Conv, max_pool -> MaxPool, avg_pool ->
// AveragePool (padding excluded from the divisor, as pstrain computes it),
// dense -> Gemm with transB (after a Flatten when its input is not flat),
// batch_norm -> BatchNormalization on the running statistics (inference
// form), relu / leaky_relu / tanh / sigmoid, flatten -> Flatten, add -> Add
// (Sum for more than two inputs). Dropout is the identity at inference and
// is omitted.
//
// Threads: pure functions; thread-safe.
#ifndef PSTRAIN_CLIENT_ONNX_EXPORT_H_
#define PSTRAIN_CLIENT_ONNX_EXPORT_H_

#include <string>

#include "absl/status/statusor.h"
#include "onnx/onnx_pb.h"
#include "pstrain/v1/checkpoint.pb.h"

namespace pstrain {

inline constexpr int kOnnxOpset = 13;
inline constexpr int kOnnxIrVersion = 7;

// The inference graph of `ckpt`'s model with its parameters. Errors:
// INVALID_ARGUMENT for a model that does not validate, or a parameter that
// is missing from the checkpoint or has the wrong number of values (named).
absl::StatusOr<onnx::ModelProto> ExportOnnx(const v1::Checkpoint& ckpt);

// Serialises `model` to `path` atomically (temporary file, fsync, rename).
absl::Status WriteOnnxFile(const onnx::ModelProto& model, const std::string& path);

}  // namespace pstrain

#endif  // PSTRAIN_CLIENT_ONNX_EXPORT_H_
