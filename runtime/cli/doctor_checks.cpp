#include "runtime/cli/doctor_checks.hpp"

#include <dlfcn.h>
#include <ifaddrs.h>
#include <link.h>
#include <net/if.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "kernels/cpu/blas.hpp"
#include "kernels/cpu/host_memory.hpp"
#include "kernels/cpu/vector_isa.hpp"
#include "runtime/bootstrap/net_address.hpp"
#include "runtime/process/freed_memory.hpp"
#include "shardflow/shm.hpp"

namespace shardflow::cli {
namespace fs = std::filesystem;
namespace {

using Status = Check::Status;

std::string mib(std::size_t bytes) { return std::to_string((bytes + (1 << 20) - 1) >> 20) + " MiB"; }

// The real file behind each loaded library whose name contains one of `names` (its version is in
// the file name: libcaf_core.so.0.17.6, libopenblasp-r0.3.21.so).
std::string loaded_versions() {
  std::string out;
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) {
        static const char* names[] = {"libcaf_core", "libcaf_io", "libgloo", "libspdlog", "libopenblas", "libcudart", "libnccl", "libisal"};
        const std::string path = info->dlpi_name ? info->dlpi_name : "";
        for (const char* n : names)
          if (path.find(n) != std::string::npos) {
            std::error_code ec;
            const auto real = fs::canonical(path, ec);
            auto& s = *static_cast<std::string*>(data);
            s += (s.empty() ? "" : ", ") + (ec ? fs::path(path) : real).filename().string();
          }
        return 0;
      },
      &out);
  return out;
}

// libshardflow beside this program: the build tree's, or the installed one (PREFIX/bin/shardflow,
// PREFIX/<libdir>/libshardflow.so).
std::vector<std::string> library_candidates() {
  std::vector<std::string> c;
  std::error_code ec;
  const auto exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto prefix = exe.parent_path().parent_path();
    c.push_back((prefix / "libshardflow.so").string());  // build/bin/shardflow -> build/libshardflow.so
    for (const char* libdir : {"lib", "lib64", "lib/x86_64-linux-gnu"}) c.push_back((prefix / libdir / "libshardflow.so").string());
  }
  return c;
}

}  // namespace

const char* status_name(Status s) { return s == Status::ok ? "ok" : s == Status::warn ? "warn" : "FAIL"; }

Check check_cpu() {
  Check c{"cpu"};
  std::ifstream in("/proc/cpuinfo");
  std::string line, model;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  c.detail = (model.empty() ? std::string("unknown model") : model) + ", " + std::to_string(std::thread::hardware_concurrency()) +
             " cores; best OpenBLAS kernel for its features: " + kernels::blas::kernel().best_for_cpu;
  return c;
}

Check check_openblas() {
  Check c{"openblas"};
  if (!kernels::blas::load()) {
    c.status = Status::fail;
    c.detail = "no libopenblas.so.0 could be loaded";
    c.fix = "install Debian's libopenblas0-pthread (make deps)";
    return c;
  }
  const auto k = kernels::blas::kernel();
  c.detail = k.config + "; kernel " + k.name + ", chosen by " + k.chosen_by +
             (k.replaced.empty() ? "" : " (OpenBLAS picked " + k.replaced + ", its fallback for a CPU it does not know)") + "; " +
             std::to_string(k.threads) + " threads";
  if (k.name != k.best_for_cpu && kernels::blas::pre_avx(k.name)) {
    c.status = Status::warn;
    c.fix = "GEMMs run on a pre-AVX kernel, about 2x slower here: unset OPENBLAS_CORETYPE (shardflow then picks " + k.best_for_cpu +
            ") or set it to " + k.best_for_cpu;
  }
  return c;
}

// Note [Vector loops, the same bits]: which loops the optimizer steps run, and why.
Check check_vector_loops() {
  Check c{"vector loops"};
  const bool avx2 = kernels::cpu_has_avx2();
  const char* asked = std::getenv("SHARDFLOW_CPU_VECTORS");
  try {
    const auto isa = kernels::vector_isa_setting(asked, avx2);
    c.detail = std::string("the optimizer steps run ") + kernels::name(isa) + " loops (" +
               (asked ? "SHARDFLOW_CPU_VECTORS" : avx2 ? "the CPU has AVX2" : "the CPU has no AVX2") +
               "); every path gives the same bits";
    if (isa == kernels::VectorIsa::baseline && avx2) {
      c.status = Status::warn;
      c.fix = "the steps take about 1.7x as long on SSE2's loops: unset SHARDFLOW_CPU_VECTORS";
    }
  } catch (const std::exception& e) {
    c.status = Status::fail;
    c.detail = e.what();
    c.fix = "set SHARDFLOW_CPU_VECTORS to auto, baseline or avx2, or unset it";
  }
  return c;
}

