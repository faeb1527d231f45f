# Shared helpers of tests/deploy/*.sh (sourced). find_tool NAME prints the
# tool's path, looking in PATH and in the build's PyPI venv
# (<build>/venv-tools/bin, filled by deploy/local/test.sh), or fails the test
# with the command that installs it.
fail() { echo "FAIL: $*" >&2; exit 1; }
find_tool() {  # find_tool NAME BUILD_DIR
  local venv="${2:-.}/venv-tools/bin/$1"
  if [[ -x "$venv" ]]; then echo "$venv"; return; fi
  if command -v "$1" >/dev/null; then command -v "$1"; return; fi
  if [[ -x "$HOME/.local/bin/$1" ]]; then echo "$HOME/.local/bin/$1"; return; fi
  fail "$1 is not installed: run deploy/local/test.sh (or PSTRAIN_TEST_TOOLS=1 deploy/local/install-deps.sh)"
}
