// shardflow: the command-line entry point.
//
//   shardflow run --nproc-per-node N [--nnodes M --node-rank R (--master-addr A --master-port P |
//                 --rdzv-endpoint A:P) --token T --iface NAME] -- prog args...
//   shardflow plan --params model.json --world-size N [--zero-stage S --partition P ...] [--json]
//   shardflow doctor [--nproc-per-node N --snapshots --params model.json ...] [--json]
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>

#include "kernels/cpu/blas.hpp"
#include "runtime/bootstrap/etcd_names.hpp"
#include "runtime/cli/doctor_command.hpp"
#include "runtime/cli/plan_command.hpp"
#include "runtime/launch/launcher.hpp"

namespace {

// torchrun's flags that shardflow run does not take, and what to do instead. A flag CLI11 does not
// know would otherwise surface as "The following argument was not expected: <its value>".
const char* torchrun_advice(const std::string& flag) {
  static const std::pair<const char*, const char*> advice[] = {
      {"--standalone", "one node is the default: drop it"},
      {"--rdzv_backend", "shardflow's rendezvous store is built in: drop it"},
      {"--rdzv-backend", "shardflow's rendezvous store is built in: drop it"},
      {"--rdzv_id", "the job's store token plays its part: --token T (or SHARDFLOW_STORE_TOKEN)"},
      {"--rdzv-id", "the job's store token plays its part: --token T (or SHARDFLOW_STORE_TOKEN)"},
      {"--monitor_interval", "use --heartbeat-interval"},
      {"--monitor-interval", "use --heartbeat-interval"},
  };
  for (const auto& [name, what] : advice)
    if (flag == name) return what;
  return nullptr;
}

// The first flag of `shardflow run` (before the program) that it does not take, with what to use
// instead when it is torchrun's; empty when all are known.
std::string unknown_run_flag(int argc, char** argv, const CLI::App& run) {
  bool in_run = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    if (!in_run) {
      in_run = a == "run";
      continue;
    }
    if (a.rfind("--", 0) != 0) continue;
    const std::string flag = a.substr(0, a.find('='));
    bool known = false;
    for (const auto* o : run.get_options())
      for (const auto& n : o->get_lnames()) known |= flag == "--" + n;
    if (flag == "--help") known = true;
    if (known) continue;
    if (const char* what = torchrun_advice(flag)) return "shardflow run: error: " + flag + " is torchrun's; " + what;
    return "shardflow run: error: unknown flag " + flag + " (shardflow run --help lists the flags; torchrun's underscore spellings such as "
           "--nproc_per_node are accepted; the program and its arguments go after --)";
  }
  return "";
}

// `shardflow run`'s flags: the launch spec, and the values given in other units or spellings
// than the spec keeps (seconds, N or MIN:MAX, HOST:PORT).
struct RunFlags {
  shardflow::launch::LaunchSpec spec;
  double grace_s = 5, rejoin_s = 10, rdzv_s = 600, hb_s = 10, hb_interval_s = 1;
  bool no_prefix = false;
  std::string nnodes = "1", endpoint;
  std::string rdzv_backend = "tcp", rdzv_endpoints;
};

