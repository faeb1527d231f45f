#!/usr/bin/env bash
# kernels/cpu/*_avx512.cc are built for x86-64-v4 and called only on CPUs
# with AVX-512, so they must define no symbol but their own entry points
# (names with "Avx512"). An inline function or a template they instantiate
# would be a weak copy compiled for AVX-512, and the linker may keep that
# copy for every caller in the binary, which then dies of SIGILL on a CPU
# without AVX-512. Each file is compiled at -O0, where nothing is inlined
# away, and its defined symbols are listed with nm.
# Usage: avx512_symbols_test.sh CXX SOURCE_DIR
set -euo pipefail
cxx=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
shopt -s nullglob
files=("$src"/kernels/cpu/*_avx512.cc)
((${#files[@]})) || { echo "no kernels/cpu/*_avx512.cc under $src"; exit 1; }
status=0
for file in "${files[@]}"; do
  "$cxx" -O0 -std=c++20 -march=x86-64-v4 -I"$src" -c "$file" -o "$tmp/object.o"
  # Weak (W, V), unique (u) and global text or data (T, D, B, R) symbols;
  # local ones (t, d, b, r) cannot be picked for another file. The one
  # exception is DW.ref.__gxx_personality_v0, which any C++ object with
  # unwind information may define: a pointer to libstdc++'s personality
  # routine, the same in every object, with no code of its own.
  bad=$(nm -C --defined-only "$tmp/object.o" |
    awk '$3 != "DW.ref.__gxx_personality_v0" &&
         ($2 ~ /^[WwVvu]$/ || ($2 ~ /^[TDBR]$/ && $0 !~ /Avx512/))')
  if [[ -n $bad ]]; then
    echo "FAIL ${file#"$src"/} defines, compiled for x86-64-v4:"
    echo "$bad"
    status=1
  else
    echo "ok ${file#"$src"/}: $(nm -C --defined-only "$tmp/object.o" | grep -c ' T ') entry points"
  fi
done
exit $status
