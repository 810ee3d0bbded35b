// Every error shardflow reports names what it is about (parameter, rank, bucket, collective) and,
// where there is one, the fix. They derive from std::runtime_error so trainers can catch broadly.
#pragma once

#include <stdexcept>
#include <string>

namespace shardflow {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The trainer called the API wrongly: unknown parameter, marked twice, bad config value.
struct UsageError : Error {
  using Error::Error;
};
// The ranks disagree: different parameter lists, mismatched collectives.
struct MismatchError : Error {
  using Error::Error;
};
// A wait that involves another rank ran past Config::timeouts.collective, or a peer failed.
struct TimeoutError : Error {
  using Error::Error;
};
struct CommError : Error {
  using Error::Error;
};

}  // namespace shardflow
