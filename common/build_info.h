// The identity of this build: the version, the git commit and the backend
// interface hash (see cmake/build_info.cmake). Every binary prints it for
// --version, and a runtime-loaded backend module is accepted only when its
// identity is the same string as its host's.
//
//   std::cout << BuildId() << "\n";  // pstrain 0.1.0 (git 7b0613b1c2d3, backend ABI 3f...)
#ifndef PSTRAIN_COMMON_BUILD_INFO_H_
#define PSTRAIN_COMMON_BUILD_INFO_H_

namespace pstrain {

// PSTRAIN_BUILD_ID of the sources this binary was built from.
const char* BuildId();
// The project version alone, e.g. "0.1.0".
const char* Version();

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_BUILD_INFO_H_
