// The Gloo backend: rendezvous through the shardflow store, every collective checked element by
// element at worlds 2 and 3 (ranks are threads here, each with its own Gloo context and TCP
// connections over loopback), and DDP / ZeRO training over it equal to the in-process backend.
#include <doctest/doctest.h>

#include <numeric>

#include "support/helpers.hpp"
#include "kernels/cpu/dtype.hpp"
#include "shardflow/gloo.hpp"
#include "shardflow/hierarchical.hpp"
#include "shardflow/store.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

using test::make;

std::vector<std::shared_ptr<Communicator>> gloo_world(TcpStoreServer& server, int n, const std::string& prefix) {
  GlooOptions o;
  o.key_prefix = prefix;
  o.timeout = 30s;
  return test::store_world(n, server.port(), o, make_gloo_communicator);
}

StoreServerOptions store_opts() {
  StoreServerOptions o;
  o.token = "t";
  return o;
}

}  // namespace

TEST_CASE("gloo: every collective, element by element, worlds 2 and 3, sizes 0, 1, odd and 1 MiB") {
  TcpStoreServer server(store_opts());
  for (int n : {2, 3}) {
    auto comms = gloo_world(server, n, "w" + std::to_string(n) + "/");
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{1001}, std::size_t{1} << 18}) {
      CAPTURE(n);
      CAPTURE(count);
      CHECK(test::wrong_elements(comms, count) == 0);
    }
  }
}

// Note [Ring reduce-scatter]: blocks that span several segments, in place (the block is the
// rank's own slice of its send buffer, as ZeRO's buckets have it), 16-bit through fp32, the scale
// fused in, and several in a row of different sizes so that one's segments never match another's.
TEST_CASE("gloo: the ring reduce-scatter and all-gather at world 4, in place, bf16 and scaled, several segments, back to back") {
  TcpStoreServer server(store_opts());
  const int n = 4;
  auto comms = gloo_world(server, n, "ring/");
  const std::size_t seg = (std::size_t{256} << 10) / 4;  // GlooRing::kSegmentBytes in fp32 elements
  const std::vector<std::size_t> counts = {3 * seg + 17, 1, seg, 5};
  auto value = [](int r, std::size_t i) { return float(int((i * 7 + std::size_t(r) * 13) % 41) - 20); };
  std::vector<std::size_t> bad(n, 0), bad16(n, 0);
  test::require_all_ok(test::run_ranks(n, [&](int r) {
    auto& c = *comms[std::size_t(r)];
    for (const std::size_t count : counts) {
      std::vector<float> buf(count * n);
      for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = value(r, i);
      float* mine = buf.data() + std::size_t(r) * count;
      c.run(make(CollectiveKind::reduce_scatter, buf.data(), mine, count, 0.25f), 30s);
      for (std::size_t i = 0; i < count; ++i) {
        float sum = 0;
        for (int k = 0; k < n; ++k) sum += value(k, std::size_t(r) * count + i);
        bad[std::size_t(r)] += mine[i] != sum * 0.25f;
      }
      // The all-gather in place (ZeRO's syncs): block r is already where the output wants it.
      std::vector<float> gathered(count * n, -1.0f);
      for (std::size_t i = 0; i < count; ++i) gathered[std::size_t(r) * count + i] = value(r, i);
      c.run(make(CollectiveKind::allgather, gathered.data() + std::size_t(r) * count, gathered.data(), count), 30s);
      for (int k = 0; k < n; ++k)
        for (std::size_t i = 0; i < count; ++i) bad[std::size_t(r)] += gathered[std::size_t(k) * count + i] != value(k, i);
      // bf16: small integers are exact, and so are their sums here.
      std::vector<std::uint16_t> b16(count * n), out(count);
      for (std::size_t i = 0; i < b16.size(); ++i) b16[i] = kernels::f32_to_bf16(value(r, i));
      auto op = make(CollectiveKind::reduce_scatter, b16.data(), out.data(), count);
      op.dtype = DType::bf16;
      c.run(op, 30s);
      for (std::size_t i = 0; i < count; ++i) {
        float sum = 0;
        for (int k = 0; k < n; ++k) sum += value(k, std::size_t(r) * count + i);
        bad16[std::size_t(r)] += kernels::bf16_to_f32(out[i]) != sum;
      }
    }
  }));
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(bad[std::size_t(r)] == 0);
    CHECK(bad16[std::size_t(r)] == 0);
  }
}

