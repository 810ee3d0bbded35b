// The store's server: one Asio io_context on its own thread, so the key-value map needs no locks.
// Malformed, oversized or unauthenticated requests get an error reply and lose their connection;
// everyone else keeps being served.
#include <utility>  // Boost 1.74 Asio with C++20 uses std::exchange without including it

#include <boost/asio.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <thread>

#include "runtime/bootstrap/store_protocol.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/store.hpp"

namespace shardflow {

namespace asio = boost::asio;
using asio::ip::tcp;

struct TcpStoreServer::Impl {
  struct Session;
  struct Waiter {
    std::shared_ptr<Session> session;
    std::vector<std::string> keys;
    std::unique_ptr<asio::steady_timer> timer;
    bool done = false;
  };

  StoreServerOptions opt;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  std::map<std::string, std::string> kv;
  std::size_t kv_bytes = 0;  // keys and values, against opt.max_bytes
  std::vector<std::shared_ptr<Waiter>> waiters;
  std::thread thread;

  bool present(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (!kv.count(k)) return false;
    return true;
  }
  void wake_waiters();
  void accept();

  // kv[key] = value within the limits; else why not (the store unchanged).
  std::string put(const std::string& key, std::string value) {
    auto it = kv.find(key);
    const std::size_t was = it == kv.end() ? 0 : key.size() + it->second.size();
    if (it == kv.end() && kv.size() >= opt.max_keys)
      return "the store holds " + std::to_string(kv.size()) + " keys (limit " + std::to_string(opt.max_keys) + "); '" + key + "' refused";
    const std::size_t after = kv_bytes - was + key.size() + value.size();
    if (after > opt.max_bytes)
      return "setting '" + key + "' would make the store hold " + std::to_string(after) + " bytes (limit " + std::to_string(opt.max_bytes) + ")";
    kv_bytes = after;
    kv[key] = std::move(value);
    return {};
  }
  bool erase(const std::string& key) {
    auto it = kv.find(key);
    if (it == kv.end()) return false;
    kv_bytes -= key.size() + it->second.size();
    kv.erase(it);
    return true;
  }
};

struct TcpStoreServer::Impl::Session : std::enable_shared_from_this<Session> {
  Session(Impl& s, tcp::socket sock) : srv(s), socket(std::move(sock)), stall(s.io) {}

  Impl& srv;
  tcp::socket socket;
  asio::steady_timer stall;
  std::uint8_t header[4];
  std::string body;
  bool authed = false;

  void close() {
    boost::system::error_code ignored;
    socket.close(ignored);
    stall.cancel();
  }

  void read_frame() {
    auto self = shared_from_this();
    asio::async_read(socket, asio::buffer(header), [self](boost::system::error_code ec, std::size_t) {
      if (ec) return self->close();
      std::uint32_t len;
      std::memcpy(&len, self->header, 4);
      const std::size_t limit = self->authed ? self->srv.opt.max_frame_bytes : self->srv.opt.max_hello_bytes;
      if (len == 0 || len > limit)
        return self->reply(false, "frame of " + std::to_string(len) + " bytes refused (limit " + std::to_string(limit) +
                                      (self->authed ? ")" : " before the token)"), true);
      self->body.assign(len, '\0');
      // Between frames a client may idle; inside a frame it may not stall.
      self->stall.expires_after(self->srv.opt.stall_timeout);
      self->stall.async_wait([weak = std::weak_ptr<Session>(self)](boost::system::error_code e) {
        if (auto s = weak.lock(); s && !e) s->close();
      });
      asio::async_read(self->socket, asio::buffer(self->body), [self](boost::system::error_code e, std::size_t) {
        self->stall.cancel();
        if (e) return self->close();
        self->handle();
      });
    });
  }

  void reply(bool ok, const std::string& payload, bool close_after = false) {
    auto out = std::make_shared<std::string>(store::Writer().u8(ok ? 0 : 1).str(payload).frame());
    auto self = shared_from_this();
    asio::async_write(socket, asio::buffer(*out), [self, out, close_after](boost::system::error_code ec, std::size_t) {
      if (ec || close_after) return self->close();
      self->read_frame();
    });
  }

