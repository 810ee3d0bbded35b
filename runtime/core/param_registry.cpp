#include "runtime/core/param_registry.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "shardflow/errors.hpp"

namespace shardflow {

std::uint32_t ParamRegistry::add(ParamSpec spec, bool view, const Communicator& comm) {
  const std::string who = "parameter '" + spec.name + "'";
  if (spec.name.empty()) throw UsageError("register_param: parameter #" + std::to_string(params_.size()) + " has no name");
  if (spec.name.find('\n') != std::string::npos) throw UsageError("register_param: " + who + ": name contains a newline");
  if (by_name_.count(spec.name))
    throw UsageError("register_param: " + who + " is registered twice (names must be unique)");
  for (const auto& b : buffers_)
    if (b.name == spec.name) throw UsageError("register_param: " + who + " has the name of a registered buffer (names must be unique)");
  for (auto d : spec.shape)
    if (d < 0) throw UsageError("register_param: " + who + " has a negative dimension in shape " + shape_str(spec.shape));
  const auto n = numel(spec.shape);
  if (n > 0 && !spec.data) throw UsageError("register_param: " + who + " has no data pointer");
  if (!comm.supports(spec.device))
    throw UsageError("register_param: " + who + " lives on " + spec.device.str() + ", which the " + comm.backend_name() +
                     " backend cannot reduce");
  if (view && spec.grad)
    throw UsageError("register_param: " + who +
                     " brings its own gradient storage (ParamSpec::grad) but Config::buckets.gradient_as_bucket_view is on: "
                     "leave grad null and write gradients where Runtime::grad() points, or turn the view off");
  if (!view && n > 0 && !spec.grad && spec.requires_grad)
    throw UsageError("register_param: " + who +
                     " has no gradient storage (ParamSpec::grad) and Config::buckets.gradient_as_bucket_view is off");
  const auto index = std::uint32_t(params_.size());
  by_name_.emplace(spec.name, index);
  params_.push_back(std::move(spec));
  return index;
}

void ParamRegistry::add_buffer(BufferSpec spec, const Communicator& comm) {
  const std::string who = "register_buffer: buffer '" + spec.name + "'";
  if (spec.name.empty()) throw UsageError("register_buffer: buffer #" + std::to_string(buffers_.size()) + " has no name");
  if (spec.name.find('\n') != std::string::npos) throw UsageError(who + ": name contains a newline");
  bool taken = by_name_.count(spec.name) > 0;
  for (const auto& b : buffers_) taken |= b.name == spec.name;
  if (taken) throw UsageError(who + " is registered twice, or a parameter has its name (names must be unique)");
  if (spec.bytes > 0 && !spec.data) throw UsageError(who + " has no data pointer");
  if (spec.bytes % 2 != 0)
    throw UsageError(who + " is " + std::to_string(spec.bytes) +
                     " bytes: buffers move as whole 16-bit words (pad it to an even size)");
  if (!comm.supports(spec.device))
    throw UsageError(who + " lives on " + spec.device.str() + ", which the " + comm.backend_name() + " backend cannot move");
  buffers_.push_back(std::move(spec));
}

std::optional<std::uint32_t> ParamRegistry::find(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

std::string ParamRegistry::signature() const {
  std::string s;
  for (const auto& p : params_) s += p.name + " " + shape_str(p.shape) + " " + dtype_name(p.dtype) + (p.requires_grad ? "" : " frozen") + "\n";
  for (const auto& b : buffers_) s += "buffer " + b.name + " " + std::to_string(b.bytes) + " bytes\n";
  return s;
}

namespace {

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Collectives move typed elements; set-up data travels as bytes padded to whole fp32 words, which
// the backends copy without interpreting.
CollectiveOp byte_allgather(const void* send, void* recv, std::size_t words, const char* tag) {
  CollectiveOp op;
  op.kind = CollectiveKind::allgather;
  op.dtype = DType::f32;
  op.send = send;
  op.recv = recv;
  op.count = words;
  op.tag = tag;
  return op;
}

}  // namespace

std::string first_signature_difference(const std::string& a, int ra, const std::string& b, int rb) {
  const auto la = lines(a), lb = lines(b);
  const std::string A = "rank " + std::to_string(ra), B = "rank " + std::to_string(rb);
  // Buffers' lines follow the parameters' (ParamRegistry::signature).
  const bool buffers = (a + b).find("buffer ") != std::string::npos;
  const std::string what = buffers ? " parameters and buffers, " : " parameters, ";
  for (std::size_t i = 0; i < std::min(la.size(), lb.size()); ++i)
    if (la[i] != lb[i])
      return (buffers ? "entry #" : "parameter #") + std::to_string(i) + ": " + A + " registered '" + la[i] + "', " + B + " registered '" +
             lb[i] + "'";
  if (la.size() != lb.size()) {
    const auto& longer = la.size() > lb.size() ? la : lb;
    return A + " registered " + std::to_string(la.size()) + what + B + " registered " +
           std::to_string(lb.size()) + "; the first one only one of them has is #" +
           std::to_string(std::min(la.size(), lb.size())) + " '" + longer[std::min(la.size(), lb.size())] + "'";
  }
  return "";
}

void verify_same_params(Communicator& comm, const std::string& sig, std::chrono::milliseconds timeout) {
  const int n = comm.world_size();
  if (n == 1) return;
  // Round 1: length and hash of every rank's list.
  std::uint32_t mine[4];
  const std::uint64_t h = fnv1a(sig);
  mine[0] = std::uint32_t(sig.size());
  mine[1] = std::uint32_t(h);
  mine[2] = std::uint32_t(h >> 32);
  mine[3] = 0;
  std::vector<std::uint32_t> all(std::size_t(4 * n));
  comm.run(byte_allgather(mine, all.data(), 4, "verify parameter lists"), timeout);
  bool same = true;
  std::size_t longest = 0;
  for (int r = 0; r < n; ++r) {
    same = same && std::equal(all.begin() + 4 * r, all.begin() + 4 * r + 3, all.begin());
    longest = std::max<std::size_t>(longest, all[std::size_t(4 * r)]);
  }
  if (same) return;
  // Round 2 (only when they differ): the full lists, to name the first difference.
  const std::size_t words = (longest + 3) / 4;
  std::vector<char> padded(words * 4, '\0');
  std::memcpy(padded.data(), sig.data(), sig.size());
  std::vector<char> gathered(words * 4 * std::size_t(n));
  comm.run(byte_allgather(padded.data(), gathered.data(), words, "verify parameter lists (detail)"), timeout);
  auto text = [&](int r) {
    return std::string(gathered.data() + std::size_t(r) * words * 4, all[std::size_t(4 * r)]);
  };
  const std::string ref = text(0);
  for (int r = 1; r < n; ++r) {
    const std::string other = text(r);
    if (other != ref)
      throw MismatchError("ranks registered different parameters: " + first_signature_difference(ref, 0, other, r) +
                          ". Every rank must register the same parameters (and buffers) in the same order.");
  }
}

}  // namespace shardflow
