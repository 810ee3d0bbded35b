#include "kernels/cpu/blas.hpp"

#include <cpuid.h>
#include <dlfcn.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <strings.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <vector>

namespace shardflow::kernels::blas {
namespace {

// OpenBLAS is reached through dlsym rather than linked symbols: the launcher does not link it
// (Note [Launcher supervision]) and a BLAS other than OpenBLAS has none of these functions.
struct Api {
  void* lib = nullptr;
  char* (*corename)() = nullptr;
  char* (*config)() = nullptr;
  int (*get_threads)() = nullptr;
  void (*set_threads)(int) = nullptr;
  void (*dynamic_init)() = nullptr;
  void (*dynamic_quit)() = nullptr;
  int (*thread_shutdown)() = nullptr;  // the pthread build's: joins its worker threads
  void (*sgemm)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int) = nullptr;
};

constexpr const char* kSonames[] = {"libopenblas.so.0", "libopenblas.so"};

Api resolve(void* lib) {
  Api a;
  a.lib = lib;
  auto sym = [lib](const char* n) { return dlsym(lib, n); };
  a.corename = reinterpret_cast<char* (*)()>(sym("openblas_get_corename"));
  a.config = reinterpret_cast<char* (*)()>(sym("openblas_get_config"));
  a.get_threads = reinterpret_cast<int (*)()>(sym("openblas_get_num_threads"));
  a.set_threads = reinterpret_cast<void (*)(int)>(sym("openblas_set_num_threads"));
  a.dynamic_init = reinterpret_cast<void (*)()>(sym("gotoblas_dynamic_init"));
  a.dynamic_quit = reinterpret_cast<void (*)()>(sym("gotoblas_dynamic_quit"));
  a.thread_shutdown = reinterpret_cast<int (*)()>(sym("blas_thread_shutdown_"));
  a.sgemm = reinterpret_cast<decltype(a.sgemm)>(sym("cblas_sgemm"));
  if (!a.corename || !a.config || !a.get_threads || !a.set_threads || !a.sgemm) return Api{};
  return a;
}

// The OpenBLAS already in the process, if any (RTLD_NOLOAD: never loads it).
Api loaded() {
  for (const char* so : kSonames)
    if (void* lib = dlopen(so, RTLD_NOW | RTLD_NOLOAD)) return resolve(lib);
  return Api{};
}

bool has_bf16() {  // CPUID.(EAX=7, ECX=1):EAX bit 5, AVX512_BF16
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return (a >> 5) & 1u;
}

std::string best_for_cpu() {
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the registers (XGETBV).
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512 && has_bf16()) return "Cooperlake";
  if (avx512) return "SkylakeX";
  // AMD's AVX2 CPUs have a set of their own in OpenBLAS (Zen: Haswell's kernels with block sizes
  // for Zen's caches), which OpenBLAS picks itself on the EPYC VMs seen here (family 23).
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return __builtin_cpu_is("amd") ? "Zen" : "Haswell";
  if (__builtin_cpu_supports("avx")) return "Sandybridge";
  return "Prescott";
}

constexpr const char* kReplacedEnv = "SHARDFLOW_BLAS_REPLACED";  // what OpenBLAS had picked, for children

std::mutex choice_mu;

// Note [OpenBLAS on CPUs it does not know]: replace a pre-AVX fallback with what the CPU runs.
// gotoblas_dynamic_init reads OPENBLAS_CORETYPE once gotoblas_dynamic_quit has forgotten the
// first choice; both only swap the table of kernels and block sizes (the buffers are sized for any
// kernel), so before the process's first GEMM this is what setting the variable would have done.
// But not while OpenBLAS's worker threads start: the pthread build starts them as it loads, and
// each one's first act is to take its buffer, which runs gotoblas_dynamic_init itself when it
// finds no table; one that starts between our quit and init makes a second, concurrent init, and
// the process dies in it (SIGSEGV in gotoblas_dynamic_init, 7 of 300 `shardflow doctor` runs with
// other tests beside them; any process that links libshardflow took the same path at load). So
// the pool is stopped first (blas_thread_shutdown_, what OpenBLAS's own fork handler calls: it
// joins the workers), and OpenBLAS starts it again at the first GEMM that wants threads.
void choose(const Api& a) {
  std::lock_guard<std::mutex> lock(choice_mu);
  if (!a.dynamic_init || !a.dynamic_quit) return;  // not a DYNAMIC_ARCH build: one kernel only
  if (std::getenv("OPENBLAS_CORETYPE")) return;    // the user's (or the launcher's) choice
  if (const char* keep = std::getenv("SHARDFLOW_BLAS_KERNEL"); keep && std::strcmp(keep, "keep") == 0) return;
  const std::string picked = a.corename();
  const std::string best = best_for_cpu();
  if (!pre_avx(picked) || pre_avx(best)) return;
  if (a.thread_shutdown) a.thread_shutdown();  // absent in the OpenMP build, whose threads start at its first call
  ::setenv("OPENBLAS_CORETYPE", best.c_str(), 1);
  a.dynamic_quit();
  a.dynamic_init();
  if (strcasecmp(a.corename(), best.c_str()) != 0) {  // this build lacks it: back to OpenBLAS's own
    ::unsetenv("OPENBLAS_CORETYPE");
    a.dynamic_quit();
    a.dynamic_init();
    return;
  }
  ::setenv(kReplacedEnv, picked.c_str(), 1);
}

