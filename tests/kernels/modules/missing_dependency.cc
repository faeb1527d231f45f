// A library that tests/kernels/modules/fake_backend_module.cc (FAKE_NEEDS_DEP)
// links against but that the dynamic loader cannot find (its directory is on
// no search path), so that loading that module fails the way a missing
// libcudnn.so.9 does.
extern "C" __attribute__((visibility("default"))) int pstrain_test_missing_dependency() {
  return 0;
}
