// The Store on etcd's v3 JSON gateway (Note [A store no node owns], shardflow/etcd_store.hpp).
#include "shardflow/etcd_store.hpp"

#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "runtime/bootstrap/etcd_http.hpp"

namespace shardflow {

using etcd::Clock;
using json = nlohmann::json;

namespace {

std::string random_id() {
  std::random_device rd;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%08x%08x", rd(), rd());
  return buf;
}

std::int64_t as_int(const json& j, const char* field) {
  if (!j.contains(field)) return 0;
  const auto& v = j[field];
  return v.is_string() ? std::stoll(v.get<std::string>()) : v.get<std::int64_t>();
}

std::string ms(std::chrono::milliseconds t) { return std::to_string(t.count()) + " ms"; }

// Note [One login per process]
// etcd checks a password with bcrypt (~50-100 ms of a member's CPU on the 2-core VM), and a rank
// opens several store clients (the backend's agreement, Gloo's rendezvous, the shared-memory
// segment's): measured, 1,000 clients logging in at once kept a 3-member etcd busy for over a
// minute. A member's token is valid for any client of this process, so the logins are shared:
// one per member, user and password in a process; a client that finds the token expired (etcd
// drops idle simple tokens after 5 minutes) logs in again and shares the new one.
class TokenCache {
 public:
  std::string get(const std::string& who) {
    std::lock_guard lock(mu_);
    const auto it = tokens_.find(who);
    return it == tokens_.end() ? std::string() : it->second;
  }
  void put(const std::string& who, const std::string& token) {
    std::lock_guard lock(mu_);
    tokens_[who] = token;
  }
  void drop(const std::string& who, const std::string& token) {
    std::lock_guard lock(mu_);
    if (const auto it = tokens_.find(who); it != tokens_.end() && it->second == token) tokens_.erase(it);
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::string> tokens_;
};

TokenCache& tokens() {
  static TokenCache cache;
  return cache;
}

// Note [Members that answer, members that do not]: what this process knows of the members, for
// every store it makes (the launcher's, its heartbeat's, a round's, a rank's rendezvous), by
// endpoint, so stores listing the members in another order agree.
// - The member that answered last is asked first by a store made later, instead of the first
//   endpoint, which may be the one that is gone.
// - A member that gave no answer at all within a request's share (its host cut off, SIGSTOPped)
//   is passed over for kQuietFor while another member may answer: a store moving on after quick
//   errors from the others (an election's "leader changed") went back to it, and waited its
//   share there again each time round (a second each at the soak's 3 s calls: a node's heartbeat
//   could stall past the timeout that way). Once every other member is quiet too, it is asked
//   again, and an answer clears it.
constexpr std::chrono::seconds kQuietFor{10};

class MemberMemory {
 public:
  std::string answered_last() const {
    std::lock_guard lock(mu_);
    return answered_;
  }
  void answered(const std::string& endpoint) {
    std::lock_guard lock(mu_);
    answered_ = endpoint;
    quiet_until_.erase(endpoint);
  }
  void no_answer(const std::string& endpoint, Clock::time_point now) {
    std::lock_guard lock(mu_);
    quiet_until_[endpoint] = now + kQuietFor;
  }
  bool quiet(const std::string& endpoint, Clock::time_point now) const {
    std::lock_guard lock(mu_);
    const auto it = quiet_until_.find(endpoint);
    return it != quiet_until_.end() && now < it->second;
  }

 private:
  mutable std::mutex mu_;
  std::string answered_;
  std::map<std::string, Clock::time_point> quiet_until_;
};

MemberMemory& members_known() {
  static MemberMemory memory;
  return memory;
}

}  // namespace

struct EtcdStore::Impl {
  EtcdOptions o;
  std::vector<std::unique_ptr<etcd::Connection>> members;
  std::size_t current = 0;
  std::string token;  // the current member's login (simple tokens are each member's own)
  std::string where;
  const std::string client_id = random_id();
  std::uint64_t adds = 0;
  std::int64_t lease = 0;
  Clock::time_point lease_renew{};