Check check_blas_probe() {
  Check c{"blas reproducibility"};
  const auto p = kernels::blas::probe_in_child("/proc/self/exe", "__blas-probe", nullptr);
  c.detail = p.ran ? p.line() : "the probe did not run (no OpenBLAS, or its child process failed)";
  if (!p.ran || (p.repeatable && p.thread_invariant)) return c;
  // The same call giving other bits breaks everything bit for bit; other bits at another thread
  // count only runs that change it.
  c.status = p.repeatable ? Status::warn : Status::fail;
  const auto cut = c.detail.rfind("): ");
  c.fix = c.detail.substr(cut + 3);
  c.detail = c.detail.substr(0, cut + 1);
  return c;
}

std::vector<Check> check_library() {
  Check lib{"libshardflow"};
  void* h = nullptr;
  std::string tried, error;
  for (const auto& path : library_candidates()) {
    if (!fs::exists(path)) continue;
    tried = path;
    if ((h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL))) break;
    error = dlerror();
  }
  if (!h) {
    lib.status = Status::fail;
    lib.detail = tried.empty() ? "no libshardflow.so beside this program" : "'" + tried + "' does not load: " + error;
    lib.fix = "install the missing libraries (make deps, or the Debian packages named in scripts/install_deps.sh)";
    return {lib};
  }
  lib.detail = tried + " loads; " + loaded_versions();
  Check gpu{"gpus"};
  using Count = int (*)(int*);
  using Version = int (*)(int*);
  auto count = reinterpret_cast<Count>(dlsym(RTLD_DEFAULT, "cudaGetDeviceCount"));
  auto driver = reinterpret_cast<Version>(dlsym(RTLD_DEFAULT, "cudaDriverGetVersion"));
  auto nccl = reinterpret_cast<Version>(dlsym(RTLD_DEFAULT, "ncclGetVersion"));
  if (!count) {
    gpu.detail = "built without CUDA: CPU backends only";
  } else {
    int n = 0, drv = 0, nv = 0;
    const int err = count(&n);
    if (driver) driver(&drv);
    if (nccl) nccl(&nv);
    gpu.detail = err ? "no GPU usable (CUDA error " + std::to_string(err) + (err == 35 ? ": no driver" : "") + "): CPU backends only"
                     : std::to_string(n) + " GPU(s), driver " + std::to_string(drv / 1000) + "." + std::to_string(drv % 1000 / 10);
    if (nv) gpu.detail += "; NCCL " + std::to_string(nv / 10000) + "." + std::to_string(nv / 100 % 100) + "." + std::to_string(nv % 100);
  }
  return {lib, gpu};
}

Check check_python() {
  Check c{"python module"};
  std::vector<std::string> dirs;
#ifdef SHARDFLOW_BUILD_PYTHON_DIR
  dirs.push_back(SHARDFLOW_BUILD_PYTHON_DIR);
#endif
#ifdef SHARDFLOW_PYTHON_INSTALL_DIR
  std::error_code ec;
  if (const auto exe = fs::read_symlink("/proc/self/exe", ec); !ec)
    dirs.push_back((exe.parent_path().parent_path() / SHARDFLOW_PYTHON_INSTALL_DIR).string());
#endif
  std::string dir;
  for (const auto& d : dirs)
    if (fs::exists(fs::path(d) / "shardflow" / "torch.py")) dir = d;
  if (dir.empty()) {
    c.detail = "shardflow.torch not built here (needs libtorch-dev, pybind11-dev, python3-dev): C++ trainers only";
    return c;
  }
  // Imported in a child: torch's load is its own business, and a broken module must not take doctor down.
  const std::string cmd = "cd / && PYTHONPATH='" + dir + "' timeout 120 /usr/bin/python3 -c 'import torch, shardflow._C as c; " +
                          "print(torch.__version__, getattr(c, \"torch_version\", \"?\"))' 2>&1";
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    std::array<char, 512> buf{};
    while (std::fgets(buf.data(), int(buf.size()), p)) out += buf.data();
    const int status = ::pclose(p);
    while (!out.empty() && out.back() == '\n') out.pop_back();
    if (status != 0) {
      c.status = Status::fail;
      c.detail = "shardflow.torch in " + dir + " does not import: " + out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1);
      c.fix = "rebuild it against this python3's torch (make python) or install python3-torch";
      return c;
    }
  }
  const auto space = out.rfind(' ');
  const std::string running = out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1, space - (out.rfind('\n') + 1));
  const std::string built = out.substr(space + 1);
  c.detail = "shardflow.torch in " + dir + " imports under torch " + running + " (built for " + built + ")";
  if (built != "?" && running.rfind(built, 0) != 0) {
    c.status = Status::fail;
    c.fix = "the module was built for torch " + built + ": rebuild it (make python) against the torch python3 imports";
  }
  return c;
}