  void handle() {
    store::Reader r(body);
    std::uint8_t op = 0;
    auto malformed = [&] { reply(false, "malformed request", true); };
    if (!r.u8(op)) return malformed();
    if (!authed && op != store::hello) return reply(false, "the first request must be HELLO with the job token", true);
    std::string key, value;
    switch (op) {
      case store::hello:
        if (!r.str(value) || !r.done()) return malformed();
        if (srv.opt.token.empty() || value != srv.opt.token) return reply(false, "wrong token", true);
        authed = true;
        return reply(true, "");
      case store::set:
        if (!r.str(key) || !r.str(value) || !r.done()) return malformed();
        if (auto why = srv.put(key, std::move(value)); !why.empty()) return reply(false, why);
        srv.wake_waiters();
        return reply(true, "");
      case store::get: {
        if (!r.str(key) || !r.done()) return malformed();
        auto it = srv.kv.find(key);
        if (it == srv.kv.end()) return reply(false, "no key '" + key + "'");
        return reply(true, it->second);
      }
      case store::add: {
        std::int64_t delta;
        if (!r.str(key) || !r.i64(delta) || !r.done()) return malformed();
        std::int64_t v = 0;
        if (auto it = srv.kv.find(key); it != srv.kv.end()) {
          try {
            std::size_t used = 0;
            v = std::stoll(it->second, &used);
            if (used != it->second.size()) throw std::invalid_argument(key);
          } catch (const std::exception&) {
            return reply(false, "key '" + key + "' does not hold a counter");
          }
        }
        if (__builtin_add_overflow(v, delta, &v)) return reply(false, "key '" + key + "': adding " + std::to_string(delta) + " overflows");
        if (auto why = srv.put(key, std::to_string(v)); !why.empty()) return reply(false, why);
        srv.wake_waiters();
        return reply(true, std::to_string(v));
      }
      case store::check:
      case store::wait: {
        std::uint32_t n;
        if (!r.u32(n) || n > body.size()) return malformed();
        std::vector<std::string> keys(n);
        for (auto& k : keys)
          if (!r.str(k)) return malformed();
        std::int64_t timeout_ms = 0;
        if (op == store::wait && !r.i64(timeout_ms)) return malformed();
        if (!r.done()) return malformed();
        if (op == store::check) return reply(true, srv.present(keys) ? "1" : "0");
        if (srv.present(keys)) return reply(true, "");
        auto w = std::make_shared<Waiter>();
        w->session = shared_from_this();
        w->keys = std::move(keys);
        // Clamped to a day: a huge timeout would overflow the clock's nanoseconds.
        timeout_ms = std::clamp<std::int64_t>(timeout_ms, 0, 24 * 3600 * 1000);
        w->timer = std::make_unique<asio::steady_timer>(srv.io, std::chrono::milliseconds(timeout_ms));
        w->timer->async_wait([w, this](boost::system::error_code e) {
          if (e || w->done) return;
          w->done = true;
          std::string missing;
          for (const auto& k : w->keys)
            if (!srv.kv.count(k)) missing += (missing.empty() ? "" : ", ") + k;
          w->session->reply(false, "timeout waiting for " + missing);
        });
        srv.waiters.push_back(std::move(w));
        return;
      }
      case store::remove:
        if (!r.str(key) || !r.done()) return malformed();
        return reply(true, srv.erase(key) ? "1" : "0");
      default:
        return reply(false, "unknown request " + std::to_string(op), true);
    }
  }
};

void TcpStoreServer::Impl::wake_waiters() {
  std::vector<std::shared_ptr<Waiter>> keep;
  for (auto& w : waiters) {
    if (w->done) continue;
    if (present(w->keys)) {
      w->done = true;
      w->timer->cancel();
      w->session->reply(true, "");
    } else {
      keep.push_back(w);
    }
  }
  waiters = std::move(keep);
}

void TcpStoreServer::Impl::accept() {
  acceptor.async_accept([this](boost::system::error_code ec, tcp::socket s) {
    if (ec) return;  // the acceptor closed: shutting down
    std::make_shared<Session>(*this, std::move(s))->read_frame();
    accept();
  });
}

TcpStoreServer::TcpStoreServer(StoreServerOptions options) : impl_(std::make_unique<Impl>()) {
  auto& I = *impl_;
  I.opt = std::move(options);
  if (I.opt.token.empty()) throw UsageError("TcpStoreServer: a per-job token is required (StoreServerOptions::token)");
  boost::system::error_code ec;
  const auto addr = asio::ip::make_address(I.opt.host, ec);
  if (ec) throw UsageError("TcpStoreServer: '" + I.opt.host + "' is not an IP address");
  const tcp::endpoint ep(addr, I.opt.port);
  I.acceptor.open(ep.protocol());
  I.acceptor.set_option(tcp::acceptor::reuse_address(true));
  I.acceptor.bind(ep, ec);
  if (ec) throw CommError("TcpStoreServer: cannot listen on " + I.opt.host + ":" + std::to_string(I.opt.port) + ": " + ec.message());
  I.acceptor.listen();
  I.accept();
  I.thread = std::thread([&I] { I.io.run(); });
}

TcpStoreServer::~TcpStoreServer() {
  impl_->io.stop();  // pending handlers (and their sessions and sockets) go with the io_context
  impl_->thread.join();
}

std::uint16_t TcpStoreServer::port() const { return impl_->acceptor.local_endpoint().port(); }

}  // namespace shardflow
