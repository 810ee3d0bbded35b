// `shardflow doctor` and the OpenBLAS reproducibility probe (Note [OpenBLAS on CPUs it does not
// know]): every check named and passing on this machine; the probe catches a kernel whose bits move
// with the thread count and stays quiet on one whose do not; a /dev/shm too small for the job and a
// GLOO_SOCKET_IFNAME that names no interface fail, each naming its fix.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "kernels/cpu/blas.hpp"
#include "kernels/cpu/vector_isa.hpp"

namespace {

struct Doctor {
  int status = -1;
  nlohmann::json checks;  // name -> {status, detail, fix}
};

Doctor doctor(const std::string& env, const std::string& args = "") {
  const std::string cmd = "env " + env + " " + SHARDFLOW_LAUNCHER_PATH + " doctor --json " + args + " 2>/dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p);
  std::string out;
  char buf[4096];
  while (std::size_t got = std::fread(buf, 1, sizeof buf, p)) out.append(buf, got);
  Doctor d;
  d.status = WEXITSTATUS(::pclose(p));
  INFO(out);
  const auto j = nlohmann::json::parse(out);
  REQUIRE(j["ok"] == (d.status == 0));
  for (const auto& c : j["checks"]) d.checks[c["name"].get<std::string>()] = c;
  return d;
}

// The environment of a bare machine: nothing the checks read.
const std::string bare = "-u OPENBLAS_CORETYPE -u SHARDFLOW_BLAS_REPLACED -u GLOO_SOCKET_IFNAME -u SHARDFLOW_SOCKET_IFNAME -u SHARDFLOW_SOCKET_ADDR -u SHARDFLOW_HUGE_PAGES "
                          "-u SHARDFLOW_KEEP_FREED_MEMORY -u SHARDFLOW_CPU_VECTORS -u GLIBC_TUNABLES -u MALLOC_MMAP_THRESHOLD_ -u MALLOC_TRIM_THRESHOLD_";

}  // namespace

TEST_CASE("shardflow doctor on this machine with a bare environment: every check named, none fails, exit 0 — the BLAS kernel is no pre-AVX fallback") {
  const auto d = doctor(bare);
  CHECK(d.status == 0);
  for (const char* name : {"cpu", "openblas", "blas reproducibility", "vector loops", "libshardflow", "gpus", "python module", "/dev/shm", "open files",
                           "locked memory", "huge pages", "freed memory", "network"}) {
    INFO(name);
    REQUIRE(d.checks.contains(name));
    CHECK(d.checks[name]["status"] != "FAIL");
    CHECK(!d.checks[name]["detail"].get<std::string>().empty());
  }
  // Out of the box the kernel is the one the CPU's features call for, whatever OpenBLAS knew of it.
  const auto best = shardflow::kernels::blas::kernel().best_for_cpu;
  CHECK(d.checks["openblas"]["detail"].get<std::string>().find("kernel " + best) != std::string::npos);
  CHECK(d.checks["openblas"]["status"] == "ok");
}

TEST_CASE("doctor's vector loops: AVX2's where the CPU has it, SHARDFLOW_CPU_VECTORS=baseline a warning there, a malformed value a failure "
          "naming it (Note [Vector loops, the same bits])") {
  const bool avx2 = shardflow::kernels::cpu_has_avx2();
  const auto on = doctor(bare).checks["vector loops"];
  CHECK(on["status"] == "ok");
  CHECK(on["detail"].get<std::string>().find(avx2 ? "run avx2 loops (the CPU has AVX2)" : "run baseline loops (the CPU has no AVX2)") != std::string::npos);
  const auto base = doctor(bare + " SHARDFLOW_CPU_VECTORS=baseline").checks["vector loops"];
  CHECK(base["detail"].get<std::string>().find("run baseline loops (SHARDFLOW_CPU_VECTORS)") != std::string::npos);
  CHECK(base["status"] == (avx2 ? "warn" : "ok"));
  const auto bad = doctor(bare + " SHARDFLOW_CPU_VECTORS=sse9");
  CHECK(bad.checks["vector loops"]["status"] == "FAIL");
  CHECK(bad.checks["vector loops"]["detail"].get<std::string>().find("SHARDFLOW_CPU_VECTORS='sse9'") != std::string::npos);
}

TEST_CASE("doctor's huge pages: the kernel's setting and a first write's cost, SHARDFLOW_HUGE_PAGES=0 said (a warning where a first write is dear) and a malformed value a failure naming it") {
  const auto on = doctor(bare).checks;
  const std::string detail = on["huge pages"]["detail"];
  CHECK(detail.find("transparent huge pages: ") == 0);
  CHECK(detail.find("a first write costs ") != std::string::npos);
  const auto off = doctor(bare + " SHARDFLOW_HUGE_PAGES=0").checks["huge pages"];
  CHECK(off["detail"].get<std::string>().find("SHARDFLOW_HUGE_PAGES=0: the runtime keeps 4 KiB pages") != std::string::npos);
  if (off["status"] == "warn") CHECK(off["fix"] == "unset SHARDFLOW_HUGE_PAGES");
  const auto bad = doctor(bare + " SHARDFLOW_HUGE_PAGES=yes");
  CHECK(bad.status == 1);
  CHECK(bad.checks["huge pages"]["status"] == "FAIL");
  CHECK(bad.checks["huge pages"]["detail"].get<std::string>().find("SHARDFLOW_HUGE_PAGES='yes'") != std::string::npos);
}