Check check_shm(const JobShape& job) {
  Check c{"/dev/shm"};
  struct statvfs vfs {};
  if (::statvfs("/dev/shm", &vfs) != 0) {
    c.status = Status::fail;
    c.detail = "no /dev/shm: the shared-memory backend and in-memory snapshots cannot run";
    c.fix = "mount a tmpfs there (mount -t tmpfs -o size=1G tmpfs /dev/shm; in Docker: --shm-size=1g), or use --backend gloo";
    return c;
  }
  const std::size_t room = std::size_t(vfs.f_bavail) * vfs.f_frsize;
  const int per_host = job.ranks_per_host > 0 ? job.ranks_per_host : int(std::max(1u, std::thread::hardware_concurrency()));
  // The shm backend: every rank's staging area in one segment, and the two levels' second segment.
  std::size_t need = per_host > 1 ? std::size_t(per_host) * (ShmOptions{}.staging_bytes + job.plan_shm_bytes) : 0;
  std::string what = per_host > 1 ? std::to_string(per_host) + " ranks' shared-memory staging (" + mib(need) + ")" : "nothing for one rank";
  if (job.snapshots && job.snapshot_bytes) {
    need += 2 * job.snapshot_bytes;  // the newest complete snapshot and the one being written (Note [Snapshots in memory])
    what += " + two in-memory snapshots of the model (" + mib(2 * job.snapshot_bytes) + ")";
  }
  c.detail = mib(room) + " free; the job needs " + mib(need) + ": " + what;
  if (room < need) {
    c.status = Status::fail;
    c.fix = "grow it to at least " + mib(need + (64u << 20)) + ": mount -o remount,size=" + std::to_string((need >> 30) + 1) +
            "G /dev/shm (Docker: --shm-size=" + std::to_string((need >> 30) + 1) + "g; Kubernetes: an emptyDir of medium Memory)";
  }
  return c;
}

Check check_open_files(const JobShape& job) {
  Check c{"open files"};
  rlimit rl{};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  const int world = job.world > 0 ? job.world : std::max(1, job.ranks_per_host > 0 ? job.ranks_per_host : int(std::thread::hardware_concurrency()));
  // A rank holds a socket pair per peer for each of Gloo's contexts (the ring, the two levels, the
  // store), plus its files: a generous bound, as a rank that runs out fails in the middle of a run.
  const rlim_t need = rlim_t(256 + 8 * world);
  c.detail = "soft limit " + (rl.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : std::to_string(rl.rlim_cur)) + ", hard " +
             (rl.rlim_max == RLIM_INFINITY ? std::string("unlimited") : std::to_string(rl.rlim_max)) + "; a rank of a world of " +
             std::to_string(world) + " may hold up to " + std::to_string(need);
  if (rl.rlim_cur < need) {
    c.status = Status::fail;
    c.fix = rl.rlim_max >= need ? "ulimit -n " + std::to_string(rl.rlim_max) + " before the job"
                                : "raise the hard limit (nofile in /etc/security/limits.conf, or LimitNOFILE= in the unit)";
  }
  return c;
}

Check check_locked_memory() {
  Check c{"locked memory"};
  rlimit rl{};
  ::getrlimit(RLIMIT_MEMLOCK, &rl);
  const bool unlimited = rl.rlim_cur == RLIM_INFINITY;
  c.detail = unlimited ? "unlimited" : mib(rl.rlim_cur);
  c.detail += ": pinned host buffers (CUDA staging, RDMA) need it; the CPU backends do not";
  auto count = reinterpret_cast<int (*)(int*)>(dlsym(RTLD_DEFAULT, "cudaGetDeviceCount"));
  int gpus = 0;
  if (count && count(&gpus) != 0) gpus = 0;
  if (!unlimited && rl.rlim_cur < (rlim_t(64) << 20) && gpus > 0) {
    c.status = Status::warn;
    c.fix = "ulimit -l unlimited (memlock in /etc/security/limits.conf) for GPU jobs";
  }
  return c;
}

