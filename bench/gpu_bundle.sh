#!/usr/bin/env bash
# Packs what bench/gpu_session.sh needs on a lent GPU machine, which has CUDA,
# cuDNN and cuBLAS but none of our Debian libraries and no network, into
# .devcarry/bundle.tar.xz (under 64 MiB, the device tool's limit):
#   build/bin, the CUDA module, the test modules and the ctest files;
#   build/devlibs: every shared library they load that is neither glibc's,
#     the compiler's runtime nor CUDA's (from ldd);
#   devdata/fashion-mnist: the dataset;
#   devdata/certs: a CA, certificates and tokens (deploy/local/make-certs.sh)
#     for transport_bench's TLS variants (the device machine may lack openssl);
#   devdata/cluster-certs: the same for bench/cluster_emulation.sh's addresses;
#   build/devtools: iproute2's ip and tc and the libraries they load, for
#     cluster_emulation.sh on a machine whose image lacks them.
# Usage: bench/gpu_bundle.sh   (after cmake --build build), then carry .devcarry.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo '/.devcarry/' >>"$(git rev-parse --git-path info/exclude)"
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/build/devlibs" "$STAGE/build/lib" "$STAGE/build/tests" "$STAGE/devdata" \
  "$STAGE/build/devtools/bin" "$STAGE/build/devtools/lib" .devcarry
cp -a build/bin build/test_modules "$STAGE/build/"
cp -a build/lib/libpstrain_cuda.so "$STAGE/build/lib/"
cp build/CTestTestfile.cmake "$STAGE/build/"
cp build/tests/*.cmake "$STAGE/build/tests/"
strip --strip-unneeded "$STAGE"/build/bin/* "$STAGE"/build/lib/*.so 2>/dev/null || true
ldd build/bin/* build/lib/libpstrain_cuda.so build/test_modules/*.so 2>/dev/null |
  awk '/=> \//{print $3}' | sort -u |
  grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|libcublas|libcublasLt|libcudnn[a-z_]*|libcudart)\.so' |
  while read -r lib; do cp -L "$lib" "$STAGE/build/devlibs/"; done
cp -r /usr/share/datasets/fashion-mnist "$STAGE/devdata/"
deploy/local/make-certs.sh "$STAGE/devdata/certs" >/dev/null
names=()
for k in $(seq 10 20); do names+=(--name "10.77.0.$k"); done  # cluster_emulation.sh's servers.
deploy/local/make-certs.sh "$STAGE/devdata/cluster-certs" "${names[@]}" >/dev/null
for tool in ip tc; do
  cp -L "$(command -v "$tool")" "$STAGE/build/devtools/bin/"
  ldd "$(command -v "$tool")" | awk '/=> \//{print $3}' |
    grep -vE '/(libc|libm)\.so' | while read -r lib; do cp -L "$lib" "$STAGE/build/devtools/lib/"; done
done
tar -C "$STAGE" -cf - build devdata | xz -T2 -6 >.devcarry/bundle.tar.xz
ls -la .devcarry/bundle.tar.xz
