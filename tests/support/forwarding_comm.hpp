// What a test's wrapping communicator passes straight through (rank, world, backend, devices,
// abort); each wrapper says what its submit() does around the inner one's.
#pragma once

#include <memory>
#include <string>

#include "shardflow/communicator.hpp"

namespace shardflow::test {

class ForwardingComm : public Communicator {
 public:
  explicit ForwardingComm(std::shared_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::string backend_name() const override { return inner_->backend_name(); }
  bool supports(Device d) const override { return inner_->supports(d); }
  bool shifts_by(int distance) const override { return inner_->shifts_by(distance); }
  bool shifts_unequal(bool in_host) const override { return inner_->shifts_unequal(in_host); }
  int in_host_ranks() const override { return inner_->in_host_ranks(); }
  void abort(const std::string& reason) override { inner_->abort(reason); }

 protected:
  std::shared_ptr<Communicator> inner_;
};

}  // namespace shardflow::test
