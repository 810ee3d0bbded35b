// shardflow.torch's native half (`shardflow._C`): the libtorch adapter (shardflow/libtorch.hpp)
// for a Python nn.Module, one path with the C++ trainers. The Python half (shardflow/torch.py)
// holds the API; this file only converts and releases the GIL where shardflow waits on peers.
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardflow/launch.hpp"
#include "shardflow/libtorch.hpp"
#include "shardflow/shardflow.hpp"

namespace py = pybind11;
using namespace shardflow;

namespace {

// The process's communicator: `shardflow run`'s or torchrun's world, or a world of one.
struct World {
  std::shared_ptr<InProcessWorld> alone;
  std::shared_ptr<Communicator> comm;
};
World& world() {
  static World w;
  return w;
}

py::tuple init(double timeout_s, const std::string& backend) {
  if (world().comm) throw UsageError("shardflow.torch.init: called twice in one process");
  if (!(timeout_s > 0)) throw UsageError("shardflow.torch.init: timeout must be positive, got " + std::to_string(timeout_s));
  const auto timeout = std::chrono::milliseconds(std::int64_t(timeout_s * 1000));
  const LaunchEnv env = LaunchEnv::detect();
  if (env.launched()) {
    py::gil_scoped_release nogil;  // the rendezvous waits for the other ranks
    world().comm = init_process_group(env, ProcessGroupOptions{backend, timeout});
  } else {
    if (backend != "auto")
      throw UsageError("shardflow.torch.init: backend '" + backend + "' needs a launcher (shardflow run or torchrun); alone this is a world of 1");
    world().alone = InProcessWorld::create(1, timeout);
    world().comm = world().alone->communicator(0);
  }
  return py::make_tuple(world().comm->rank(), world().comm->world_size());
}

std::shared_ptr<Communicator> comm() {
  if (!world().comm) throw UsageError("shardflow.torch: call shardflow.torch.init() before DistributedDataParallel");
  return world().comm;
}

// ("adamw", {"lr": 1e-3, ...}) over OptimizerConfig's defaults (torch's for each kind); a key the
// kind does not take is refused, naming the ones it does.
OptimizerConfig optimizer_config(const std::string& kind, const py::dict& args) {
  static const std::map<std::string, std::vector<std::string>> takes{
      {"sgd", {"lr", "momentum", "weight_decay"}}, {"adam", {"lr", "betas", "eps", "weight_decay"}}, {"adamw", {"lr", "betas", "eps", "weight_decay"}}};
  const auto it = takes.find(kind);
  if (it == takes.end()) throw UsageError("shardflow.torch: optimizer '" + kind + "' is not one of sgd, adam, adamw");
  OptimizerConfig o;
  o.kind = OptimizerConfig::parse_kind(kind);
  for (const auto& [key, value] : args) {
    const auto k = py::cast<std::string>(key);
    if (std::find(it->second.begin(), it->second.end(), k) == it->second.end()) {
      std::string names;
      for (const auto& n : it->second) names += (names.empty() ? "" : ", ") + n;
      throw UsageError("shardflow.torch: optimizer '" + kind + "' takes " + names + ", not " + k);
    }
    if (k == "lr") o.lr = py::cast<float>(value);
    else if (k == "momentum") o.momentum = py::cast<float>(value);
    else if (k == "weight_decay") o.weight_decay = py::cast<float>(value);
    else if (k == "eps") o.eps = py::cast<float>(value);
    else std::tie(o.beta1, o.beta2) = py::cast<std::pair<float, float>>(value);
  }
  return o;
}

using Named = std::vector<std::pair<std::string, torch::Tensor>>;

std::unique_ptr<libtorch::DataParallel> make_ddp(const Named& params, const Named& buffers, int zero_stage, const std::string& overlap,
                                                 double bucket_cap_mb, double timeout_s, std::optional<OptimizerConfig> optimizer) {
  libtorch::Options o;
  if (zero_stage < 0 || zero_stage > 2) throw UsageError("shardflow.torch: zero_stage must be 0, 1 or 2, got " + std::to_string(zero_stage));
  o.config.zero.stage = ZeroStage(zero_stage);
  if (!overlap.empty()) o.config.zero.overlap = parse_overlap(overlap);  // empty: Config's default
  if (!(bucket_cap_mb > 0)) throw UsageError("shardflow.torch: bucket_cap_mb must be positive, got " + std::to_string(bucket_cap_mb));
  o.config.buckets.cap_bytes = std::size_t(bucket_cap_mb * 1048576.0);
  o.config.buckets.first_cap_bytes = std::min(o.config.buckets.first_cap_bytes, o.config.buckets.cap_bytes);
  o.config.timeouts.collective = std::chrono::milliseconds(std::int64_t(timeout_s * 1000));
  o.optimizer = std::move(optimizer);
  auto c = comm();
  py::gil_scoped_release nogil;  // the constructor broadcasts rank 0's values: a collective
  return std::make_unique<libtorch::DataParallel>(params, buffers, c, o);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "shardflow's native half; use shardflow.torch";
  // Errors keep shardflow's kinds: bad input is a ValueError, a peer past its timeout a TimeoutError.
  auto base = py::register_exception<Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<UsageError>(m, "UsageError", PyExc_ValueError);
  py::register_exception<TimeoutError>(m, "TimeoutError", PyExc_TimeoutError);
  py::register_exception<MismatchError>(m, "MismatchError", base.ptr());
  py::register_exception<CommError>(m, "CommError", base.ptr());

  m.def("init", &init, py::arg("timeout_s"), py::arg("backend"));
  m.def("optimizer_config", &optimizer_config, py::arg("kind"), py::arg("args"));
  py::class_<OptimizerConfig>(m, "OptimizerConfig");
  py::class_<libtorch::DataParallel>(m, "DataParallel")
      .def(py::init(&make_ddp))
      .def("zero_grad", &libtorch::DataParallel::zero_grad)
      .def("before_backward", &libtorch::DataParallel::before_backward)
      .def("after_backward", &libtorch::DataParallel::after_backward, py::call_guard<py::gil_scoped_release>())
      .def("wait_all_params", [](libtorch::DataParallel& d) { d.runtime().wait_all_params(); }, py::call_guard<py::gil_scoped_release>())
      .def("set_require_sync", [](libtorch::DataParallel& d, bool sync) { d.runtime().set_require_sync(sync); })
      .def("rank", [](libtorch::DataParallel& d) { return d.runtime().rank(); })
      .def("world_size", [](libtorch::DataParallel& d) { return d.runtime().world_size(); });
}