// Milliseconds a MiB to write a fresh block of `bytes` for the first time, one byte a page.
double first_touch_ms_per_mib(std::byte* block, std::size_t bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  volatile std::byte* p = block;
  for (std::size_t i = 0; i < bytes; i += 4096) p[i] = std::byte{1};
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / double(bytes >> 20);
}

Check check_huge_pages() {
  Check c{"huge pages"};
  // The kernel's setting reads "always [madvise] never": the bracketed one is in force.
  std::string mode = "not built in";
  if (std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled"); in) {
    std::string all;
    std::getline(in, all);
    const auto open = all.find('['), close = all.find(']');
    if (open != std::string::npos && close > open) mode = all.substr(open + 1, close - open - 1);
  }
  bool wanted = true;
  try {
    wanted = huge_pages_setting(std::getenv("SHARDFLOW_HUGE_PAGES"));
  } catch (const std::exception& e) {
    c.status = Status::fail;
    c.detail = e.what();
    c.fix = "set SHARDFLOW_HUGE_PAGES to 1 or 0, or unset it";
    return c;
  }
  // What a first write costs here, 4 KiB pages against the runtime's own blocks (Note [Huge pages
  // for large blocks]): every bucket, shard and restored slot pays it once, a recovery's new
  // round on the training's path.
  constexpr std::size_t kBytes = std::size_t{32} << 20;
  char buf[160];
  void* m = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  const double small = m == MAP_FAILED ? 0.0 : first_touch_ms_per_mib(static_cast<std::byte*>(m), kBytes);
  if (m != MAP_FAILED) ::munmap(m, kBytes);
  const double ours = first_touch_ms_per_mib(alloc_zeroed(kBytes).get(), kBytes);
  std::snprintf(buf, sizeof buf, "; a first write costs %.3f ms a MiB on 4 KiB pages, %.3f on the runtime's large blocks", small, ours);
  c.detail = "transparent huge pages: " + mode + (wanted ? "" : " (SHARDFLOW_HUGE_PAGES=0: the runtime keeps 4 KiB pages)") + buf;
  // A recovery's new round writes its shards afresh; at 1 ms a MiB, 1 GiB of state is a second more.
  if ((mode == "never" || mode == "not built in" || !wanted) && small > 0.5) {
    c.status = Status::warn;
    c.fix = wanted ? "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (as root): the runtime advises its large blocks onto huge pages"
                   : "unset SHARDFLOW_HUGE_PAGES";
  }
  return c;
}

Check check_freed_memory() {
  Check c{"freed memory"};
  try {
    const auto choice = choose_freed_memory_from_env(true);
    c.detail = std::string(choice.keep ? "kept for reuse by a Runtime here: " : "left to malloc: ") + choice.why;
  } catch (const std::exception& e) {
    c.status = Status::fail;
    c.detail = e.what();
    c.fix = "set SHARDFLOW_KEEP_FREED_MEMORY to 1 or 0, or unset it";
  }
  return c;
}

Check check_network() {
  Check c{"network"};
  const auto ifaces = net::ipv4_interfaces();
  std::string list;
  for (const auto& i : ifaces) list += (list.empty() ? "" : ", ") + i;
  c.detail = "IPv4 interfaces Gloo could bind: " + (list.empty() ? std::string("none") : list);
  const auto choice = net::socket_choice_from_env();
  if (!choice.address.empty()) {
    if (!net::is_local_address(choice.address)) {
      c.status = Status::fail;
      c.detail += "; " + choice.origin + "=" + choice.address + " is not an address of this host";
      c.fix = "set " + choice.origin + " to one of this host's addresses, or unset it";
    } else {
      c.detail += "; " + choice.origin + " picks " + choice.address;
    }
  } else if (!choice.ifname.empty()) {
    try {
      c.detail += "; " + choice.origin + "=" + choice.ifname + " -> " + net::interface_address(choice.ifname, choice.origin);
    } catch (const std::exception& e) {
      c.status = Status::fail;
      c.detail += "; " + std::string(e.what());
      c.fix = "set " + choice.origin + " to an interface above (the one the other hosts reach), or unset it";
    }
  } else {
    c.detail += "; none named (GLOO_SOCKET_IFNAME): one host uses loopback, several the interface routing to the master";
  }
  return c;
}

}  // namespace shardflow::cli