  std::string key(const std::string& k) const { return etcd::base64(o.root + k); }
  Clock::time_point deadline() const { return Clock::now() + o.timeout; }
  // One request's deadline: etcd answers in milliseconds, also during an election (~0.5-1 s), so
  // a member that has not answered in its share of the call's time (at most 5 s) is taken as gone
  // (SIGSTOPped, cut off) and the next one is asked, while the call's own deadline bounds the
  // retries. The share, not the whole: a member whose host is cut off drops the packets, and a
  // call that gave it all its time would fail with the quorum still answering on the others
  // (scripts/soak.py --hosts 3, node 0's host cut off, found it).
  Clock::time_point request_deadline() const {
    const auto share = o.timeout / std::max<std::size_t>(1, members.size());
    return Clock::now() + std::min<std::chrono::milliseconds>(share, std::chrono::seconds(5));
  }

  // etcd's answer to a call that it refused: the job's mistakes are UsageErrors naming the fix.
  [[noreturn]] void refused(const char* what, const etcd::Reply& r) {
    const std::string msg = r.body.value("error", r.body.value("message", r.body.dump()));
    // A member between leaders, or cut off from the quorum, says so (gRPC Unavailable, 14, or
    // DeadlineExceeded, 4): the next member may answer.
    const int code = r.body.value("code", 0);
    if (code == 14 || code == 4 || msg.find("leader changed") != std::string::npos || msg.find("no leader") != std::string::npos)
      throw etcd::TransportError(where + ": " + what + ": " + msg);
    if (msg.find("authentication is not enabled") != std::string::npos)
      throw UsageError(where + ": authentication is not enabled, so the job's token would gate nothing: enable it (etcdctl user add root; "
                       "etcdctl user grant-role root root; etcdctl user add " + o.user + " with the job's token as its password, a role "
                       "with readwrite on prefix " + o.root + "; etcdctl auth enable)");
    if (msg.find("invalid user ID or password") != std::string::npos)
      throw UsageError(where + ": etcd refused user '" + o.user + "' with the job's token as password (is the token the one etcd's user was made with?)");
    if (msg.find("permission denied") != std::string::npos)
      throw UsageError(where + ": " + what + ": user '" + o.user + "' may not write under '" + o.root + "' (grant its role readwrite on that prefix)");
    throw CommError(where + ": " + what + ": " + msg);
  }

  // Note [One login per process]: `fresh` skips the shared token (it was refused).
  std::string who(const etcd::Connection& c) const { return c.endpoint() + "\n" + o.user + "\n" + o.password; }
  void login(etcd::Connection& c, bool fresh = false) {
    const std::string who = this->who(c);
    if (fresh) tokens().drop(who, token);
    if (token = tokens().get(who); !token.empty()) return;
    const auto r = c.post("/v3/auth/authenticate", json{{"name", o.user}, {"password", o.password}}.dump(), "", request_deadline());
    if (r.status != 200 || !r.body.contains("token")) refused("login", r);
    token = r.body["token"].get<std::string>();
    tokens().put(who, token);
  }

  // Runs `f` on a member: the current one, else the next that answers, until `until`. A member
  // that forgot this client's login (its simple tokens expire, and each member has its own) is
  // logged in to again.
  template <class F>
  auto on_member(const char* what, Clock::time_point until, F f) {
    std::string last;
    for (std::size_t attempt = 0;; ++attempt) {
      auto& c = *members[current];
      try {
        if (token.empty()) login(c);
        auto result = f(c);  // every call returns what it read or did
        if (attempt > 0) members_known().answered(c.endpoint());
        return result;
      } catch (const etcd::TransportError& e) {
        last = e.what();
        tokens().drop(who(c), token);  // a watch refused for an expired token ends here too
        token.clear();
        if (dynamic_cast<const etcd::NoAnswer*>(&e)) members_known().no_answer(c.endpoint(), Clock::now());
        const std::size_t was = current;
        current = next_member();
        if (Clock::now() >= until)
          throw TimeoutError(where + ": " + what + " did not complete within " + ms(o.timeout) + " (last: " + last + ")");
        if (current <= was) std::this_thread::sleep_for(std::chrono::milliseconds(50));  // every member tried: a breath
      }
    }
  }

  // The member after the current one that is not quiet (Note [Members that answer, members that
  // do not]); the very next when every other one is.
  std::size_t next_member() const {
    const std::size_t n = members.size();
    const auto now = Clock::now();
    for (std::size_t k = 1; k < n; ++k)
      if (const std::size_t m = (current + k) % n; !members_known().quiet(members[m]->endpoint(), now)) return m;
    return (current + 1) % n;
  }

