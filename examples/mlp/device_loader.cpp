// --device cuda loads the GPU model from its own module (libshardflow_mlp_cuda.so) on first use.
// Linked into the example instead, cuBLAS and cuBLASLt were mapped by every mlp_train process, test
// and benchmark, GPU or not: about 150 MB of resident memory before the first step (a CPU run of
// a 256 MB model peaked at 606 MB; issue 15 asks for peak RSS near the model state).
#include <dlfcn.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <vector>

#include "examples/mlp/rank_model.hpp"

namespace shardflow::mlp {
namespace {

using Make = RankModel* (*)(const Model&, const TrainOptions&);

struct Loaded {
  Make make = nullptr;
  std::string why;  // when make is null
};

const Loaded& module() {
  static std::once_flag once;
  static Loaded m;
  std::call_once(once, [] {
#ifdef SHARDFLOW_MLP_CUDA_MODULE
    // Where the build put it; else beside the build's examples/ as seen from this executable (a
    // build tree copied elsewhere: tests/, bench/ and examples/ are siblings). Never closed: the
    // adapters it makes live in it.
    const std::string built = SHARDFLOW_MLP_CUDA_MODULE;
    std::vector<std::string> tried{built};
    std::error_code ec;
    const auto exe_dir = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path();
    const auto name = std::filesystem::path(built).filename();
    if (!ec)
      for (const auto& p : {exe_dir / name, exe_dir.parent_path() / "examples" / name})
        if (std::find(tried.begin(), tried.end(), p.string()) == tried.end()) tried.push_back(p.string());
    void* h = nullptr;
    std::string errors;
    for (const auto& path : tried) {
      if ((h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
      errors += std::string(errors.empty() ? "" : "; ") + ::dlerror();
    }
    if (!h) {
      m.why = "cannot load the example's GPU model (" + errors + ")";
      return;
    }
    m.make = reinterpret_cast<Make>(::dlsym(h, "shardflow_mlp_make_device_rank_model"));
    if (!m.make) m.why = std::string(SHARDFLOW_MLP_CUDA_MODULE) + " has no shardflow_mlp_make_device_rank_model";
#else
    m.why = "this build has no CUDA (configure where nvcc and cuBLAS exist, SHARDFLOW_CUDA=ON)";
#endif
  });
  return m;
}

}  // namespace

std::string device_model_unavailable() { return module().why; }

std::unique_ptr<RankModel> make_device_rank_model(const Model& model, const TrainOptions& opt) {
  const auto& m = module();
  if (!m.make) throw UsageError("--device cuda: " + m.why);
  return std::unique_ptr<RankModel>(m.make(model, opt));
}

}  // namespace shardflow::mlp
