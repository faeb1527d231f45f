#include "common/build_info.h"

#include "pstrain_build_info.h"  // Generated: <build>/generated/pstrain_build_info.h.

namespace pstrain {

const char* BuildId() { return PSTRAIN_BUILD_ID; }
const char* Version() { return PSTRAIN_VERSION; }

}  // namespace pstrain
