// Note [Flat buffers]
// An llm.c-style engine holds its model as one flat parameter buffer and one flat gradient buffer
// with a table of offsets, and knows when a layer's backward is done, not when each tensor is.
// register_flat registers each table entry as an ordinary parameter pointing into the buffers (so
// buckets, shards, checkpoints and every other feature see no difference), and grads_ready(offset,
// count) reports the parameters lying in a range, in the table's reverse order (backward's). No
// per-parameter objects on the engine's side; the per-parameter API and this one give the same
// results bit for bit (tests/test_flat_buffers.cpp).
#include <algorithm>

#include "runtime/rank/runtime_impl.hpp"
#include "runtime/semantics/semantics_state.hpp"

namespace shardflow {

std::vector<Param> Runtime::register_flat(const FlatBuffers& flat) {
  auto& I = *impl_;
  if (!flat.params) throw UsageError("register_flat: no parameter buffer");
  if (flat.grads && I.cfg.buckets.gradient_as_bucket_view)
    throw UsageError("register_flat: a gradient buffer was given but " + I.cfg.name_of("buckets.gradient_as_bucket_view") +
                     " is on (gradients would live in the buckets); turn it off, or pass no gradient buffer and write where grad() points");
  if (!flat.grads && !I.cfg.buckets.gradient_as_bucket_view)
    throw UsageError("register_flat: no gradient buffer, and " + I.cfg.name_of("buckets.gradient_as_bucket_view") + " is off");
  std::vector<const FlatEntry*> by_offset;
  for (const auto& e : flat.table) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](auto a, auto b) { return a->offset < b->offset; });
  std::size_t end = 0;
  const FlatEntry* prev = nullptr;
  for (const auto* e : by_offset) {
    const auto n = std::size_t(numel(e->shape));
    if (e->offset < end)
      throw UsageError("register_flat: '" + e->name + "' at element " + std::to_string(e->offset) + " overlaps '" + prev->name + "'");
    if (e->offset + n > flat.numel)
      throw UsageError("register_flat: '" + e->name + "' ends at element " + std::to_string(e->offset + n) + ", past the buffer's " +
                       std::to_string(flat.numel));
    end = e->offset + n;
    prev = e;
  }
  const std::size_t es = dtype_size(flat.dtype);
  std::vector<Param> out;
  ++I.recipe_paused;  // its parameters are registered again by register_flat, not one by one
  try {
    for (const auto& e : flat.table) {
      ParamSpec spec{e.name, e.shape, flat.dtype, flat.device, static_cast<std::byte*>(flat.params) + e.offset * es};
      if (flat.grads) spec.grad = static_cast<std::byte*>(flat.grads) + e.offset * es;
      out.push_back(register_param(std::move(spec)));
      I.semantics->flat.entries.push_back({e.offset, std::size_t(numel(e.shape)), out.back()});
    }
  } catch (...) {
    --I.recipe_paused;
    throw;
  }
  --I.recipe_paused;
  I.remember([flat](Runtime& rt) { rt.register_flat(flat); });
  std::sort(I.semantics->flat.entries.begin(), I.semantics->flat.entries.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  return out;
}

void Runtime::grads_ready(std::size_t offset, std::size_t count) {
  auto& I = *impl_;
  if (I.semantics->flat.entries.empty()) throw UsageError("grads_ready: no flat buffer registered (register_flat)");
  const std::size_t end = offset + count;
  std::vector<Param> ready;
  for (const auto& e : I.semantics->flat.entries) {
    const std::size_t e_end = e.offset + e.numel;
    if (e_end <= offset || e.offset >= end) continue;
    if (e.offset < offset || e_end > end)
      throw UsageError("grads_ready: elements [" + std::to_string(offset) + ", " + std::to_string(end) + ") cut parameter '" +
                       I.name_of(e.param.index) + "' ([" + std::to_string(e.offset) + ", " + std::to_string(e_end) +
                       ")): report whole parameters");
    ready.push_back(e.param);
  }
  // Backward produces the later parameters first: report them in that order.
  for (auto it = ready.rbegin(); it != ready.rend(); ++it) grad_ready(*it);
}

}  // namespace shardflow
