#include "actors/comm_stream_actor.hpp"

#include <caf/all.hpp>

#include "actors/messages.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {
namespace {

msg::Failure to_failure(const std::exception_ptr& e) {
  if (!e) return {};
  try {
    std::rethrow_exception(e);
  } catch (const TimeoutError& x) {
    return {msg::Failure::timeout, x.what()};
  } catch (const MismatchError& x) {
    return {msg::Failure::mismatch, x.what()};
  } catch (const UsageError& x) {
    return {msg::Failure::usage, x.what()};
  } catch (const std::exception& x) {
    return {msg::Failure::comm, x.what()};
  } catch (...) {
    return {msg::Failure::comm, "unknown failure in collective"};
  }
}

}  // namespace

caf::behavior comm_stream_actor(caf::stateful_actor<CommStreamState>* self, std::shared_ptr<Communicator> comm,
                                std::vector<CollectiveOp> ops, std::shared_ptr<CollectiveLog> log) {
  auto& st = self->state;
  st.comm = std::move(comm);
  st.owners.resize(ops.size());
  st.ready.assign(ops.size(), 0);
  st.ops = std::move(ops);
  st.log = std::move(log);
  st.logger = rank_logger(st.comm->rank());
  return {
      [=](msg::bucket_ready_atom, std::uint32_t b) {
        auto& s = self->state;
        s.owners[b] = caf::actor_cast<caf::actor>(self->current_sender());
        s.ready[b] = 1;
        while (s.next < s.ops.size() && s.ready[s.next]) {
          const std::uint32_t i = s.next++;
          s.ready[i] = 0;
          s.log->record(s.ops[i]);
          s.logger->debug("issue {} '{}': {} x {}", collective_name(s.ops[i].kind), s.ops[i].tag, s.ops[i].count,
                          dtype_name(s.ops[i].dtype));
          // The completion runs on the backend's stream thread: it only sends a message.
          s.comm->submit(s.ops[i], [owner = s.owners[i], i](std::exception_ptr e) {
            caf::anon_send(owner, msg::reduced_atom::value, i, to_failure(e));
          });
        }
        if (s.next == s.ops.size()) s.next = 0;  // every bucket issued: the next iteration starts over
      },
  };
}

}  // namespace shardflow
