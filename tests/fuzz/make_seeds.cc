// Writes the seed corpus of every fuzz target into tests/fuzz/corpus/: small,
// valid inputs made with the project's own writers, so that the fuzzers
// start from what the parsers accept. Run once after a format changes:
//
//   build-fuzz/bin/make_fuzz_seeds tests/fuzz/corpus
//
// (the job-spec seeds are examples/ files, copied by hand).
#include <grpc/grpc.h>
#include <grpcpp/support/byte_buffer.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/data/image_codec.h"
#include "common/data/packed_format.h"
#include "tests/testing/bson_dump.h"
#include "common/rpc/gradient_codec.h"
#include "common/rpc/wire.h"

namespace {

namespace fs = std::filesystem;

void Write(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
  std::printf("%s: %zu bytes\n", path.c_str(), bytes.size());
}

std::string Be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

std::string FrameBytes(const pstrain::v1::ChunkHeader& header, const std::vector<char>& payload) {
  grpc::ByteBuffer buffer;
  if (!pstrain::EncodeFrame(header, payload.data(), payload.size(), &buffer, true).ok()) {
    std::abort();
  }
  std::vector<grpc::Slice> slices;
  (void)buffer.Dump(&slices);
  std::string out(1, '\0');  // The fuzzer's first byte: one slice.
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_fuzz_seeds CORPUS_DIR\n");
    return 2;
  }
  grpc_init();
  const fs::path root = argv[1];

