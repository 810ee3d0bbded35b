#include "runtime/cli/doctor_command.hpp"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>

#include "runtime/cli/doctor_checks.hpp"
#include "runtime/cli/plan_command.hpp"

namespace shardflow::cli {
namespace {

struct DoctorArgs {
  PlanArgs plan;
  int nproc_per_node = 0;
  bool snapshots = false;
  bool json = false;
};

// The job's shape from the flags: the plan's, when a model was given.
JobShape job_shape(const DoctorArgs& a) {
  JobShape job;
  job.ranks_per_host = a.nproc_per_node;
  job.snapshots = a.snapshots;
  if (a.plan.params.empty()) return job;
  PlanArgs p = a.plan;
  if (p.world < 1) p.world = a.nproc_per_node > 0 ? a.nproc_per_node : 1;
  const RunPlan plan = make_plan(p);
  job.world = p.world;
  if (job.ranks_per_host == 0) job.ranks_per_host = p.world / p.hosts;
  if (plan.network.hosts > 1 && plan.network.two_levels) job.plan_shm_bytes = plan.network.second_segment;
  for (const auto& prm : plan.params)  // parameters and their optimizer state, as a snapshot holds them
    job.snapshot_bytes += std::size_t(numel(prm.shape)) * (dtype_size(prm.dtype) + 4 * plan.settings.state_slots);
  return job;
}

int run_doctor(const DoctorArgs& a) {
  JobShape job;
  try {
    job = job_shape(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardflow doctor: error: %s\n", e.what());
    return 2;
  }
  std::vector<Check> checks = {check_cpu(), check_openblas(), check_blas_probe(), check_vector_loops()};
  for (auto& c : check_library()) checks.push_back(std::move(c));
  for (auto c : {check_python(), check_shm(job), check_open_files(job), check_locked_memory(), check_huge_pages(), check_freed_memory(), check_network()}) checks.push_back(std::move(c));
  bool failed = false;
  for (const auto& c : checks) failed |= c.status == Check::Status::fail;
  if (a.json) {
    auto arr = nlohmann::ordered_json::array();
    for (const auto& c : checks) arr.push_back({{"name", c.name}, {"status", status_name(c.status)}, {"detail", c.detail}, {"fix", c.fix}});
    const nlohmann::ordered_json j = {{"ok", !failed}, {"checks", arr}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    for (const auto& c : checks) {
      std::printf("%-4s  %-20s %s\n", status_name(c.status), c.name.c_str(), c.detail.c_str());
      if (!c.fix.empty()) std::printf("      %-20s fix: %s\n", "", c.fix.c_str());
    }
    std::printf("%s\n", failed ? "something here would break a job: see FAIL above" : "nothing here would break a job");
  }
  return failed ? 1 : 0;
}

}  // namespace

std::function<int()> add_doctor_command(CLI::App& app) {
  auto args = std::make_shared<DoctorArgs>();
  auto* cmd = app.add_subcommand("doctor", "check this machine for what would make a job slow, wrong or hang, and say how to fix it");
  cmd->add_option("--nproc-per-node", args->nproc_per_node, "ranks this host will run (default: its cores)");
  cmd->add_flag("--snapshots", args->snapshots, "the job keeps in-memory snapshots (shardflow run --max-restarts): count them in /dev/shm");
  add_plan_options(*cmd, args->plan, false);
  cmd->add_flag("--json", args->json, "machine-readable: {\"ok\": ..., \"checks\": [{\"name\", \"status\", \"detail\", \"fix\"}]}");
  return [cmd, args]() -> int { return cmd->parsed() ? run_doctor(*args) : -1; };
}

}  // namespace shardflow::cli