TEST_CASE("doctor's freed memory: kept for reuse on a bare machine, left to malloc where SHARDFLOW_KEEP_FREED_MEMORY=0 or glibc's own "
          "setting says so, and a malformed switch a failure naming it (Note [Keeping the trainer's freed memory])") {
  CHECK(doctor(bare).checks["freed memory"]["detail"] == "kept for reuse by a Runtime here: glibc malloc's mmap threshold 32 MiB, trim threshold 2 GiB");
  CHECK(doctor(bare + " SHARDFLOW_KEEP_FREED_MEMORY=0").checks["freed memory"]["detail"] == "left to malloc: SHARDFLOW_KEEP_FREED_MEMORY=0");
  CHECK(doctor(bare + " MALLOC_TRIM_THRESHOLD_=0").checks["freed memory"]["detail"] == "left to malloc: MALLOC_TRIM_THRESHOLD_ is set");
  const auto bad = doctor(bare + " SHARDFLOW_KEEP_FREED_MEMORY=yes");
  CHECK(bad.status == 1);
  CHECK(bad.checks["freed memory"]["status"] == "FAIL");
  CHECK(bad.checks["freed memory"]["detail"].get<std::string>().find("got 'yes'") != std::string::npos);
}

TEST_CASE("the reproducibility probe catches Prescott (bits move with the thread count, names OPENBLAS_CORETYPE) and stays quiet on Sandybridge") {
  const auto prescott = doctor(bare + " OPENBLAS_CORETYPE=Prescott");
  CHECK(prescott.checks["blas reproducibility"]["status"] == "warn");
  CHECK(prescott.checks["blas reproducibility"]["detail"].get<std::string>().find("other bits at other thread counts") != std::string::npos);
  CHECK(prescott.checks["blas reproducibility"]["fix"].get<std::string>().find("OPENBLAS_CORETYPE=") != std::string::npos);
  // Reordered, not wrong: within float32 rounding of a float64 sum.
  CHECK(prescott.checks["blas reproducibility"]["detail"].get<std::string>().find("not wrong") != std::string::npos);
  // Slow, too, where the CPU runs better: the openblas check says so.
  if (shardflow::kernels::blas::kernel().best_for_cpu != "Prescott") CHECK(prescott.checks["openblas"]["status"] == "warn");
  // Sandybridge (AVX) runs on every x86-64 CPU of the last decade and sums every tile alike.
  const auto sandybridge = doctor(bare + " OPENBLAS_CORETYPE=Sandybridge");
  CHECK(sandybridge.checks["blas reproducibility"]["status"] == "ok");
  CHECK(sandybridge.checks["blas reproducibility"]["detail"].get<std::string>().find("reproducible") != std::string::npos);
}

TEST_CASE("a /dev/shm too small for the job fails, naming the size to grow it to") {
  // A model whose two in-memory snapshots cannot fit: 64 Gi parameters' worth of shapes.
  const auto dir = std::filesystem::temp_directory_path() / ("sf_doctor_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "huge.json") << R"([{"name": "w", "shape": [65536, 1048576]}])";
  const auto d = doctor(bare, "--nproc-per-node 2 --snapshots --params " + (dir / "huge.json").string() + " --world-size 2");
  CHECK(d.status == 1);
  CHECK(d.checks["/dev/shm"]["status"] == "FAIL");
  CHECK(d.checks["/dev/shm"]["fix"].get<std::string>().find("--shm-size") != std::string::npos);
  CHECK(d.checks["/dev/shm"]["fix"].get<std::string>().find("remount,size=") != std::string::npos);
  // Without snapshots the same job needs only the staging areas. Whether those fit depends on what the
  // suites beside this one hold in /dev/shm at that moment, so the verdict is checked against the
  // numbers the check printed rather than assumed "ok".
  const auto without = doctor(bare, "--nproc-per-node 2 --params " + (dir / "huge.json").string() + " --world-size 2").checks["/dev/shm"];
  const auto detail = without["detail"].get<std::string>();
  INFO(detail);
  CHECK(detail.find("snapshots") == std::string::npos);
  const auto free_mib = std::stoull(detail);
  const auto need_mib = std::stoull(detail.substr(detail.find("needs ") + 6));
  CHECK(need_mib < 1024);
  CHECK(without["status"] == (free_mib >= need_mib ? "ok" : "FAIL"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("a GLOO_SOCKET_IFNAME that names no interface fails, naming the variable and the interfaces there are") {
  const auto d = doctor(bare + " GLOO_SOCKET_IFNAME=nosuch0");
  CHECK(d.status == 1);
  CHECK(d.checks["network"]["status"] == "FAIL");
  CHECK(d.checks["network"]["detail"].get<std::string>().find("'nosuch0'") != std::string::npos);
  CHECK(d.checks["network"]["detail"].get<std::string>().find("lo=127.0.0.1") != std::string::npos);
  CHECK(d.checks["network"]["fix"].get<std::string>().find("GLOO_SOCKET_IFNAME") != std::string::npos);
  CHECK(doctor(bare + " GLOO_SOCKET_IFNAME=lo").checks["network"]["status"] == "ok");
}