// At load of whatever links this file (libshardflow): OpenBLAS, a dependency, is initialised
// already and nothing has called it yet.
__attribute__((constructor)) void choose_at_load() {
  if (const Api a = loaded(); a.lib) choose(a);
}

}  // namespace

// The kernel sets OpenBLAS falls back to for a CPU it does not recognise, all older than AVX.
bool pre_avx(const std::string& name) {
  static const char* names[] = {"Prescott", "Katmai", "Coppermine", "Northwood", "Banias", "Core2",
                                "Penryn",   "Dunnington", "Nehalem", "Atom", "Nano", "Unknown"};
  for (const char* n : names)
    if (strcasecmp(n, name.c_str()) == 0) return true;
  return false;
}


Kernel kernel() {
  Kernel k;
  k.best_for_cpu = best_for_cpu();
  const Api a = loaded();
  if (!a.lib) return k;
  k.openblas = true;
  k.config = a.config();
  k.name = a.corename();
  k.threads = a.get_threads();
  const char* replaced = std::getenv(kReplacedEnv);
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  if (replaced && forced && strcasecmp(forced, k.name.c_str()) == 0) {
    k.chosen_by = "shardflow";
    k.replaced = replaced;
  } else {
    k.chosen_by = forced ? "OPENBLAS_CORETYPE" : "OpenBLAS";
  }
  return k;
}

bool load() {
  if (loaded().lib) return true;
  for (const char* so : kSonames)
    if (void* lib = dlopen(so, RTLD_NOW | RTLD_GLOBAL)) {
      const Api a = resolve(lib);
      if (!a.lib) return false;
      choose(a);
      return true;
    }
  return false;
}

namespace {

struct Case {
  bool ta, tb;
  int M, N, K;
};

std::string describe(const Case& c) {
  return std::string("sgemm ") + (c.ta ? "T" : "N") + (c.tb ? "T" : "N") + " " + std::to_string(c.M) + "x" +
         std::to_string(c.N) + "x" + std::to_string(c.K);
}

}  // namespace

Probe probe() {
  Probe p;
  const Api a = loaded();
  if (!a.lib) return p;
  p.ran = true;
  p.kernel = a.corename();
  p.threads_probed = std::min(3, a.get_threads());
  // NT 4096x6x24 moves an N edge between threads, NT 11x256x256 an M edge (Note [OpenBLAS on
  // CPUs it does not know]); NN and TN as the backward pass calls them.
  const Case cases[] = {{false, true, 4096, 6, 24}, {false, true, 11, 256, 256}, {false, false, 21, 64, 256}, {true, false, 10, 256, 32}};
  const int threads_before = a.get_threads();
  std::uint32_t seed = 12345;
  auto rnd = [&seed] {
    seed = seed * 1664525u + 1013904223u;
    return float(seed >> 8) / 16777216.0f - 0.5f;
  };
  for (const Case& c : cases) {
    const int rows_a = c.ta ? c.K : c.M, cols_a = c.ta ? c.M : c.K, rows_b = c.tb ? c.N : c.K, cols_b = c.tb ? c.K : c.N;
    std::vector<float> A(std::size_t(rows_a) * cols_a), B(std::size_t(rows_b) * cols_b), C0(std::size_t(c.M) * c.N);
    for (auto& x : A) x = rnd();
    for (auto& x : B) x = rnd();
    for (auto& x : C0) x = rnd();
    // Row-major cblas: 101; no transpose 111, transpose 112.
    auto run = [&](int threads, std::size_t shift) {
      a.set_threads(threads);
      std::vector<float> a_buf(A.size() + 16), b_buf(B.size() + 16), c_buf(C0.size() + 16);
      std::copy(A.begin(), A.end(), a_buf.begin() + shift);
      std::copy(B.begin(), B.end(), b_buf.begin() + shift);
      std::copy(C0.begin(), C0.end(), c_buf.begin() + shift);
      a.sgemm(101, c.ta ? 112 : 111, c.tb ? 112 : 111, c.M, c.N, c.K, 1.0f, a_buf.data() + shift, cols_a, b_buf.data() + shift,
              cols_b, 1.0f, c_buf.data() + shift, c.N);
      return std::vector<float>(c_buf.begin() + shift, c_buf.begin() + shift + C0.size());
    };
    const auto ref = run(1, 0);
    for (int i = 0; i < c.M; ++i)
      for (int j = 0; j < c.N; ++j) {
        double sum = C0[std::size_t(i) * c.N + j], size = std::fabs(sum);
        for (int k = 0; k < c.K; ++k) {
          const double x = c.ta ? A[std::size_t(k) * c.M + i] : A[std::size_t(i) * c.K + k];
          const double y = c.tb ? B[std::size_t(j) * c.K + k] : B[std::size_t(k) * c.N + j];
          sum += x * y;
          size += std::fabs(x * y);
        }
        p.max_rel_error = std::max(p.max_rel_error, std::fabs(ref[std::size_t(i) * c.N + j] - sum) / std::max(size, 1e-30));
      }
    auto same = [&](const std::vector<float>& r) { return std::memcmp(r.data(), ref.data(), ref.size() * sizeof(float)) == 0; };
    for (int threads : {2, 3})
      if (threads <= threads_before && p.thread_invariant && !same(run(threads, 0))) {
        p.thread_invariant = false;
        if (p.moved.empty()) p.moved = describe(c) + ": 1 vs " + std::to_string(threads) + " threads";
      }
    for (std::size_t shift : {std::size_t(0), std::size_t(1), std::size_t(3), std::size_t(5)})
      if (p.repeatable && !same(run(1, shift))) {
        p.repeatable = false;
        if (p.moved.empty()) p.moved = describe(c) + ": buffers shifted by " + std::to_string(shift * 4) + " bytes";
      }
  }
  a.set_threads(threads_before);
  return p;
}