// Note [Pieces to their new owners]: each rank's pack as long as it is, none padded.
TEST_CASE("gloo: a shift with unequal counts at world 4, by 1 and 3: rank r sends r x 70000 + 5 elements (rank 0: none) "
          "and each rank receives exactly its source's, several segments long, and the in-process backend refuses such a shift by name") {
  TcpStoreServer server(store_opts());
  const int n = 4;
  auto comms = gloo_world(server, n, "unequal/");
  REQUIRE(comms[0]->shifts_unequal());
  const auto count = [](int r) { return r == 0 ? std::size_t{0} : std::size_t(r) * 70000 + 5; };
  const auto value = [](int r, std::size_t i) { return float(r * 1000 + int(i % 997)); };
  std::vector<std::size_t> bad(n, 0);
  test::require_all_ok(test::run_ranks(n, [&](int r) {
    for (const int d : {1, 3}) {
      const int from = (r - d + n) % n;
      std::vector<float> out(count(r)), in(count(from), -1.0f);
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = value(r, i);
      auto op = make(CollectiveKind::shift, out.data(), in.data(), out.size());
      op.recv_count = in.size();
      op.distance = d;
      comms[std::size_t(r)]->run(op, 30s);
      for (std::size_t i = 0; i < in.size(); ++i) bad[std::size_t(r)] += in[i] != value(from, i);
    }
  }));
  for (int r = 0; r < n; ++r) CHECK(bad[std::size_t(r)] == 0);
  auto world = InProcessWorld::create(2, 10s);
  CHECK_FALSE(world->communicator(0)->shifts_unequal());
  const auto errors = test::run_ranks(2, [&](int r) {
    std::vector<float> out(4), in(5);
    auto op = make(CollectiveKind::shift, out.data(), in.data(), out.size());
    op.recv_count = in.size();
    op.distance = 1;
    op.tag = "pieces";
    world->communicator(r)->run(op, 10s);
  });
  for (int r = 0; r < 2; ++r)
    CHECK(test::message_of(errors[std::size_t(r)]).find("shift 'pieces' sends 4 element(s) and receives 5") != std::string::npos);
  // A receive count belongs to a shift alone: on another op it is refused, not ignored.
  const auto misplaced = test::run_ranks(n, [&](int r) {
    std::vector<float> buf(8, 1.0f);
    auto op = make(CollectiveKind::allreduce, buf.data(), buf.data(), buf.size());
    op.recv_count = 4;
    op.tag = "loss";
    comms[std::size_t(r)]->run(op, 30s);
  });
  for (int r = 0; r < n; ++r)
    CHECK(test::message_of(misplaced[std::size_t(r)]).find("allreduce 'loss' sets recv_count, which only a shift takes") != std::string::npos);
}

TEST_CASE("gloo: ZeRO-1 training over Gloo ends with the parameters of the in-process backend") {
  const int n = 2, P = 8, numel = 300;
  auto train = [&](std::vector<std::shared_ptr<Communicator>> comms) {
    std::vector<std::vector<float>> params(n, std::vector<float>(std::size_t(P) * numel, 0.2f));
    test::require_all_ok(test::run_ranks(n, [&](int r) {
      Config cfg;
      cfg.zero.stage = ZeroStage::optimizer_state;
      cfg.zero.overlap = Overlap::interleaved;
      cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = 2 * numel * 4;
      Runtime rt(comms[std::size_t(r)], cfg);
      const auto h = test::register_flat(rt, params[std::size_t(r)].data(), P, numel);
      OptimizerConfig adam;
      adam.kind = OptimizerConfig::Kind::adamw;
      adam.lr = 0.01f;
      rt.configure_optimizer(adam);
      for (int it = 0; it < 5; ++it) {
        rt.zero_grad();
        for (int i = P - 1; i >= 0; --i) {
          float* g = rt.grad_f32(h[std::size_t(i)]);
          for (int e = 0; e < numel; ++e) g[e] = 0.01f * float((e + i * 3 + r * 7 + it) % 17) - 0.08f;
          rt.grad_ready(h[std::size_t(i)]);
        }
        rt.wait();
      }
    }));
    return params;
  };
  TcpStoreServer server(store_opts());
  const auto over_gloo = train(gloo_world(server, n, "zero/"));
  auto world = InProcessWorld::create(n);
  const auto in_process = train({world->communicator(0), world->communicator(1)});
  for (int r = 0; r < n; ++r) CHECK(test::rel_error(over_gloo[std::size_t(r)], in_process[0]) <= 1e-6);
  CHECK(over_gloo[0] == over_gloo[1]);
}

