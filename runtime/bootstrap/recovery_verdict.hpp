// The launcher's word on a round of in-place recovery (Note [Recovering in place], runtime/launch/
// rounds.cpp), as it sits in the store under "g<k>/recovery/<round>", and the ranks' count of who
// joined the round: the surviving ranks read the word in rejoin_process_group, and across nodes the
// other nodes' launchers read a shrinking round's to learn their ranks' new numbers (Note [Rounds
// across nodes]). Both sides read the keys and the format from here.
#pragma once

#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace shardflow::recovery_verdict {

inline std::string key(int generation, int round) {
  return "g" + std::to_string(generation) + "/recovery/" + std::to_string(round);
}

// Counts the ranks that made the round's group (each adds 1): the round is over once it reaches
// the round's world.
inline std::string joined_key(int generation, int round) {
  return "g" + std::to_string(generation) + "/r" + std::to_string(round) + "/joined";
}

// Note [A lost host healed in place] (runtime/launch/lost_node_round.cpp): the node a lost host's round
// leaves out, posted by the launcher that runs it; each other node left says it is ready (it holds
// the newest snapshot whole) before the word goes out.
inline std::string lost_node_key(int generation, int round) {
  return "g" + std::to_string(generation) + "/r" + std::to_string(round) + "/lost-node";
}
// Note [Copies gathered before the word] (runtime/launch/rounds.cpp): a lost rank's round across
// three or more nodes asks every node to hold the newest snapshot whole before its word goes out.
inline std::string gather_key(int generation, int round) {
  return "g" + std::to_string(generation) + "/r" + std::to_string(round) + "/gather";
}
// Note [A round that did not heal] (runtime/launch/rounds.cpp): round j's survivors refused to go
// on from it; every node's count of restarts leaves it out.
inline std::string refused_key(int generation, int round) {
  return "g" + std::to_string(generation) + "/r" + std::to_string(round) + "/refused";
}
inline std::string ready_key(int generation, int round, int node) {
  return "g" + std::to_string(generation) + "/r" + std::to_string(round) + "/ready/" + std::to_string(node);
}

// Note [A node joins live] (runtime/launch/grow_round.cpp): the node a growing round takes in; the
// ranks that left their iteration for the round (each adds 1 in rejoin_process_group, after its
// snapshot completed); and the round's nodes in order, posted once every rank is there.
inline std::string grow_node_key(int generation, int round) {
  return "g" + std::to_string(generation) + "/r" + std::to_string(round) + "/grow-node";
}
inline std::string parked_key(int generation, int round) {
  return "g" + std::to_string(generation) + "/r" + std::to_string(round) + "/parked";
}
inline std::string members_key(int generation, int round) {
  return "g" + std::to_string(generation) + "/r" + std::to_string(round) + "/members";
}
// Its value: the node ranks, "0 1 3".
inline std::string format_nodes(const std::vector<int>& nodes) {
  std::string s;
  for (int k : nodes) s += (s.empty() ? "" : " ") + std::to_string(k);
  return s;
}
inline std::vector<int> parse_nodes(const std::string& text) {
  std::vector<int> nodes;
  std::istringstream in(text);
  for (int k; in >> k;) nodes.push_back(k);
  return nodes;
}

// "in-place: <why>\nworld M\nranks n0 n1 ...": each rank of the round before's number in this
// round (-1: lost, left out). A launcher that stops every rank instead says "restart: <why>".
struct Verdict {
  std::string why;
  int world = 0;
  std::vector<int> next;
};

inline std::string format(const Verdict& v) {
  std::string s = "in-place: " + v.why + "\nworld " + std::to_string(v.world) + "\nranks";
  for (int n : v.next) s += " " + std::to_string(n);
  return s;
}

// nullopt: not an in-place verdict, or malformed.
inline std::optional<Verdict> parse(const std::string& text) {
  if (text.rfind("in-place: ", 0) != 0) return std::nullopt;
  const auto nl = text.find('\n');
  if (nl == std::string::npos) return std::nullopt;
  Verdict v;
  v.why = text.substr(10, nl - 10);
  std::istringstream lines(text.substr(nl + 1));
  std::string word;
  lines >> word >> v.world;
  if (word != "world" || v.world < 1 || !(lines >> word) || word != "ranks") return std::nullopt;
  for (int n; lines >> n;) v.next.push_back(n);
  return v;
}

}  // namespace shardflow::recovery_verdict
