// The errors of shardflow/actor.hpp: a caf::error of category "shardflow" carries the exception's
// type as its code and its message as its context, so an answer can be turned back into the
// exception the blocking API throws.
#include <caf/deep_to_string.hpp>
#include <caf/make_message.hpp>
#include <caf/message.hpp>

#include "shardflow/actor.hpp"

namespace shardflow {

std::string to_string(errc code) {
  switch (code) {
    case errc::usage: return "usage";
    case errc::mismatch: return "mismatch";
    case errc::timeout: return "timeout";
    case errc::comm: return "comm";
    case errc::error: break;
  }
  return "error";
}

caf::error make_error(errc code, std::string what) {
  return caf::error(static_cast<std::uint8_t>(code), caf::atom("shardflow"), caf::make_message(std::move(what)));
}

caf::error to_error(const std::exception& e) {
  // Most derived first: every shardflow error is an Error.
  if (dynamic_cast<const UsageError*>(&e)) return make_error(errc::usage, e.what());
  if (dynamic_cast<const MismatchError*>(&e)) return make_error(errc::mismatch, e.what());
  if (dynamic_cast<const TimeoutError*>(&e)) return make_error(errc::timeout, e.what());
  if (dynamic_cast<const CommError*>(&e)) return make_error(errc::comm, e.what());
  return make_error(errc::error, e.what());
}

std::string what(const caf::error& e) {
  if (e.category() == caf::atom("shardflow") && e.context().match_elements<std::string>()) return e.context().get_as<std::string>(0);
  return caf::to_string(e);
}

void rethrow(const caf::error& e) {
  const auto text = what(e);
  if (e.category() != caf::atom("shardflow")) throw CommError("rank actor: " + text);  // an actor gone, a broken promise
  switch (static_cast<errc>(e.code())) {
    case errc::usage: throw UsageError(text);
    case errc::mismatch: throw MismatchError(text);
    case errc::timeout: throw TimeoutError(text);
    case errc::comm: throw CommError(text);
    case errc::error: break;
  }
  throw Error(text);
}

}  // namespace shardflow
