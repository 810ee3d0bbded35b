#include "text.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "shardflow/errors.hpp"
#include "shardflow/safetensors.hpp"

namespace gpt {

std::string Corpus::decode(const std::vector<std::int64_t>& ids) const {
  std::string s;
  s.reserve(ids.size());
  for (auto id : ids) s.push_back(char(vocab.at(std::size_t(id))));
  return s;
}

Corpus load_corpus(const std::string& path, int context) {
  if (!std::filesystem::exists(path))
    throw shardflow::UsageError("--data '" + path + "': no such file (make's set-up writes build/data/fortunes.safetensors from Debian's fortunes package)");
  const auto t = shardflow::load_safetensors(path);
  auto bytes = [&](const char* name) {
    auto it = t.find(name);
    if (it == t.end()) throw shardflow::Error("--data '" + path + "': tensor '" + name + "' is missing (expected scripts/text_to_safetensors.py's file)");
    if (it->second.dtype != "U8" || it->second.shape.size() != 1)
      throw shardflow::Error("--data '" + path + "': tensor '" + name + "' is " + it->second.dtype + " " + shardflow::shape_str(it->second.shape) +
                             ", expected U8 [n]");
    std::vector<std::uint8_t> v(it->second.numel());
    std::memcpy(v.data(), it->second.data.data(), v.size());
    return v;
  };
  Corpus c{bytes("train"), bytes("val"), bytes("vocab")};
  if (c.vocab.empty()) throw shardflow::Error("--data '" + path + "': the vocabulary is empty");
  for (const auto* split : {&c.train, &c.val}) {
    const char* name = split == &c.train ? "train" : "val";
    if (split->size() < std::size_t(context) + 2)
      throw shardflow::UsageError("--data '" + path + "': the " + name + " split has " + std::to_string(split->size()) +
                                  " tokens, fewer than one window of --context " + std::to_string(context) + " + 1");
    const auto top = *std::max_element(split->begin(), split->end());
    if (top >= c.vocab.size())
      throw shardflow::Error("--data '" + path + "': token id " + std::to_string(top) + " in '" + name + "' is outside the vocabulary of " +
                             std::to_string(c.vocab.size()));
  }
  return c;
}

namespace {
std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

torch::Tensor windows(const std::vector<std::uint8_t>& split, const std::vector<std::uint64_t>& starts, int context, int shift) {
  auto out = torch::empty({std::int64_t(starts.size()), context}, torch::kLong);
  auto* p = out.data_ptr<std::int64_t>();
  for (std::size_t r = 0; r < starts.size(); ++r)
    for (int t = 0; t < context; ++t) p[r * context + t] = split[starts[r] + t + shift];
  return out;
}
}  // namespace

std::uint64_t window_start(std::uint64_t seed, std::int64_t step, std::int64_t row, std::size_t tokens, int context) {
  const std::uint64_t positions = tokens - std::size_t(context);  // a window and its next token fit
  return splitmix64(splitmix64(seed) ^ (std::uint64_t(step) << 20 | std::uint64_t(row))) % positions;
}

Batch train_batch(const Corpus& c, std::uint64_t seed, std::int64_t step, std::int64_t first_row, int rows, int context) {
  std::vector<std::uint64_t> starts(rows);
  for (int r = 0; r < rows; ++r) starts[r] = window_start(seed, step, first_row + r, c.train.size(), context);
  return {windows(c.train, starts, context, 0), windows(c.train, starts, context, 1)};
}

double heldout_loss(torch::nn::Module& model, const std::function<torch::Tensor(const torch::Tensor&)>& forward, const Corpus& c,
                    int context, int windows_, int rows) {
  torch::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  const std::uint64_t positions = c.val.size() - std::size_t(context);
  double sum = 0;
  std::int64_t n = 0;
  for (int first = 0; first < windows_; first += rows) {
    std::vector<std::uint64_t> starts;
    for (int w = first; w < std::min(windows_, first + rows); ++w) starts.push_back(positions * std::uint64_t(w) / std::uint64_t(windows_));
    const auto x = windows(c.val, starts, context, 0), y = windows(c.val, starts, context, 1);
    const auto logits = forward(x);
    sum += torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), y.view({-1}),
                                                torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
               .item<double>();
    n += y.numel();
  }
  model.train(was_training);
  return sum / double(n);
}

}  // namespace gpt
