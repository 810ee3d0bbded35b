// Built instead of device_model.cu without CUDA: --device cuda then says why it cannot run.
#include "examples/mlp/device_model.hpp"
#include "shardflow/errors.hpp"

namespace shardflow::mlp {

struct DeviceModel::Impl {};
bool device_model_compiled() { return false; }
DeviceModel::DeviceModel(const Model&, int) {
  throw UsageError("--device cuda: this build has no CUDA (configure where nvcc and cuBLAS exist, SHARDFLOW_CUDA=ON)");
}
DeviceModel::~DeviceModel() = default;
void* DeviceModel::stream() const { return nullptr; }
float* DeviceModel::param(int, bool) const { return nullptr; }
void DeviceModel::forward(const float*, const float*, int, const std::function<void(int)>&) {}
float DeviceModel::loss() { return 0.0f; }
void DeviceModel::backward(double, const Model::GradSlot&, const Model::GradReady&) {}
void DeviceModel::step(const OptimizerConfig&, float*, const float*, std::size_t, std::size_t, std::int64_t) {}
void DeviceModel::download(Model&) const {}

}  // namespace shardflow::mlp