TEST_CASE("gloo: a rank that never connects makes the others fail within the timeout, naming the store") {
  TcpStoreServer server(store_opts());
  GlooOptions o;
  o.rank = 0;
  o.world_size = 2;
  o.store_port = server.port();
  o.token = "t";
  o.timeout = 500ms;
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(make_gloo_communicator(o), Error);
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
  o.rank = 2;
  CHECK_THROWS_WITH_AS(make_gloo_communicator(o), doctest::Contains("outside world size"), UsageError);
}

// Note [Pieces to their new owners], over two levels: a shift by whole hosts runs on Gloo's lanes
// and takes each rank's own count, so a restore sends no padding across the link; a shift inside
// the hosts stays padded (in-process here, shared memory in a job) and an unequal one is refused.
TEST_CASE("two levels with Gloo between the hosts, 2 hosts x 2 ranks: a shift by whole hosts with unequal counts moves each rank's "
          "own count (rank 1 sends nothing, rank 3 receives nothing), an unequal shift inside the hosts is refused by name on every rank") {
  TcpStoreServer server(store_opts());
  constexpr int H = 2, L = 2;
  std::vector<std::vector<std::shared_ptr<Communicator>>> lanes;  // [l][h]
  for (int l = 0; l < L; ++l) lanes.push_back(gloo_world(server, H, "lane" + std::to_string(l) + "/"));
  std::vector<std::shared_ptr<InProcessWorld>> hosts;
  for (int h = 0; h < H; ++h) hosts.push_back(InProcessWorld::create(L, 30s));
  // Rank r sends count(r) elements to rank r + 2 (a host away, its own local index).
  const auto count = [](int r) { return r == 1 ? std::size_t{0} : std::size_t(r + 1) * 50000 + 3; };
  const auto value = [](int r, std::size_t i) { return float(r * 1000 + int(i % 991)); };
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int r = 0; r < H * L; ++r)
    comms.push_back(make_hierarchical(hosts[std::size_t(r / L)]->communicator(r % L), lanes[std::size_t(r % L)][std::size_t(r / L)]));
  std::vector<std::size_t> bad(H * L, 0);
  test::require_all_ok(test::run_ranks(H * L, [&](int r) {
    const auto& comm = comms[std::size_t(r)];
    CHECK(comm->shifts_unequal());
    CHECK_FALSE(comm->shifts_unequal(/*in_host=*/true));
    const int from = (r - L + H * L) % (H * L);
    std::vector<float> out(count(r)), in(count(from), -1.0f);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = value(r, i);
    auto op = make(CollectiveKind::shift, out.data(), in.data(), out.size());
    op.recv_count = in.size();
    op.distance = L;
    op.tag = "restore window 0 by 2";
    comm->run(op, 30s);
    for (std::size_t i = 0; i < in.size(); ++i) bad[std::size_t(r)] += in[i] != value(from, i);
  }));
  for (int r = 0; r < H * L; ++r) CHECK(bad[std::size_t(r)] == 0);
  std::vector<std::vector<float>> arrived(H * L, std::vector<float>(5, -1.0f));
  const auto refused = test::run_ranks(H * L, [&](int r) {
    std::vector<float> a(4, 1.0f);
    auto op = make(CollectiveKind::shift, a.data(), arrived[std::size_t(r)].data(), a.size());
    op.recv_count = 5;
    op.distance = 1;
    op.in_host = true;
    op.tag = "restore window 0 by 1 inside the host";
    comms[std::size_t(r)]->run(op, 30s);
  });
  for (int r = 0; r < H * L; ++r) {
    CAPTURE(r);
    CHECK(test::message_of(refused[std::size_t(r)]).find("shift 'restore window 0 by 1 inside the host' sends 4 element(s) and receives 5") !=
          std::string::npos);
    CHECK(arrived[std::size_t(r)] == std::vector<float>(5, -1.0f));
  }
}
