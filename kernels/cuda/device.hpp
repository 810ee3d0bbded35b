// What the process can see of CUDA, without ever requiring a GPU or a driver to start.
#pragma once

#include <cstddef>
#include <string>

namespace shardflow::cuda {

bool compiled_with_cuda();
// Number of usable devices; 0 without a driver or GPU (never throws, never aborts).
int device_count();
std::string describe();  // "CUDA 13.0 runtime, 1 device(s): NVIDIA H100 ..." or why there is none

// Scale a device buffer of fp32 in place on the default stream and wait (for tests and set-up).
// Throws std::runtime_error when CUDA is unavailable.
void scale_f32_sync(float* device_ptr, std::size_t n, float s);

}  // namespace shardflow::cuda
