// Shared test plumbing: run N ranks as threads and collect what each one threw.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "shardflow/shardflow.hpp"

namespace shardflow::test {

// Runs fn(rank) on `n` threads; returns each rank's exception (null if it returned normally).
inline std::vector<std::exception_ptr> run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

inline std::string message_of(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

// Fails the test with the rank's message if any rank threw.
inline void require_all_ok(const std::vector<std::exception_ptr>& errors) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    INFO("rank " << r << ": " << message_of(errors[r]));
    REQUIRE(!errors[r]);
  }
}

template <class E>
bool is(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
}

// A collective as the tests issue them (tag "test").
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

// ||a - b|| / ||b||
inline double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace shardflow::test
