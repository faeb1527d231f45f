# Finds every library and tool the build needs. A missing one stops configure
# with the Debian package that provides it, instead of CMake's "Could NOT
# find X" (deploy/local/install-deps.sh installs all of them).

# pstrain_find_package(NAME DEBIAN_PACKAGE [find_package arguments...])
macro(pstrain_find_package _name _debian_package)
  find_package(${_name} ${ARGN} QUIET)
  if(NOT ${_name}_FOUND)
    message(FATAL_ERROR
      "pstrain: ${_name} was not found: install Debian's ${_debian_package} "
      "(deploy/local/install-deps.sh installs everything the build needs)")
  endif()
endmacro()

# pstrain_find_program(VAR PROGRAM DEBIAN_PACKAGE)
function(pstrain_find_program _var _program _debian_package)
  find_program(${_var} ${_program})
  if(NOT ${_var})
    message(FATAL_ERROR
      "pstrain: the program ${_program} was not found: install Debian's ${_debian_package} "
      "(deploy/local/install-deps.sh installs everything the build needs)")
  endif()
endfunction()

pstrain_find_package(Threads "libc6-dev (build-essential)")
# The fuzzing build (PSTRAIN_FUZZ, clang) compiles proto/ and common/ only:
# no OpenMP (clang's would be libomp-dev) and no oneDNN.
if(NOT PSTRAIN_FUZZ)
  pstrain_find_package(OpenMP "libgomp1 (build-essential)")
endif()
pstrain_find_package(absl libabsl-dev CONFIG)
pstrain_find_program(PSTRAIN_PROTOC protoc protobuf-compiler)
pstrain_find_package(Protobuf libprotobuf-dev)
# gRPC's CMake package names grpc_cpp_plugin and fails on its own, less
# clearly, when the file is missing.
pstrain_find_program(PSTRAIN_GRPC_CPP_PLUGIN grpc_cpp_plugin protobuf-compiler-grpc)
pstrain_find_package(gRPC libgrpc++-dev CONFIG)
pstrain_find_package(OpenSSL libssl-dev)  # token digests and worker credentials (common/rpc/security)
# Debian's oneDNN package asks for OpenCL headers and the ICD loader, which
# libdnnl-dev only recommends.
if(NOT PSTRAIN_FUZZ)
  pstrain_find_package(OpenCL ocl-icd-opencl-dev)
  pstrain_find_package(dnnl libdnnl-dev CONFIG)
endif()
pstrain_find_package(ZLIB zlib1g-dev)
pstrain_find_package(PNG libpng-dev)
pstrain_find_package(JPEG libjpeg62-turbo-dev)
# The BSON product dump (DATASET_FORMAT_BSON, common/data/bson_dataset):
# libbson parses and iterates the documents.
pstrain_find_package(bson-1.0 libbson-dev CONFIG)
# s3:// datasets (common/storage/s3_client): libcurl's HTTP and its AWS
# SigV4 signing (CURLOPT_AWS_SIGV4, libcurl >= 7.75; Debian 12 has 7.88).
pstrain_find_package(CURL libcurl4-openssl-dev)
if(CURL_VERSION_STRING VERSION_LESS 7.75)
  message(FATAL_ERROR "pstrain: libcurl ${CURL_VERSION_STRING} lacks CURLOPT_AWS_SIGV4 (7.75 or newer)")
endif()
pstrain_find_package(prometheus-cpp prometheus-cpp-dev CONFIG)
# ONNX's protobuf schema (onnx/onnx_pb.h, target onnx_proto) for `pstrain
# export`, and its checker (target onnx) for the export's tests; the
# fuzzing build has no CLI.
if(NOT PSTRAIN_FUZZ)
  pstrain_find_package(ONNX libonnx-dev CONFIG)
endif()
if(PSTRAIN_BUILD_TESTS)
  pstrain_find_package(GTest "libgtest-dev and libgmock-dev")
endif()
