// A collective as the tests issue them (tag "test"); no doctest here, so the GPU programs (plain
// mains that exit 77 without a device) use it too.
#pragma once

#include <cstddef>

#include "shardflow/communicator.hpp"

namespace shardflow::test {

inline CollectiveOp make(CollectiveKind k, const void* send, void* recv, std::size_t count, float scale = 1.0f,
                         int root = 0) {
  CollectiveOp op;
  op.kind = k;
  op.send = send;
  op.recv = recv;
  op.count = count;
  op.scale = scale;
  op.root = root;
  op.tag = "test";
  return op;
}

}  // namespace shardflow::test
