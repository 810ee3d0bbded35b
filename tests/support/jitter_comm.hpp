// A communicator that delays every completion by a random 0..max_us microseconds on the inner
// one's thread, so that messages between the actors (and, around one lane of two-level
// collectives, the collectives themselves) complete in ever different interleavings.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "forwarding_comm.hpp"

namespace shardflow::test {

class JitterComm final : public ForwardingComm {
 public:
  JitterComm(std::shared_ptr<Communicator> inner, unsigned seed, int max_us = 400) : ForwardingComm(std::move(inner)), rng_(seed), max_us_(max_us) {}
  std::string backend_name() const override { return "jitter(" + inner_->backend_name() + ")"; }
  void submit(CollectiveOp op, CollectiveDone done) override {
    int delay;
    {
      std::lock_guard lock(mu_);
      delay = std::uniform_int_distribution<int>(0, max_us_)(rng_);
    }
    inner_->submit(std::move(op), [delay, done = std::move(done)](std::exception_ptr e) {
      std::this_thread::sleep_for(std::chrono::microseconds(delay));
      done(e);
    });
  }

 private:
  std::mutex mu_;
  std::mt19937 rng_;
  int max_us_;
};

}  // namespace shardflow::test
