// The frame of the GPU test programs (plain mains, no doctest): without a GPU or without CUDA in
// the build they say why and exit 77, which ctest reports as skipped; with one they run the
// checks, print one line each and exit 1 if any failed.
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <string>

#include "kernels/cuda/device.hpp"

namespace shardflow::test {

struct GpuTally {
  int passes = 0, failures = 0;
};
inline GpuTally& gpu_tally() {
  static GpuTally t;
  return t;
}

inline void gpu_check(bool ok, const std::string& what) {
  std::printf("%-4s %s\n", ok ? "ok" : "FAIL", what.c_str());
  (ok ? gpu_tally().passes : gpu_tally().failures)++;
}

inline int gpu_main(const std::function<void()>& body) {
  if (!cuda::compiled_with_cuda() || cuda::device_count() == 0) {
    std::printf("SKIP: %s\n", cuda::describe().c_str());
    return 77;
  }
  std::printf("%s\n", cuda::describe().c_str());
  try {
    body();
  } catch (const std::exception& e) {
    gpu_check(false, std::string("threw: ") + e.what());
  }
  std::printf("%d passed, %d failed\n", gpu_tally().passes, gpu_tally().failures);
  return gpu_tally().failures ? 1 : 0;
}

}  // namespace shardflow::test
