// Reader for image-folder datasets: <root>/train/<class>/*.{jpg,jpeg,png}
// and <root>/test/<class>/..., decoded with libjpeg-turbo / libpng on several
// threads and resized (nearest) to one size.
//
//   data::ImageFolderOptions options;
//   options.height = options.width = 64;
//   options.threads = 4;
//   PSTRAIN_ASSIGN_OR_RETURN(data::DatasetSplits splits,
//                            data::LoadImageFolderDataset("/data/flowers", options));
//
// Free functions; each call owns its threads and joins them before returning.
#ifndef PSTRAIN_COMMON_DATA_IMAGE_FOLDER_READER_H_
#define PSTRAIN_COMMON_DATA_IMAGE_FOLDER_READER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/data/image_dataset.h"

namespace pstrain::storage {
class Storage;
}  // namespace pstrain::storage

namespace pstrain::data {

struct ImageFolderOptions {
  int height = 0, width = 0;  // Output size; both > 0.
  int channels = 3;           // 1 (gray) or 3 (RGB).
  int threads = 1;            // Decoder threads; values < 1 mean 1.
};

// The sorted names of the subdirectories of `dir` (hidden ones skipped).
// NOT_FOUND when `dir` is not a directory; INVALID_ARGUMENT when it has none.
absl::StatusOr<std::vector<std::string>> ListClassDirectories(const std::string& dir);

// Decodes every *.jpg / *.jpeg / *.png (extension case-insensitive; other
// files are skipped) under `split_dir`/<class>/, in sorted class-directory
// order, then sorted file-name order. Class index = position in `classes`; a subdirectory whose
// name is not in `classes` is INVALID_ARGUMENT, a class without a
// subdirectory simply has no samples. A file that fails to decode is
// INVALID_ARGUMENT naming it (the first such file in that order, whatever the
// thread count). An empty split is INVALID_ARGUMENT.
absl::StatusOr<ImageDataset> ReadImageFolderSplit(const std::string& split_dir,
                                                  const std::vector<std::string>& classes,
                                                  const ImageFolderOptions& options);

// Classes from the subdirectories of <root>/train; then both splits. `root`
// may be s3://bucket/prefix, read through `store`: one listing of the keys
// <prefix>/{train,test}/<class>/<file>, then the images read on the
// decoder threads.
absl::StatusOr<DatasetSplits> LoadImageFolderDataset(const std::string& root,
                                                     const ImageFolderOptions& options,
                                                     storage::Storage* store = nullptr);

}  // namespace pstrain::data

#endif  // PSTRAIN_COMMON_DATA_IMAGE_FOLDER_READER_H_