  // One unary call: its reply's body when etcd took it.
  json call(etcd::Connection& c, const char* what, const std::string& path, const json& body) {
    auto r = c.post(path, body.dump(), token, request_deadline());
    if (r.status != 200 && r.body.value("error", std::string()).find("invalid auth token") != std::string::npos) {
      login(c, /*fresh=*/true);
      r = c.post(path, body.dump(), token, request_deadline());
    }
    if (r.status != 200) refused(what, r);
    return std::move(r.body);
  }

  // The key's value and mod_revision, or the store's revision when it is absent.
  struct Seen {
    bool present = false;
    std::string value;
    std::int64_t mod_revision = 0;
    std::int64_t revision = 0;
  };
  Seen range(etcd::Connection& c, const std::string& k) {
    const auto r = call(c, "get", "/v3/kv/range", {{"key", key(k)}});
    Seen s;
    s.revision = as_int(r["header"], "revision");
    if (r.contains("kvs") && !r["kvs"].empty()) {
      const auto& kv = r["kvs"][0];
      s.present = true;
      s.value = etcd::unbase64(kv.value("value", std::string()));
      s.mod_revision = as_int(kv, "mod_revision");
    }
    return s;
  }

  // The key's value once it exists: a range, then a watch from the revision that range saw. A
  // watch is renewed every few seconds (a range and a new watch): a member that stopped answering
  // mid-watch (SIGSTOP, a cut link) says nothing, and would otherwise hold the wait to its end.
  std::optional<std::string> value_by(const std::string& k, Clock::time_point until) {
    return on_member("get", until + std::chrono::seconds(5), [&](etcd::Connection& c) -> std::optional<std::string> {
      for (;;) {
        const auto seen = range(c, k);
        if (seen.present) return seen.value;
        if (Clock::now() >= until) return std::nullopt;
        const auto round = std::min(until, request_deadline());
        c.open_stream("/v3/watch", json{{"create_request", {{"key", key(k)}, {"start_revision", std::to_string(seen.revision + 1)}}}}.dump(), token, round);
        while (auto msg = c.next(round)) {
          if (msg->contains("error")) throw etcd::TransportError(where + ": watch of '" + k + "': " + msg->dump());
          const auto& res = (*msg)["result"];
          if (!res.contains("events")) continue;
          for (const auto& ev : res["events"])
            if (ev.value("type", std::string("PUT")) == "PUT") return etcd::unbase64(ev["kv"].value("value", std::string()));
        }
      }
    });
  }

