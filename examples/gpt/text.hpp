// The character-level corpus gpt_train trains on (scripts/text_to_safetensors.py writes it from
// Debian's fortunes at build time) and the batches every rank draws from it.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace gpt {

struct Corpus {
  std::vector<std::uint8_t> train, val;  // token ids
  std::vector<std::uint8_t> vocab;       // token id -> byte
  int vocab_size() const { return int(vocab.size()); }
  std::string decode(const std::vector<std::int64_t>& ids) const;
};

// Error naming the file and what is wrong (missing, no `train`, ids outside the vocabulary, a split
// shorter than one sequence of `context` + 1 tokens).
Corpus load_corpus(const std::string& path, int context);

// Note [GPT batches]
// Sequence `row` of the global batch of step `step` starts at splitmix64(seed, step, row) modulo
// the positions a whole window fits at. A rank of world W reads rows rank*B/W .. (rank+1)*B/W - 1,
// so the global batch is the same at every world size (world 2 equals world 1), resumes go on at
// the step's own rows, and bench/peers/torch_gpt.py draws the same windows with the same arithmetic.
std::uint64_t window_start(std::uint64_t seed, std::int64_t step, std::int64_t row, std::size_t tokens, int context);

struct Batch {
  torch::Tensor x, y;  // [rows, context] int64: inputs and the next token of each
};
Batch train_batch(const Corpus& c, std::uint64_t seed, std::int64_t step, std::int64_t first_row, int rows, int context);

// The held-out loss: `windows` windows of the val split, evenly spaced and the same for every run,
// evaluated `rows` at a time without gradients.
double heldout_loss(torch::nn::Module& model, const std::function<torch::Tensor(const torch::Tensor&)>& forward, const Corpus& c,
                    int context, int windows, int rows);

}  // namespace gpt
