#include "common/data/image_folder_reader.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <filesystem>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/data/file_io.h"
#include "common/data/image_codec.h"
#include "common/status_macros.h"
#include "common/storage/storage.h"

namespace pstrain::data {
namespace {

namespace fs = std::filesystem;

bool IsImageFile(const fs::path& path) {
  std::string ext = path.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

bool IsHidden(const fs::path& path) {
  std::string name = path.filename().string();
  return !name.empty() && name[0] == '.';
}

struct ImageFile {
  std::string path;
  int32_t label = 0;
};

// Decodes files[i] into out->pixels at sample i, on `threads` threads. On
// failure returns the error of the lowest-index failing file, so the message
// does not depend on scheduling.
absl::Status DecodeAll(const std::vector<ImageFile>& files, const ImageFolderOptions& options,
                       ImageDataset* out, storage::Storage* store = nullptr) {
  const int64_t sample_bytes = out->sample_elements();
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  size_t error_index = files.size();  // Guarded by mu.
  absl::Status error;                  // Guarded by mu.

  auto work = [&] {
    while (true) {
      size_t i = next.fetch_add(1);
      if (i >= files.size() || failed.load(std::memory_order_relaxed)) return;
      absl::Status status = [&]() -> absl::Status {
        PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, store != nullptr
                                                        ? store->Read(files[i].path)
                                                        : ReadFileBytes(files[i].path));
        PSTRAIN_ASSIGN_OR_RETURN(DecodedImage image, DecodeImage(bytes, files[i].path));
        ResizeToChw(image, options.channels, options.height, options.width,
                    out->pixels.data() + static_cast<int64_t>(i) * sample_bytes);
        return absl::OkStatus();
      }();
      if (!status.ok()) {
        absl::MutexLock lock(&mu);
        if (i < error_index) {
          error_index = i;
          error = status;
        }
        // Files below i may still fail; let the threads finish those (they
        // are already claimed) but start no new ones.
        failed.store(true, std::memory_order_relaxed);
      }
    }
  };
  const int thread_count =
      static_cast<int>(std::min<size_t>(std::max(1, options.threads), files.size()));
  std::vector<std::thread> threads;
  for (int t = 1; t < thread_count; ++t) threads.emplace_back(work);
  work();
  for (std::thread& t : threads) t.join();
  absl::MutexLock lock(&mu);
  return error;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ListClassDirectories(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));
  }
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<fs::directory_entry> entries, ListDirectory(dir));
  std::vector<std::string> classes;
  for (const fs::directory_entry& entry : entries) {
    if (entry.is_directory(ec) && !IsHidden(entry.path())) {
      classes.push_back(entry.path().filename().string());
    }
  }
  if (classes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(dir, ": no class subdirectories"));
  }
  std::sort(classes.begin(), classes.end());
  return classes;
}

absl::StatusOr<ImageDataset> ReadImageFolderSplit(const std::string& split_dir,
                                                  const std::vector<std::string>& classes,
                                                  const ImageFolderOptions& options) {
  if (options.height <= 0 || options.width <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "image folder ", split_dir, ": image_height and image_width must be > 0, got ",
        options.height, "x", options.width));
  }
  if (options.channels != 1 && options.channels != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("image folder: channels must be 1 or 3, got ", options.channels));
  }
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<std::string> present, ListClassDirectories(split_dir));
  std::vector<ImageFile> files;
  for (const std::string& name : present) {
    auto it = std::find(classes.begin(), classes.end(), name);
    if (it == classes.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(JoinPath(split_dir, name), ": class '", name,
                       "' is not one of the training classes"));
    }
    const int32_t label = static_cast<int32_t>(it - classes.begin());
    PSTRAIN_ASSIGN_OR_RETURN(std::vector<fs::directory_entry> entries,
                             ListDirectory(JoinPath(split_dir, name)));
    std::vector<std::string> paths;
    std::error_code ec;
    for (const fs::directory_entry& entry : entries) {
      if (entry.is_regular_file(ec) && !IsHidden(entry.path()) && IsImageFile(entry.path())) {
        paths.push_back(entry.path().string());
      }
    }
    std::sort(paths.begin(), paths.end());
    for (std::string& path : paths) files.push_back({std::move(path), label});
  }
  if (files.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(split_dir, ": no .jpg/.jpeg/.png images"));
  }
  ImageDataset ds;
  ds.channels = options.channels;
  ds.height = options.height;
  ds.width = options.width;
  ds.num_classes = static_cast<int>(classes.size());
  ds.pixels.resize(files.size() * static_cast<size_t>(ds.sample_elements()));
  ds.labels.reserve(files.size());
  for (const ImageFile& file : files) ds.labels.push_back(file.label);
  PSTRAIN_RETURN_IF_ERROR(DecodeAll(files, options, &ds));
  return ds;
}

