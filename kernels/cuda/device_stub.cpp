// Built instead of device.cu when shardflow is configured without CUDA (SHARDFLOW_CUDA=OFF or no nvcc).
#include <stdexcept>

#include "kernels/cuda/device.hpp"

namespace shardflow::cuda {

bool compiled_with_cuda() { return false; }
int device_count() { return 0; }
std::string describe() { return "built without CUDA (SHARDFLOW_CUDA=OFF or no nvcc at configure time)"; }
void scale_f32_sync(float*, std::size_t, float) {
  throw std::runtime_error("shardflow was built without CUDA: rebuild with SHARDFLOW_CUDA=ON");
}

}  // namespace shardflow::cuda
