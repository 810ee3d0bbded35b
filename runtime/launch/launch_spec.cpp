#include "runtime/launch/launch_spec.hpp"

#include <string>

#include "shardflow/errors.hpp"

namespace shardflow::launch {

void validate(const LaunchSpec& spec) {
  if (spec.command.empty()) throw UsageError("shardflow run: no program given (shardflow run [options] -- prog args...)");
  if (spec.nproc_per_node < 1) throw UsageError("shardflow run: --nproc-per-node must be >= 1");
  if (spec.nnodes < 1) throw UsageError("shardflow run: --nnodes must be >= 1");
  if (spec.node_rank < 0 || spec.node_rank >= spec.nnodes)
    throw UsageError("shardflow run: --node-rank " + std::to_string(spec.node_rank) + " is not below --nnodes " +
                     std::to_string(spec.nnodes));
  if (spec.master_port > 65535 || spec.master_port < -1 || spec.master_port == 0)
    throw UsageError("shardflow run: --master-port must be in [1, 65535]");
  if (spec.nnodes > 1 && spec.token.empty())
    throw UsageError("shardflow run: with --nnodes > 1 every node's launcher needs the same job token, and a random one "
                     "cannot be shared: pass --token T (or export SHARDFLOW_STORE_TOKEN=T) with one T for all nodes, "
                     "e.g. T=$(head -c16 /dev/urandom | xxd -p)");
  if (spec.heartbeat_interval.count() <= 0 || spec.heartbeat_timeout <= spec.heartbeat_interval)
    throw UsageError("shardflow run: --heartbeat-timeout must be longer than the heartbeat interval (" +
                     std::to_string(spec.heartbeat_interval.count()) + " ms)");
  if (spec.rdzv_timeout.count() <= 0) throw UsageError("shardflow run: --rdzv-timeout must be positive");
  if (spec.kill_grace.count() < 0) throw UsageError("shardflow run: --kill-grace must be >= 0 seconds");
  if (!spec.etcd_endpoints.empty()) {
    if (spec.token.empty())
      throw UsageError("shardflow run: the etcd store (--rdzv-backend etcd) needs the job's token (--token T or SHARDFLOW_STORE_TOKEN): "
                       "it is the password of etcd's user for the job (docs/launching.md, \"The store on etcd\")");
    if (spec.rdzv_id.empty())
      throw UsageError("shardflow run: the etcd store (--rdzv-backend etcd) needs --rdzv-id ID, one ID per job and the same on every "
                       "node: etcd keeps an earlier job's keys");
  }
  if (spec.nnodes > 1 && spec.node_rank != 0 && spec.master_port < 0 && spec.etcd_endpoints.empty())
    throw UsageError("shardflow run: nodes other than 0 need --master-port (node 0's store)");
  if (spec.max_restarts < 0) throw UsageError("shardflow run: --max-restarts must be >= 0");
  if (spec.min_nnodes) {
    if (spec.min_nnodes < 1 || spec.min_nnodes > spec.nnodes)
      throw UsageError("shardflow run: --nnodes " + std::to_string(spec.min_nnodes) + ":" + std::to_string(spec.nnodes) +
                       ": MIN must be in [1, MAX]");
    if (spec.max_restarts == 0)
      throw UsageError("shardflow run: --nnodes " + std::to_string(spec.min_nnodes) + ":" + std::to_string(spec.nnodes) +
                       " lets the job go on without a lost node at its next restart: give --max-restarts N too");
  }
  if (spec.recovery != "restart" && spec.recovery != "in-place" && spec.recovery != "shrink")
    throw UsageError("shardflow run: --recovery '" + spec.recovery + "' is not restart, in-place or shrink");
  if (spec.recovery != "restart" && spec.max_restarts == 0)
    throw UsageError("shardflow run: --recovery " + spec.recovery + " heals a lost rank at most --max-restarts times (each recovery "
                     "counts as one): give --max-restarts N too");
  if (spec.rejoin_timeout.count() < 0) throw UsageError("shardflow run: --rejoin-timeout must be >= 0 seconds");
}

}  // namespace shardflow::launch
