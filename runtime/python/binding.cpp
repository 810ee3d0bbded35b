// shardflow.torch's native half (`shardflow._C`): the libtorch adapter (shardflow/libtorch.hpp)
// for a Python nn.Module, one path with the C++ trainers. The Python half (shardflow/torch.py)
// holds the API; this file only converts and releases the GIL where shardflow waits on peers.
#include <torch/extension.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardflow/launch.hpp"
#include "shardflow/libtorch.hpp"
#include "shardflow/safetensors.hpp"
#include "shardflow/shardflow.hpp"

namespace py = pybind11;
using namespace shardflow;

namespace {

// The process's communicator: `shardflow run`'s or torchrun's world, or a world of one (on the
// GPU of a CUDA module: Note [CUDA modules] in shardflow/libtorch.hpp).
struct World {
  std::shared_ptr<InProcessWorld> alone;
  std::shared_ptr<Communicator> comm;
  std::chrono::milliseconds timeout{0};
  std::string backend;  // what the launched group was made with: recover() rejoins alike
};
World& world() {
  static World w;
  return w;
}

// `device`: the CUDA device of the module init() is called for (DDP's lazy init), or -1. Under a
// launcher a CUDA module's "auto" is NCCL (one GPU per process, as torchrun's users expect).
py::tuple init(double timeout_s, const std::string& backend, int device) {
  if (world().comm) throw UsageError("shardflow.torch.init: called twice in one process");
  if (!(timeout_s > 0)) throw UsageError("shardflow.torch.init: timeout must be positive, got " + std::to_string(timeout_s));
  const auto timeout = std::chrono::milliseconds(std::int64_t(timeout_s * 1000));
  world().timeout = timeout;
  const LaunchEnv env = LaunchEnv::detect();
  if (env.launched()) {
    py::gil_scoped_release nogil;  // the rendezvous waits for the other ranks
    world().backend = backend == "auto" && device >= 0 ? "nccl" : backend;
    world().comm = init_process_group(env, ProcessGroupOptions{world().backend, timeout});
  } else {
    if (backend != "auto")
      throw UsageError("shardflow.torch.init: backend '" + backend + "' needs a launcher (shardflow run or torchrun); alone this is a world of 1");
    world().alone = device >= 0 ? InProcessWorld::create_on_device(1, device, timeout) : InProcessWorld::create(1, timeout);
    world().comm = world().alone->communicator(0);
  }
  return py::make_tuple(world().comm->rank(), world().comm->world_size());
}

// The communicator for a module on `d`. A world of one made before the module was seen moves to
// its GPU; a launched world whose backend reduces host memory only is refused, naming the fix.
std::shared_ptr<Communicator> comm_for(Device d) {
  if (!world().comm) throw UsageError("shardflow.torch: call shardflow.torch.init() before DistributedDataParallel");
  if (world().comm->supports(d)) return world().comm;
  if (world().alone && d.kind == Device::Kind::cuda) {
    world().alone = InProcessWorld::create_on_device(1, d.index, world().timeout);
    world().comm = world().alone->communicator(0);
    return world().comm;
  }
  throw UsageError("shardflow.torch: the module is on " + d.str() + " and this process group's backend '" + world().comm->backend_name() +
                   "' reduces " + (d.kind == Device::Kind::cuda ? "host memory only: call shardflow.torch.init(backend=\"nccl\") (or leave init() to "
                                                                   "DistributedDataParallel, which picks NCCL for a CUDA module)"
                                                                 : "device memory only: call shardflow.torch.init() with a host backend") +
                   " before constructing the model");
}

// The kinds Python names and the keys each takes (OptimizerConfig's defaults are torch's for each).
struct KindKeys {
  const char* name;
  OptimizerConfig::Kind kind;
  std::vector<std::string> keys;
};
const std::vector<KindKeys>& kinds() {
  static const std::vector<KindKeys> all{{"sgd", OptimizerConfig::Kind::sgd, {"lr", "momentum", "weight_decay"}},
                                         {"adam", OptimizerConfig::Kind::adam, {"lr", "betas", "eps", "weight_decay"}},
                                         {"adamw", OptimizerConfig::Kind::adamw, {"lr", "betas", "eps", "weight_decay"}}};
  return all;
}

// Keys of ("adamw", {"lr": 1e-3, ...}) onto `o`, whose kind is `k`; a key the kind does not take is
// refused, naming the ones it does and `where` it came from.
void apply_hyperparameters(OptimizerConfig& o, const KindKeys& k, const py::dict& args, const std::string& where) {
  for (const auto& [key, value] : args) {
    const auto name = py::cast<std::string>(key);
    if (std::find(k.keys.begin(), k.keys.end(), name) == k.keys.end()) {
      std::string names;
      for (const auto& n : k.keys) names += (names.empty() ? "" : ", ") + n;
      throw UsageError("shardflow.torch: " + where + "optimizer '" + k.name + "' takes " + names + ", not " + name);
    }
    try {
      if (name == "lr") o.lr = py::cast<float>(value);
      else if (name == "momentum") o.momentum = py::cast<float>(value);
      else if (name == "weight_decay") o.weight_decay = py::cast<float>(value);
      else if (name == "eps") o.eps = py::cast<float>(value);
      else std::tie(o.beta1, o.beta2) = py::cast<std::pair<float, float>>(value);
    } catch (const py::cast_error&) {
      throw UsageError("shardflow.torch: " + where + "'" + name + "' must be " + (name == "betas" ? "a pair of numbers" : "a number") +
                       ", got " + py::str(value).cast<std::string>());
    }
  }
}

OptimizerConfig optimizer_config(const std::string& kind, const py::dict& args) {
  const auto it = std::find_if(kinds().begin(), kinds().end(), [&](const KindKeys& k) { return kind == k.name; });
  if (it == kinds().end()) throw UsageError("shardflow.torch: optimizer '" + kind + "' is not one of sgd, adam, adamw");
  OptimizerConfig o;
  o.kind = it->kind;
  apply_hyperparameters(o, *it, args, "");
  return o;
}

// Between steps (a schedule): a group's hyper-parameters by the same keys as the constructor's.
void set_hyperparameters(libtorch::DataParallel& d, std::size_t group, const py::dict& args) {
  OptimizerConfig h = d.runtime().hyperparameters(group);
  const auto it = std::find_if(kinds().begin(), kinds().end(), [&](const KindKeys& k) { return h.kind == k.kind; });
  if (it == kinds().end()) throw UsageError("shardflow.torch: param group " + std::to_string(group) + " steps a rule of its own, not sgd, adam or adamw");
  apply_hyperparameters(h, *it, args, "param group " + std::to_string(group) + ": ");
  d.runtime().set_hyperparameters(group, h);
}

// A group: its hyper-parameters and its parameters by name (none: every parameter no other group names).
using Group = std::pair<OptimizerConfig, std::vector<std::string>>;
using Named = std::vector<std::pair<std::string, torch::Tensor>>;

std::unique_ptr<libtorch::DataParallel> make_ddp(const Named& params, const Named& buffers, int zero_stage, const std::string& overlap,
                                                 bool forward_prefetch, bool uneven_inputs, bool find_unused_parameters, bool static_graph,
                                                 bool broadcast_buffers, double bucket_cap_mb, double timeout_s, const std::string& trace,
                                                 const std::vector<Group>& groups, double clip_grad_norm, double clip_norm_type,
                                                 std::uintptr_t cuda_stream, const std::string& snapshot_dir, int snapshot_every,
                                                 int redundancy, int twin_distance) {
  libtorch::Options o;
  o.cuda_stream = reinterpret_cast<void*>(cuda_stream);
  if (zero_stage < 0 || zero_stage > 2) throw UsageError("shardflow.torch: zero_stage must be 0, 1 or 2, got " + std::to_string(zero_stage));
  o.config.zero.stage = ZeroStage(zero_stage);
  if (!overlap.empty()) o.config.zero.overlap = parse_overlap(overlap);  // empty: Config's default
  o.config.zero.forward_prefetch = forward_prefetch;
  o.config.join.uneven_inputs = uneven_inputs;
  o.config.buckets.find_unused_parameters = find_unused_parameters;
  o.config.buckets.static_graph = static_graph;
  o.config.sync.buffers = broadcast_buffers;
  // 0 is bucket_cap_mb=None: the default cap, shrunk for a small model (BucketConfig::min_buckets).
  if (!(bucket_cap_mb >= 0) || !std::isfinite(bucket_cap_mb))
    throw UsageError("shardflow.torch: bucket_cap_mb must be positive, got " + std::to_string(bucket_cap_mb));
  if (bucket_cap_mb > 0) {
    o.config.buckets.cap_bytes = std::max<std::size_t>(1, std::size_t(bucket_cap_mb * 1048576.0));
    o.config.buckets.first_cap_bytes = std::min(o.config.buckets.first_cap_bytes, o.config.buckets.cap_bytes);
    o.config.buckets.last_cap_bytes = std::min(o.config.buckets.last_cap_bytes, o.config.buckets.cap_bytes);
  }
  o.config.timeouts.collective = std::chrono::milliseconds(std::int64_t(timeout_s * 1000));
  o.config.trace.path = trace;
  o.config.zero.clip_grad_norm = float(clip_grad_norm);  // 0: off (Note [Clipping that cannot be lost], torch.py)
  o.config.zero.clip_norm_type = float(clip_norm_type);
  o.config.snapshot.dir = snapshot_dir;  // empty: none
  o.config.snapshot.every = snapshot_dir.empty() ? 0 : snapshot_every;
  // The wrapper hands each snapshot the state of what snapshot_with() names (an LR scheduler) at
  // the next forward (Note [The trainer's state in a snapshot]).
  o.config.snapshot.trainer_state = !snapshot_dir.empty();
  // Note [Mirrored shards]; with the twins the wrapper's state is kept at every step too (Note
  // [The trainer's state with the twins]).
  o.config.zero.redundancy = redundancy;
  o.config.zero.twin_distance = twin_distance;
  o.config.setting_names = {{"zero.stage", "zero_stage"},   {"zero.overlap", "overlap"},         {"zero.forward_prefetch", "forward_prefetch"},
                            {"join.uneven_inputs", "uneven_inputs"}, {"buckets.cap_bytes", "bucket_cap_mb"}, {"timeouts.collective", "init(timeout=)"},
                            {"trace.path", "trace"}, {"buckets.find_unused_parameters", "find_unused_parameters"},
                            {"buckets.static_graph", "static_graph"}, {"sync.buffers", "broadcast_buffers"},
                            {"zero.clip_grad_norm", "clip_grad_norm"}, {"zero.clip_norm_type", "clip_norm_type"},
                            {"snapshot.dir", "snapshot_dir"}, {"snapshot.every", "snapshot_every"},
                            {"zero.redundancy", "redundancy"}, {"zero.twin_distance", "twin_distance"}};
  Device device = Device::cpu();
  if (!params.empty() && params.front().second.is_cuda()) device = Device::cuda(params.front().second.device().index());
  auto c = comm_for(device);
  std::unique_ptr<libtorch::DataParallel> d;
  {
    py::gil_scoped_release nogil;  // the constructor broadcasts rank 0's values: a collective
    d = std::make_unique<libtorch::DataParallel>(params, buffers, c, o);
  }
  if (!groups.empty()) {
    std::vector<ParamGroup> pg;
    for (const auto& [config, names] : groups) {
      ParamGroup g{{}, config};
      for (const auto& n : names) g.params.push_back(d->runtime().param(n));
      pg.push_back(std::move(g));
    }
    d->runtime().configure_optimizer(pg);
  }
  return d;
}

// StateDict tensors as torch tensors and back (copies: the dict outlives the runtime's buffers).
c10::ScalarType scalar_type(const std::string& dtype, const std::string& name) {
  static const std::map<std::string, c10::ScalarType> types{{"F32", torch::kFloat}, {"F16", torch::kHalf}, {"BF16", torch::kBFloat16},
                                                            {"F64", torch::kDouble}, {"I64", torch::kLong}, {"I32", torch::kInt},
                                                            {"U8", torch::kByte}};
  const auto it = types.find(dtype);
  if (it == types.end()) throw UsageError("shardflow.torch: tensor '" + name + "' has dtype " + dtype + ", which has no torch type here");
  return it->second;
}

std::string dtype_name(c10::ScalarType t, const std::string& name) {
  switch (t) {
    case torch::kFloat: return "F32";
    case torch::kHalf: return "F16";
    case torch::kBFloat16: return "BF16";
    case torch::kDouble: return "F64";
    case torch::kLong: return "I64";
    case torch::kInt: return "I32";
    case torch::kByte: return "U8";
    default: throw UsageError("shardflow.torch: load_state_dict: tensor '" + name + "' is " + std::string(c10::toString(t)) + ", not a checkpoint dtype");
  }
}

py::tuple to_python(StateDict&& sd) {
  py::dict tensors;
  for (auto& [name, t] : sd.tensors) {
    torch::Tensor out = torch::empty(std::vector<std::int64_t>(t.shape.begin(), t.shape.end()), torch::TensorOptions().dtype(scalar_type(t.dtype, name)));
    if (std::size_t(out.nbytes()) != t.data.size()) throw Error("shardflow.torch: state tensor '" + name + "' holds " + std::to_string(t.data.size()) + " bytes for its shape");
    std::memcpy(out.data_ptr(), t.data.data(), t.data.size());
    tensors[py::str(name)] = out;
  }
  py::dict meta;
  for (auto& [k, v] : sd.metadata) meta[py::str(k)] = v;
  return py::make_tuple(tensors, meta);
}

StateDict from_python(const std::map<std::string, torch::Tensor>& tensors, const std::map<std::string, std::string>& metadata) {
  StateDict sd;
  sd.metadata = metadata;
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) throw UsageError("shardflow.torch: load_state_dict: tensor '" + name + "' is undefined");
    const torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
    Tensor& out = sd.tensors[name];
    out.dtype = dtype_name(c.scalar_type(), name);
    out.shape = Shape(c.sizes().begin(), c.sizes().end());
    out.data.resize(std::size_t(c.nbytes()));
    std::memcpy(out.data.data(), c.data_ptr(), out.data.size());
  }
  return sd;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "shardflow's native half; use shardflow.torch";
  m.attr("torch_version") = TORCH_VERSION;  // the torch this was built against (shardflow doctor compares)
  // Errors keep shardflow's kinds: bad input is a ValueError, a peer past its timeout a TimeoutError.
  auto base = py::register_exception<Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<UsageError>(m, "UsageError", PyExc_ValueError);
  py::register_exception<TimeoutError>(m, "TimeoutError", PyExc_TimeoutError);
  py::register_exception<MismatchError>(m, "MismatchError", base.ptr());
  py::register_exception<CommError>(m, "CommError", base.ptr());

  m.def("init", &init, py::arg("timeout_s"), py::arg("backend"), py::arg("device") = -1);
  m.def("initialized", [] { return bool(world().comm); });
  m.def("optimizer_config", &optimizer_config, py::arg("kind"), py::arg("args"));
  py::class_<OptimizerConfig>(m, "OptimizerConfig");
  py::class_<libtorch::DataParallel>(m, "DataParallel")
      .def(py::init(&make_ddp))
      .def("zero_grad", &libtorch::DataParallel::zero_grad)
      .def("set_stream", [](libtorch::DataParallel& d, std::uintptr_t s) { d.set_stream(reinterpret_cast<void*>(s)); })
      .def("before_backward", &libtorch::DataParallel::before_backward, py::call_guard<py::gil_scoped_release>())
      .def("after_backward", &libtorch::DataParallel::after_backward, py::call_guard<py::gil_scoped_release>())
      .def("grads_this_pass", &libtorch::DataParallel::grads_this_pass)
      .def("wait_for", py::overload_cast<const std::vector<torch::Tensor>&, const std::string&>(&libtorch::DataParallel::wait_for),
           py::call_guard<py::gil_scoped_release>())
      .def("wait_all_params", [](libtorch::DataParallel& d) { d.runtime().wait_all_params(); }, py::call_guard<py::gil_scoped_release>())
      .def("set_require_sync", [](libtorch::DataParallel& d, bool sync) { d.runtime().set_require_sync(sync); })
      .def("join", [](libtorch::DataParallel& d) { d.runtime().join(); }, py::call_guard<py::gil_scoped_release>())
      .def("training_ranks", [](libtorch::DataParallel& d) { return d.runtime().training_ranks(); })
      .def("set_hyperparameters", &set_hyperparameters)
      .def("hyperparameters", [](libtorch::DataParallel& d, std::size_t group) {
        const OptimizerConfig h = d.runtime().hyperparameters(group);
        return py::dict(py::arg("lr") = h.lr, py::arg("betas") = py::make_tuple(h.beta1, h.beta2), py::arg("eps") = h.eps,
                        py::arg("weight_decay") = h.weight_decay, py::arg("momentum") = h.momentum);
      })
      .def("state_dict", [](libtorch::DataParallel& d, int to) {
        StateDict sd;
        {
          py::gil_scoped_release nogil;  // streams every rank's shard to `to`: a collective
          sd = d.runtime().state_dict(to);
        }
        return to_python(std::move(sd));
      })
      .def("shard_state_dict", [](libtorch::DataParallel& d) {
        StateDict sd;
        {
          py::gil_scoped_release nogil;  // no collective, but it may wait for the last updates to land
          sd = d.runtime().shard_state_dict();
        }
        return to_python(std::move(sd));
      })
      .def("load_state_dict",
           [](libtorch::DataParallel& d, const std::map<std::string, torch::Tensor>& tensors, const std::map<std::string, std::string>& meta) {
             StateDict sd = from_python(tensors, meta);
             py::gil_scoped_release nogil;
             d.runtime().load_state_dict(sd);
           })
      .def("save_checkpoint", [](libtorch::DataParallel& d, const std::string& path, int to,
                                 std::uint64_t max_file_bytes) { d.runtime().save_checkpoint(path, to, max_file_bytes); },
           py::call_guard<py::gil_scoped_release>())
      .def("save_sharded_checkpoint", [](libtorch::DataParallel& d, const std::string& dir, bool background) {
             if (background) d.runtime().save_sharded_checkpoint_async(dir);
             else d.runtime().save_sharded_checkpoint(dir);
           }, py::call_guard<py::gil_scoped_release>())
      .def("wait_checkpoint", [](libtorch::DataParallel& d) { d.runtime().wait_checkpoint(); }, py::call_guard<py::gil_scoped_release>())
      .def("load_checkpoint", [](libtorch::DataParallel& d, const std::string& path) { d.runtime().load_checkpoint(path); },
           py::call_guard<py::gil_scoped_release>())
      .def("resumed_step", [](libtorch::DataParallel& d) { return d.runtime().resumed_step(); }, py::call_guard<py::gil_scoped_release>())
      // Note [Recovering in place]: the job's next round (the launcher's word), then the runtime
      // rebuilt on it and the newest complete snapshot loaded; the world's communicator follows.
      .def("recover", [](libtorch::DataParallel& d) {
             if (!world().alone && world().backend.empty()) throw UsageError("shardflow.torch: recover(): no process group was made");
             if (world().alone)
               throw UsageError("shardflow.torch: recover() goes on after a lost peer of a launched job (shardflow run --max-restarts N "
                                "--recovery in-place); this process is a world of 1 of its own");
             std::shared_ptr<Communicator> next;
             {
               py::gil_scoped_release nogil;  // waits for the launcher's word and the round's rendezvous
               next = rejoin_process_group(LaunchEnv::detect(), ProcessGroupOptions{world().backend, world().timeout});
             }
             world().comm = next;
             py::gil_scoped_release nogil;  // the set-up's collectives and the snapshot's load
             return d.recover(next);
           })
      .def("trainer_state_wanted", [](libtorch::DataParallel& d) { return d.runtime().trainer_state_wanted(); })
      .def("set_trainer_state", [](libtorch::DataParallel& d, std::uint64_t step, const py::bytes& state) {
        d.runtime().set_trainer_state(step, std::string(state));
      })
      .def("trainer_state", [](libtorch::DataParallel& d) -> py::object {
        const auto s = d.runtime().trainer_state();
        if (!s) return py::none();
        return py::bytes(*s);
      })
      // Both may wait for the last step under forward prefetch (Note [What the last step left, under prefetch]).
      .def("optimizer_steps", [](libtorch::DataParallel& d) { return d.runtime().optimizer_steps(); }, py::call_guard<py::gil_scoped_release>())
      .def("last_grad_norm", [](libtorch::DataParallel& d) { return d.runtime().last_grad_norm(); }, py::call_guard<py::gil_scoped_release>())
      .def("stats_json", [](libtorch::DataParallel& d) { return d.runtime().stats().to_json(); })
      .def("memory_report", [](libtorch::DataParallel& d) { return d.runtime().memory_report().str(); })
      .def("rank", [](libtorch::DataParallel& d) { return d.runtime().rank(); })
      .def("world_size", [](libtorch::DataParallel& d) { return d.runtime().world_size(); });
}