namespace {

// An image folder in an object store: one listing of every key below
// `root`, "<split>/<class>/<file>" kept for image files, classes from train.
absl::StatusOr<DatasetSplits> LoadImageFolderFromStore(const std::string& root,
                                                       const ImageFolderOptions& options,
                                                       storage::Storage& store) {
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<storage::ObjectInfo> objects, store.ListRecursive(root));
  std::map<std::string, std::map<std::string, std::vector<std::string>>> by_split;
  for (const storage::ObjectInfo& object : objects) {
    const std::vector<std::string> parts = absl::StrSplit(object.key, '/');
    if (parts.size() != 3 || (parts[0] != "train" && parts[0] != "test") ||
        IsHidden(parts[1]) || IsHidden(parts[2]) || !IsImageFile(parts[2])) {
      continue;
    }
    by_split[parts[0]][parts[1]].push_back(storage::JoinUri(root, object.key));
  }
  std::vector<std::string> classes;
  for (const auto& [name, files] : by_split["train"]) classes.push_back(name);
  if (classes.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(storage::JoinUri(root, "train"), ": no class prefixes with images"));
  }
  DatasetSplits splits;
  for (auto [split, out] : {std::pair{"train", &splits.train}, std::pair{"test", &splits.test}}) {
    std::vector<ImageFile> files;
    for (const auto& [name, paths] : by_split[split]) {
      auto it = std::find(classes.begin(), classes.end(), name);
      if (it == classes.end()) {
        return absl::InvalidArgumentError(absl::StrCat(storage::JoinUri(root, split), "/", name,
                                                       ": class '", name,
                                                       "' is not one of the training classes"));
      }
      for (const std::string& path : paths) {
        files.push_back({path, static_cast<int32_t>(it - classes.begin())});
      }
    }
    if (files.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(storage::JoinUri(root, split), ": no .jpg/.jpeg/.png images"));
    }
    out->channels = options.channels;
    out->height = options.height;
    out->width = options.width;
    out->num_classes = static_cast<int>(classes.size());
    out->pixels.resize(files.size() * static_cast<size_t>(out->sample_elements()));
    for (const ImageFile& file : files) out->labels.push_back(file.label);
    PSTRAIN_RETURN_IF_ERROR(DecodeAll(files, options, out, &store));
  }
  return splits;
}

}  // namespace

absl::StatusOr<DatasetSplits> LoadImageFolderDataset(const std::string& root,
                                                     const ImageFolderOptions& options,
                                                     storage::Storage* store) {
  if (storage::IsS3Uri(root)) {
    if (store == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(root, ": no object-store settings"));
    }
    if (options.height <= 0 || options.width <= 0 ||
        (options.channels != 1 && options.channels != 3)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "image folder: size must be positive and channels 1 or 3, got ", options.channels, "x",
          options.height, "x", options.width));
    }
    return LoadImageFolderFromStore(root, options, *store);
  }
  const std::string train_dir = JoinPath(root, "train");
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<std::string> classes, ListClassDirectories(train_dir));
  DatasetSplits splits;
  PSTRAIN_ASSIGN_OR_RETURN(splits.train, ReadImageFolderSplit(train_dir, classes, options));
  PSTRAIN_ASSIGN_OR_RETURN(splits.test,
                           ReadImageFolderSplit(JoinPath(root, "test"), classes, options));
  return splits;
}

}  // namespace pstrain::data
