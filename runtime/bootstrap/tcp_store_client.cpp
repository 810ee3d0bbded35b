// The store's client: blocking calls built from Asio's asynchronous operations run with a deadline
// (io_context::run_for), so no call can hang past its timeout.
#include <utility>  // Boost 1.74 Asio with C++20 uses std::exchange without including it

#include <boost/asio.hpp>

#include <thread>

#include "runtime/bootstrap/net_address.hpp"
#include "runtime/bootstrap/store_protocol.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/store.hpp"

namespace shardflow {

namespace asio = boost::asio;
using asio::ip::tcp;

struct TcpStoreClient::Impl {
  asio::io_context io;
  tcp::socket socket{io};
  std::string where;  // "host:port", for errors
  std::chrono::milliseconds timeout;

  // Runs `start` (which must call `done(ec)` exactly once) for at most `limit`.
  template <class Start>
  void run(const char* what, std::chrono::milliseconds limit, Start start) {
    bool finished = false;
    boost::system::error_code result;
    io.restart();
    start([&](boost::system::error_code ec) {
      finished = true;
      result = ec;
    });
    io.run_for(limit);
    if (!finished) {
      boost::system::error_code ignored;
      socket.close(ignored);  // cancels the operation; let its handler run before leaving
      io.restart();
      io.run();
      throw TimeoutError("store at " + where + ": " + what + " did not complete within " +
                         std::to_string(limit.count()) + " ms");
    }
    if (result) throw CommError("store at " + where + ": " + what + " failed: " + result.message());
  }

  // One request, one reply. Returns the reply's payload; a server-side error becomes `Err`.
  template <class Err = CommError>
  std::string transact(const std::string& frame, const char* what, std::chrono::milliseconds limit) {
    auto [ok, payload] = exchange(frame, what, limit);
    if (!ok) throw Err("store at " + where + ": " + what + ": " + payload);
    return payload;
  }

  // One request and its reply: whether the server said ok, and its payload.
  std::pair<bool, std::string> exchange(const std::string& frame, const char* what, std::chrono::milliseconds limit) {
    std::uint8_t header[4];
    std::string body;
    run(what, limit, [&](auto done) {
      asio::async_write(socket, asio::buffer(frame), [&, done](boost::system::error_code ec, std::size_t) {
        if (ec) return done(ec);
        asio::async_read(socket, asio::buffer(header), [&, done](boost::system::error_code e, std::size_t) {
          if (e) return done(e);
          std::uint32_t len;
          std::memcpy(&len, header, 4);
          body.assign(len, '\0');
          asio::async_read(socket, asio::buffer(body), [done](boost::system::error_code e2, std::size_t) { done(e2); });
        });
      });
    });
    store::Reader r(body);
    std::uint8_t status = 1;
    std::string payload;
    if (!r.u8(status) || !r.str(payload)) throw CommError("store at " + where + ": malformed reply to " + what);
    return {status == 0, std::move(payload)};
  }
};

TcpStoreClient::TcpStoreClient(const std::string& host, std::uint16_t port, const std::string& token,
                               std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>()) {
  auto& I = *impl_;
  I.where = host + ":" + std::to_string(port);
  I.timeout = timeout;
  boost::system::error_code ec;
  // A host name (MASTER_ADDR=node0) resolves once, here: a store address does not move mid-job.
  const auto addr = asio::ip::make_address(net::resolve_ipv4(host), ec);
  if (ec) throw UsageError("TcpStoreClient: '" + host + "' is not an IP address");
  // The server may not be up yet (rank 0 still starting): retry until the timeout.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    try {
      I.run("connect", std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()),
            [&](auto done) { I.socket.async_connect(tcp::endpoint(addr, port), done); });
      break;
    } catch (const CommError&) {
      if (std::chrono::steady_clock::now() + std::chrono::milliseconds(50) >= deadline)
        throw TimeoutError("store at " + I.where + ": nothing accepted connections within " +
                           std::to_string(timeout.count()) + " ms");
      boost::system::error_code ignored;
      I.socket.close(ignored);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  I.transact(store::Writer().u8(store::hello).str(token).frame(), "hello", timeout);
}

TcpStoreClient::~TcpStoreClient() = default;

void TcpStoreClient::set(const std::string& key, const std::string& value) {
  impl_->transact(store::Writer().u8(store::set).str(key).str(value).frame(), "set", impl_->timeout);
}

std::string TcpStoreClient::get(const std::string& key) {
  // One round trip when the key is there, as it usually is by the time it is asked for; only a
  // missing key costs the wait and a second read.
  const std::string frame = store::Writer().u8(store::get).str(key).frame();
  if (auto [ok, value] = impl_->exchange(frame, "get", impl_->timeout); ok) return value;
  wait({key}, impl_->timeout);
  return impl_->transact(frame, "get", impl_->timeout);
}

std::int64_t TcpStoreClient::add(const std::string& key, std::int64_t delta) {
  return std::stoll(impl_->transact(store::Writer().u8(store::add).str(key).i64(delta).frame(), "add", impl_->timeout));
}

bool TcpStoreClient::check(const std::vector<std::string>& keys) {
  store::Writer w;
  w.u8(store::check).u32(std::uint32_t(keys.size()));
  for (const auto& k : keys) w.str(k);
  return impl_->transact(w.frame(), "check", impl_->timeout) == "1";
}

void TcpStoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  store::Writer w;
  w.u8(store::wait).u32(std::uint32_t(keys.size()));
  for (const auto& k : keys) w.str(k);
  w.i64(timeout.count());
  // The server answers at its own deadline with the missing keys; ours only catches a dead server.
  impl_->transact<TimeoutError>(w.frame(), "wait", timeout + std::chrono::seconds(5));
}

bool TcpStoreClient::remove(const std::string& key) {
  return impl_->transact(store::Writer().u8(store::remove).str(key).frame(), "delete", impl_->timeout) == "1";
}

void TcpStoreClient::set_timeout(std::chrono::milliseconds timeout) { impl_->timeout = timeout; }

std::string TcpStoreClient::where() const { return "store at " + impl_->where; }

}  // namespace shardflow