int probe_child_main() {
  load();
  const Probe p = probe();
  std::printf("ran %d\ninvariant %d\nrepeatable %d\nthreads %d\nerror %.17g\nkernel %s\nmoved %s\n", int(p.ran), int(p.thread_invariant),
              int(p.repeatable), p.threads_probed, p.max_rel_error, p.kernel.c_str(), p.moved.c_str());
  for (const char* name : {"OPENBLAS_CORETYPE", kReplacedEnv})
    if (const char* v = std::getenv(name)) std::printf("env %s=%s\n", name, v);
  return 0;
}

Probe probe_in_child(const std::string& exe, const std::string& arg, std::vector<std::pair<std::string, std::string>>* kernel_env) {
  Probe p;
  int fds[2];
  if (::pipe(fds) != 0) return p;
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]), ::close(fds[1]);
    return p;
  }
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::close(fds[0]), ::close(fds[1]);
    ::setenv("OPENBLAS_NUM_THREADS", "3", 1);  // the pool the probe lowers from
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execl(exe.c_str(), exe.c_str(), arg.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    pollfd pfd{fds[0], POLLIN, 0};
    if (left <= 0 || ::poll(&pfd, 1, int(left)) <= 0) {
      ::kill(pid, SIGKILL);
      break;
    }
    char buf[1024];
    const auto got = ::read(fds[0], buf, sizeof buf);
    if (got <= 0) break;
    out.append(buf, std::size_t(got));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return Probe{};
  std::istringstream in(out);
  std::string key;
  while (in >> key) {
    std::string rest;
    std::getline(in, rest);
    if (!rest.empty() && rest.front() == ' ') rest.erase(0, 1);
    if (key == "ran") p.ran = rest == "1";
    else if (key == "invariant") p.thread_invariant = rest == "1";
    else if (key == "repeatable") p.repeatable = rest == "1";
    else if (key == "threads") p.threads_probed = std::atoi(rest.c_str());
    else if (key == "error") p.max_rel_error = std::atof(rest.c_str());
    else if (key == "kernel") p.kernel = rest;
    else if (key == "moved") p.moved = rest;
    else if (key == "env" && kernel_env && rest.find('=') != std::string::npos)
      kernel_env->emplace_back(rest.substr(0, rest.find('=')), rest.substr(rest.find('=') + 1));
  }
  return p;
}

std::string Probe::line() const {
  if (!ran) return "BLAS: not OpenBLAS, not probed";
  char err[32];
  std::snprintf(err, sizeof err, "%.1e", max_rel_error);
  if (thread_invariant && repeatable)
    return "OpenBLAS " + kernel + ": reproducible (same bits at 1-" + std::to_string(threads_probed) + " threads and shifted buffers; " + err +
           " from float64)";
  std::string fix;
  const std::string best = best_for_cpu();
  if (!repeatable)
    fix = "set OPENBLAS_CORETYPE=" + (best == kernel ? std::string("Sandybridge") : best);
  else if (best == "Cooperlake" || best == "SkylakeX")
    fix = "set OPENBLAS_CORETYPE=" + best + ", whose tiles all sum alike";
  else
    fix = "results are reproducible at a fixed thread count (the launcher fixes it per rank: OMP_NUM_THREADS); "
          "OPENBLAS_CORETYPE=Sandybridge makes them independent of it, at some speed";
  return "OpenBLAS " + kernel + ": other bits " + (thread_invariant ? "at other buffer offsets" : "at other thread counts") + " (" + moved +
         "; reordered, not wrong: " + err + " from float64): " + fix;
}

}  // namespace shardflow::kernels::blas
