// The registered parameters of one rank: validation at registration, lookup by name, and the
// start-up check that every rank registered the same list.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "shardflow/communicator.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

class ParamRegistry {
 public:
  // Throws UsageError naming the parameter when the spec is unusable.
  std::uint32_t add(ParamSpec spec, bool gradient_as_bucket_view, const Communicator& comm);
  const std::vector<ParamSpec>& params() const { return params_; }
  std::optional<std::uint32_t> find(const std::string& name) const;
  std::size_t size() const { return params_.size(); }
  // Buffers (BufferSpec): names share the parameters' namespace.
  void add_buffer(BufferSpec spec, const Communicator& comm);
  const std::vector<BufferSpec>& buffers() const { return buffers_; }
  void set_requires_grad(std::uint32_t p, bool on) { params_[p].requires_grad = on; }
  std::size_t trainable() const {  // parameters that require a gradient
    std::size_t n = 0;
    for (const auto& p : params_) n += p.requires_grad;
    return n;
  }

  // One line per parameter (name, shape, dtype), then one per buffer ("buffer", name, bytes).
  // Devices may differ between ranks (cuda:0, cuda:1).
  std::string signature() const;

 private:
  std::vector<ParamSpec> params_;
  std::vector<BufferSpec> buffers_;
  std::unordered_map<std::string, std::uint32_t> by_name_;
};

// A collective over `comm`: throws MismatchError naming the first difference between rank 0's list
// and the first rank whose list differs. Two small allgathers when the lists agree.
void verify_same_params(Communicator& comm, const std::string& signature, std::chrono::milliseconds timeout);

// The human-readable first difference between two signatures (exposed for tests).
std::string first_signature_difference(const std::string& a, int rank_a, const std::string& b, int rank_b);

}  // namespace shardflow