  // The lease an add's own key lives under: long enough to outlast any retry of that add.
  std::int64_t lease_for_adds(etcd::Connection& c) {
    if (lease != 0 && Clock::now() < lease_renew) return lease;
    const auto ttl = std::max<std::int64_t>(120, 2 * std::chrono::duration_cast<std::chrono::seconds>(o.timeout).count());
    const auto r = call(c, "add", "/v3/lease/grant", {{"TTL", std::to_string(ttl)}});
    lease = as_int(r, "ID");
    lease_renew = Clock::now() + std::chrono::seconds(ttl / 2);
    return lease;
  }
};

EtcdStore::EtcdStore(EtcdOptions options) : impl_(std::make_unique<Impl>()) {
  auto& I = *impl_;
  I.o = std::move(options);
  if (I.o.endpoints.empty()) throw UsageError("EtcdStore: no endpoints given (--rdzv-endpoints host:2379[,host:2379...])");
  if (I.o.password.empty()) throw UsageError("EtcdStore: an empty token: etcd's authentication must gate the job's store");
  if (I.o.root.empty() || I.o.root.back() != '/') I.o.root += '/';
  for (const auto& e : I.o.endpoints) {
    I.members.push_back(std::make_unique<etcd::Connection>(e));
    I.where += (I.where.empty() ? "etcd at " : ",") + I.members.back()->endpoint();
  }
  const std::string first = members_known().answered_last();
  for (std::size_t m = 0; m < I.members.size(); ++m)
    if (I.members[m]->endpoint() == first) I.current = m;
  I.on_member("login", I.deadline(), [&](etcd::Connection&) { return 0; });
}

EtcdStore::~EtcdStore() = default;

void EtcdStore::set(const std::string& key, const std::string& value) {
  auto& I = *impl_;
  const auto until = I.deadline();
  I.on_member("set", until, [&](etcd::Connection& c) {
    return I.call(c, "set", "/v3/kv/put", {{"key", I.key(key)}, {"value", etcd::base64(value)}});
  });
}

std::string EtcdStore::get(const std::string& key) {
  auto& I = *impl_;
  if (auto v = I.value_by(key, I.deadline())) return *v;
  throw TimeoutError(I.where + ": key '" + key + "' did not appear within " + ms(I.o.timeout));
}

std::int64_t EtcdStore::add(const std::string& key, std::int64_t delta) {
  auto& I = *impl_;
  const auto until = I.deadline();
  // add(k, 0) reads a counter (the launchers poll each other's heartbeats so, every interval): a
  // range, not a transaction that would write the same value back and an add key beside it.
  if (delta == 0)
    return I.on_member("add", until, [&](etcd::Connection& c) -> std::int64_t {
      const auto seen = I.range(c, key);
      return seen.present ? std::stoll(seen.value) : 0;
    });
  const std::string mine = ".adds/" + I.client_id + "/" + std::to_string(I.adds++);
  bool sent = false;  // a transaction went out: after a broken connection, it may have been applied
  return I.on_member("add", until, [&](etcd::Connection& c) -> std::int64_t {
    for (;;) {
      if (sent)
        if (const auto done = I.range(c, mine); done.present) return std::stoll(done.value);
      const auto seen = I.range(c, key);
      const std::int64_t now = seen.present ? std::stoll(seen.value) : 0;
      const std::string next = std::to_string(now + delta);
      const json compare = seen.present ? json{{"key", I.key(key)}, {"target", "MOD"}, {"result", "EQUAL"}, {"mod_revision", std::to_string(seen.mod_revision)}}
                                        : json{{"key", I.key(key)}, {"target", "VERSION"}, {"result", "EQUAL"}, {"version", "0"}};
      const json txn = {{"compare", json::array({compare})},
                        {"success", json::array({json{{"request_put", {{"key", I.key(key)}, {"value", etcd::base64(next)}}}},
                                                 json{{"request_put", {{"key", I.key(mine)}, {"value", etcd::base64(next)}, {"lease", std::to_string(I.lease_for_adds(c))}}}}})}};
      sent = true;
      if (I.call(c, "add", "/v3/kv/txn", txn).value("succeeded", false)) return now + delta;
      if (Clock::now() >= until) throw TimeoutError(I.where + ": add to '" + key + "' lost every race for " + ms(I.o.timeout));
    }
  });
}

bool EtcdStore::check(const std::vector<std::string>& keys) {
  auto& I = *impl_;
  if (keys.empty()) return true;
  json compare = json::array();
  for (const auto& k : keys) compare.push_back({{"key", I.key(k)}, {"target", "VERSION"}, {"result", "GREATER"}, {"version", "0"}});
  const auto until = I.deadline();
  return I.on_member("check", until, [&](etcd::Connection& c) {
    return I.call(c, "check", "/v3/kv/txn", {{"compare", compare}}).value("succeeded", false);
  });
}

void EtcdStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  auto& I = *impl_;
  const auto until = Clock::now() + timeout;
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (!I.value_by(k, until)) missing.push_back(k);
  if (missing.empty()) return;
  std::string names;
  for (const auto& k : missing) names += (names.empty() ? "'" : ", '") + k + "'";
  throw TimeoutError(I.where + ": wait: " + names + " still missing after " + ms(timeout));
}

bool EtcdStore::remove(const std::string& key) {
  auto& I = *impl_;
  const auto until = I.deadline();
  return I.on_member("delete", until, [&](etcd::Connection& c) {
    return as_int(I.call(c, "delete", "/v3/kv/deleterange", {{"key", I.key(key)}}), "deleted") > 0;
  });
}

void EtcdStore::set_timeout(std::chrono::milliseconds timeout) { impl_->o.timeout = timeout; }

std::string EtcdStore::where() const { return impl_->where; }

}  // namespace shardflow