CLI::App* add_run_command(CLI::App& app, RunFlags& f) {
  auto* run = app.add_subcommand("run", "start this node's ranks with torchrun's environment and supervise them");
  auto& spec = f.spec;
  run->add_option("--nproc-per-node,--nproc_per_node", spec.nproc_per_node, "ranks on this node")->capture_default_str();
  run->add_option("--nnodes", f.nnodes,
                  "nodes in the job, or MIN:MAX: with --max-restarts a node lost for longer than --rejoin-timeout is left "
                  "out at the next restart while MIN nodes remain (the job starts with MAX)")
      ->capture_default_str();
  run->add_option("--rejoin-timeout", f.rejoin_s, "with --nnodes MIN:MAX: seconds a lost node has to come back before the others go on without it")
      ->capture_default_str();
  run->add_option("--node-rank,--node_rank", spec.node_rank, "this node's index")->capture_default_str();
  run->add_option("--master-addr,--master_addr", spec.master_addr, "address of node 0 (it serves the rendezvous store)")->capture_default_str();
  run->add_option("--master-port,--master_port", spec.master_port, "store port (default: any free port on one node, 29500 across nodes)");
  run->add_option("--token", spec.token, "the job's store token (default: SHARDFLOW_STORE_TOKEN, else random on one node)");
  run->add_option("--rdzv-endpoint,--rdzv_endpoint", f.endpoint, "torchrun's spelling of --master-addr and --master-port: HOST:PORT");
  run->add_option("--rdzv-backend,--rdzv_backend", f.rdzv_backend,
                  "where the job's store lives: tcp (node 0's launcher serves it) or etcd (an etcd cluster: no node is special)")
      ->capture_default_str();
  run->add_option("--rdzv-endpoints,--rdzv_endpoints", f.rdzv_endpoints, "with --rdzv-backend etcd: the etcd members' client addresses, H:P,H:P,...");
  run->add_option("--rdzv-id,--rdzv_id", spec.rdzv_id, "with --rdzv-backend etcd: this job's id, the same on every node (its keys live under /shardflow/ID/)");
  run->add_option("--iface", spec.iface,
                  "network interface whose address the ranks bind and advertise (default: SHARDFLOW_SOCKET_IFNAME, "
                  "GLOO_SOCKET_IFNAME, else the one routing to the master address)");
  run->add_option("--local-addr,--local_addr", spec.local_addr, "this node's address for the ranks' sockets (overrides --iface)");
  run->add_option("--rdzv-timeout,--rdzv_timeout", f.rdzv_s, "seconds to wait for every node to arrive")->capture_default_str();
  run->add_option("--heartbeat-timeout", f.hb_s, "seconds of silence after which a node counts as lost")->capture_default_str();
  run->add_option("--heartbeat-interval", f.hb_interval_s, "seconds between a node's heartbeats")->capture_default_str();
  run->add_option("--kill-grace", f.grace_s, "seconds between SIGTERM and SIGKILL when stopping the ranks")->capture_default_str();
  run->add_flag("--no-prefix", f.no_prefix, "do not prefix output lines with the rank");
  run->add_option("--max-restarts,--max_restarts", spec.max_restarts,
                  "when a rank fails, stop the others and start every rank again, up to this many times "
                  "(SHARDFLOW_RESTART_COUNT tells each generation which it is; across nodes all restart together)")
      ->capture_default_str();
  run->add_option("--recovery", spec.recovery,
                  "how a lost rank is healed with --max-restarts: restart (every rank starts again), in-place (only the lost "
                  "rank's process starts again; the others go on after Runtime::recover, Note [Recovering in place]) or shrink "
                  "(no process starts: the others go on at once at the smaller world)")
      ->check(CLI::IsMember({"restart", "in-place", "shrink"}))
      ->capture_default_str();
  run->add_option("command", spec.command, "the program and its arguments (after --)")->required();
  return run;
}

// --rdzv-endpoint HOST:PORT or [V6]:PORT into the spec; the port is required (torchrun's default of
// 29400 belongs to its own agent). The error, or "".
std::string apply_endpoint(RunFlags& f, const CLI::App& run) {
  if (f.endpoint.empty()) return "";
  const auto colon = f.endpoint.rfind(':');
  if (colon == std::string::npos || colon + 1 == f.endpoint.size() || f.endpoint.find_first_not_of("0123456789", colon + 1) != std::string::npos)
    return "--rdzv-endpoint '" + f.endpoint + "' is not HOST:PORT";
  if (run.count("--master-addr") || run.count("--master-port"))
    return "--rdzv-endpoint and --master-addr/--master-port say the same thing: pass one";
  std::string host = f.endpoint.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  f.spec.master_addr = host;
  f.spec.master_port = std::atoi(f.endpoint.c_str() + colon + 1);
  return "";
}