  // wire: a gradient push frame in each dtype, a pull request, an empty frame.
  for (auto [dtype, width] : {std::pair{pstrain::v1::DTYPE_F32, 4},
                              {pstrain::v1::DTYPE_F16, 2},
                              {pstrain::v1::DTYPE_BF16, 2}}) {
    pstrain::v1::ChunkHeader h;
    h.set_job_id("job-1");
    h.set_worker_id("worker-1");
    h.set_generation(1);
    h.set_chunk_id(3);
    h.set_version(7);
    h.set_kind(pstrain::v1::ChunkHeader::KIND_GRADIENT);
    h.set_dtype(dtype);
    h.set_num_elements(8);
    std::vector<char> payload(8 * width);
    for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 37);
    Write(root / "wire" / ("push_" + pstrain::v1::DType_Name(dtype)), FrameBytes(h, payload));
  }
  // Compressed gradients: top-k (k = 2 of 16) and sign bits (16 elements).
  for (auto method : {pstrain::v1::CompressionSpec::COMPRESSION_TOPK,
                      pstrain::v1::CompressionSpec::COMPRESSION_ONEBIT}) {
    pstrain::ChunkPlan plan;
    plan.chunks.push_back({.id = 0, .param = 0, .offset = 0, .count = 16, .shard = 0});
    plan.by_param.push_back({0});
    pstrain::v1::CompressionSpec spec;
    spec.set_method(method);
    spec.set_topk_ratio(method == pstrain::v1::CompressionSpec::COMPRESSION_TOPK ? 0.125f : 0);
    pstrain::GradientEncoder encoder(spec, plan);
    std::vector<float> gradient(16);
    for (int i = 0; i < 16; ++i) gradient[i] = 0.1f * static_cast<float>(i % 5) - 0.2f;
    pstrain::EncodedGradient encoded;
    if (!encoder.Encode(0, gradient, &encoded).ok()) return 1;
    pstrain::v1::ChunkHeader h;
    h.set_job_id("job-1");
    h.set_worker_id("worker-1");
    h.set_generation(1);
    h.set_chunk_id(0);
    h.set_kind(pstrain::v1::ChunkHeader::KIND_GRADIENT);
    h.set_num_elements(16);
    h.set_dtype(encoded.dtype);
    h.set_encoding(encoded.encoding);
    h.set_encoded_count(encoded.encoded_count);
    Write(root / "wire" / ("push_" + pstrain::v1::ChunkHeader::Encoding_Name(encoded.encoding)),
          FrameBytes(h, std::vector<char>(encoded.bytes.begin(), encoded.bytes.end())));
  }
  {
    pstrain::v1::ChunkHeader h;
    h.set_job_id("job-1");
    h.set_worker_id("worker-2");
    h.set_kind(pstrain::v1::ChunkHeader::KIND_PARAMETERS);
    h.add_chunk_ids(0);
    h.add_chunk_ids(2);
    Write(root / "wire" / "pull_request", FrameBytes(h, {}));
  }

  // checkpoint: a small model with momentum, as a file (first byte 0), as
  // the inner message of a format-1 envelope (1) and as format-2 parts (2).
  {
    pstrain::v1::Checkpoint ckpt;
    ckpt.mutable_job()->set_name("seed");
    ckpt.mutable_job()->mutable_model()->add_input_shape(4);
    ckpt.mutable_job()->mutable_model()->set_num_classes(2);
    const std::vector<float> weight(8, 0.5f), bias = {0.1f, -0.1f}, momentum(8, 0.0f);
    *ckpt.add_parameters() = pstrain::MakeTensorProto("fc/weight", {2, 4}, weight.data());
    *ckpt.add_parameters() = pstrain::MakeTensorProto("fc/bias", {2}, bias.data());
    *ckpt.add_optimizer_state() =
        pstrain::MakeTensorProto("fc/weight/momentum", {2, 4}, momentum.data());
    ckpt.set_step(12);
    ckpt.set_epoch(1);
    const std::string tmp = (fs::temp_directory_path() / "pstrain-seed.ckpt").string();
    if (!pstrain::WriteCheckpointFile(tmp, ckpt).ok()) return 1;
    std::ifstream in(tmp, std::ios::binary);
    std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    fs::remove(tmp);
    Write(root / "checkpoint" / "file", std::string(1, '\0') + file);
    Write(root / "checkpoint" / "inner", std::string(1, '\1') + ckpt.SerializeAsString());
    // The same file's parts without their CRC-32s (selector 2: the fuzzer
    // frames them again).
    std::string parts;
    for (size_t at = 8; at + 12 <= file.size();) {
      uint64_t length = 0;
      for (int i = 0; i < 8; ++i) {
        length |= uint64_t{static_cast<unsigned char>(file[at + 4 + i])} << (8 * i);
      }
      parts += file.substr(at, 12 + length);
      at += 12 + length + 4;
    }
    Write(root / "checkpoint" / "parts", std::string(1, '\2') + parts);
  }

  // idx: two 4x4 images and their labels (the fuzzer's 2-byte split first).
  {
    std::string images = Be32(0x00000803) + Be32(2) + Be32(4) + Be32(4) + std::string(32, '\x40');
    std::string labels = Be32(0x00000801) + Be32(2) + std::string("\x03\x07", 2);
    const uint16_t split = static_cast<uint16_t>(images.size());
    std::string input = {static_cast<char>(split >> 8), static_cast<char>(split & 0xff)};
    Write(root / "idx" / "pair", input + images + labels);
  }

  // cifar: two records.
  {
    std::string records;
    for (int r = 0; r < 2; ++r) {
      records += static_cast<char>(r + 1);
      for (int i = 0; i < 3 * 32 * 32; ++i) records += static_cast<char>((i * (r + 3)) & 0xff);
    }
    Write(root / "cifar" / "two_records", records);
  }

  // packed: a shard of three 2x3x3 records, written by the project's writer.
  {
    pstrain::data::DatasetSplits splits;
    for (pstrain::data::ImageDataset* ds : {&splits.train, &splits.test}) {
      ds->channels = 2;
      ds->height = 3;
      ds->width = 3;
      ds->num_classes = 4;
      for (int r = 0; r < 3; ++r) {
        ds->labels.push_back(r);
        for (int i = 0; i < 18; ++i) ds->pixels.push_back(static_cast<uint8_t>(i * 7 + r));
      }
    }
    const fs::path dir = fs::temp_directory_path() / "pstrain-packed-seed";
    if (pstrain::data::WritePackedDataset(splits, dir.string(), {}).ok()) {
      std::ifstream in(dir / pstrain::data::PackedShardName("train", 0, 1), std::ios::binary);
      Write(root / "packed" / "three_records",
            std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
    }
    fs::remove_all(dir);
  }

  // bson: two products in the dump's layout (one and two pictures), and one
  // without a category_id, written by libbson.
  {
    pstrain::data::DecodedImage image;
    image.width = image.height = 4;
    image.channels = 1;
    for (int i = 0; i < 16; ++i) image.pixels.push_back(static_cast<uint8_t>(i * 15));
    const std::string jpeg = *pstrain::data::EncodeJpeg(image, 90);
    Write(root / "bson" / "two_products",
          pstrain::testing::ProductDocument(1, 1000010653, {jpeg}) +
              pstrain::testing::ProductDocument(2, 1000010661, {jpeg, jpeg}));
    Write(root / "bson" / "no_category", pstrain::testing::ProductDocument(3, std::nullopt, {jpeg}));
  }

  // png, jpeg: a gray and an RGB image each.
  for (int channels : {1, 3}) {
    pstrain::data::DecodedImage image;
    image.width = 7;
    image.height = 5;
    image.channels = channels;
    for (int i = 0; i < 7 * 5 * channels; ++i) image.pixels.push_back(static_cast<uint8_t>(i * 11));
    const std::string tag = channels == 1 ? "gray" : "rgb";
    Write(root / "png" / tag, *pstrain::data::EncodePng(image));
    Write(root / "jpeg" / tag, *pstrain::data::EncodeJpeg(image, 90));
  }
  return 0;
}