// --nnodes N or MIN:MAX into the spec. The error, or "".
std::string apply_nnodes(RunFlags& f) {
  const auto colon = f.nnodes.find(':');
  auto number = [](const std::string& t) { return !t.empty() && t.find_first_not_of("0123456789") == std::string::npos && t.size() < 6; };
  const std::string lo = colon == std::string::npos ? f.nnodes : f.nnodes.substr(0, colon);
  const std::string hi = colon == std::string::npos ? "" : f.nnodes.substr(colon + 1);
  if (!number(lo) || (colon != std::string::npos && !number(hi))) return "--nnodes '" + f.nnodes + "' is not N or MIN:MAX";
  f.spec.nnodes = std::atoi((colon == std::string::npos ? lo : hi).c_str());
  if (colon != std::string::npos) f.spec.min_nnodes = std::atoi(lo.c_str());
  return "";
}

// The spec as `run` starts it: the values in the spec's units, the token from the environment.
std::string finish_spec(RunFlags& f, const CLI::App& run) {
  auto& spec = f.spec;
  if (spec.token.empty())
    if (const char* t = std::getenv("SHARDFLOW_STORE_TOKEN")) spec.token = t;
  spec.prefix_output = !f.no_prefix;
  spec.rdzv_timeout = std::chrono::milliseconds(long(f.rdzv_s * 1000));
  spec.heartbeat_timeout = std::chrono::milliseconds(long(f.hb_s * 1000));
  spec.heartbeat_interval = std::chrono::milliseconds(long(f.hb_interval_s * 1000));
  if (auto why = apply_endpoint(f, run); !why.empty()) return why;
  if (f.rdzv_backend != "tcp" && f.rdzv_backend != "etcd") return "--rdzv-backend '" + f.rdzv_backend + "': expected tcp or etcd";
  if (f.rdzv_backend == "tcp" && !f.rdzv_endpoints.empty()) return "--rdzv-endpoints is for --rdzv-backend etcd";
  if (f.rdzv_backend == "tcp" && !spec.rdzv_id.empty())
    return "--rdzv-id is for --rdzv-backend etcd (the TCP store is the job's own: node 0's launcher serves it)";
  if (f.rdzv_backend == "etcd") {
    spec.etcd_endpoints = shardflow::etcd::split_endpoints(f.rdzv_endpoints);
    if (spec.etcd_endpoints.empty()) return "--rdzv-backend etcd needs --rdzv-endpoints H:P[,H:P...]";
  }
  spec.kill_grace = std::chrono::milliseconds(long(f.grace_s * 1000));
  spec.rejoin_timeout = std::chrono::milliseconds(long(f.rejoin_s * 1000));
  return apply_nnodes(f);
}

}  // namespace

int main(int argc, char** argv) {
  // The launcher's and doctor's OpenBLAS probe runs in a child of this command (kernels/cpu/blas.hpp).
  if (argc == 2 && std::string(argv[1]) == "__blas-probe") return shardflow::kernels::blas::probe_child_main();
  // CLI11 would say only "A subcommand is required" for a misspelt one.
  if (argc > 1 && argv[1][0] != '-' && std::string(argv[1]) != "run" && std::string(argv[1]) != "plan" &&
      std::string(argv[1]) != "doctor") {
    std::fprintf(stderr, "shardflow: unknown command '%s': expected run, plan or doctor (shardflow --help)\n", argv[1]);
    return 2;
  }
  CLI::App app{"shardflow: data-parallel training runtime"};
  app.require_subcommand(1);
  RunFlags flags;
  auto* run = add_run_command(app, flags);
  const auto plan = shardflow::cli::add_plan_command(app);
  const auto doctor = shardflow::cli::add_doctor_command(app);
  if (const auto why = unknown_run_flag(argc, argv, *run); !why.empty()) {
    std::fprintf(stderr, "%s\n", why.c_str());
    return 2;
  }
  CLI11_PARSE(app, argc, argv);
  if (const int status = plan(); status >= 0) return status;
  if (const int status = doctor(); status >= 0) return status;
  if (const auto why = finish_spec(flags, *run); !why.empty()) {
    std::fprintf(stderr, "shardflow run: error: %s\n", why.c_str());
    return 2;
  }
  try {
    return shardflow::launch::run(flags.spec);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardflow run: error: %s\n", e.what());
    return 2;
  }
}
