// A decoder-only transformer in libtorch, GPT-2's shape at any size: token and position
// embeddings, pre-LayerNorm blocks (causal multi-head self-attention, GELU MLP), a final LayerNorm
// and an output head tied to the token embedding. Parameter names are GPT-2's as Hugging Face and
// nanoGPT spell them (wte, wpe, h.N.attn.c_attn, ln_f, ...), and bench/peers/torch_gpt.py's nn.Module has
// the same attributes, so one safetensors file initialises both.
//
// No dropout: every run is deterministic, so world 2 can be compared with world 1 and with PyTorch.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>

namespace gpt {

struct GptConfig {
  int vocab = 0;
  int context = 64;  // the longest sequence (wpe's rows)
  int layers = 6;
  int d_model = 384;
  int heads = 6;
  // A layer count, width and head split a transformer can have; names the flag a user typed.
  void validate() const {
    auto bad = [](const std::string& m) { throw std::invalid_argument(m); };
    if (vocab < 1) bad("the vocabulary is empty");
    if (context < 2) bad("--context must be >= 2, got " + std::to_string(context));
    if (layers < 1) bad("--layers must be >= 1, got " + std::to_string(layers));
    if (d_model < 1 || heads < 1 || d_model % heads != 0)
      bad("--d-model " + std::to_string(d_model) + " must be a positive multiple of --heads " + std::to_string(heads));
  }
};

struct CausalSelfAttentionImpl : torch::nn::Module {
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};
  int heads;
  CausalSelfAttentionImpl(int d_model, int heads_) : heads(heads_) {
    c_attn = register_module("c_attn", torch::nn::Linear(d_model, 3 * d_model));
    c_proj = register_module("c_proj", torch::nn::Linear(d_model, d_model));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // [B, T, C]
    const auto B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
    auto qkv = c_attn(x).split(C, 2);
    auto split_heads = [&](const torch::Tensor& t) { return t.view({B, T, heads, hd}).transpose(1, 2); };  // [B, H, T, hd]
    const auto q = split_heads(qkv[0]), k = split_heads(qkv[1]), v = split_heads(qkv[2]);
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
    const auto future = torch::ones({T, T}, x.options().dtype(torch::kBool)).triu(1);  // position t sees 0..t only
    att = torch::softmax(att.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
    return c_proj(torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C}));
  }
};
TORCH_MODULE(CausalSelfAttention);

struct MlpImpl : torch::nn::Module {
  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};
  explicit MlpImpl(int d_model) {
    c_fc = register_module("c_fc", torch::nn::Linear(d_model, 4 * d_model));
    c_proj = register_module("c_proj", torch::nn::Linear(4 * d_model, d_model));
  }
  torch::Tensor forward(const torch::Tensor& x) { return c_proj(torch::gelu(c_fc(x))); }
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  Mlp mlp{nullptr};
  BlockImpl(int d_model, int heads) {
    ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    attn = register_module("attn", CausalSelfAttention(d_model, heads));
    ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    mlp = register_module("mlp", Mlp(d_model));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn(ln_1(x));
    return x + mlp(ln_2(x));
  }
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  GptConfig cfg;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h;
  torch::nn::LayerNorm ln_f{nullptr};

  explicit GptImpl(const GptConfig& c) : cfg(c) {
    cfg.validate();
    // Registration order is forward order: shardflow's first buckets (before the rebuild) follow it.
    wte = register_module("wte", torch::nn::Embedding(cfg.vocab, cfg.d_model));
    wpe = register_module("wpe", torch::nn::Embedding(cfg.context, cfg.d_model));
    h = register_module("h", torch::nn::ModuleList());
    for (int i = 0; i < cfg.layers; ++i) h->push_back(Block(cfg.d_model, cfg.heads));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.d_model})));
    init_weights();
  }

  // GPT-2's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm gains, and the
  // projections into the residual stream scaled by 1/sqrt(2 * layers) so its variance does not grow
  // with depth. torch::manual_seed beforehand makes it reproducible.
  void init_weights() {
    torch::NoGradGuard no_grad;
    const double residual_std = 0.02 / std::sqrt(2.0 * cfg.layers);
    for (auto& item : named_parameters()) {
      const std::string& name = item.key();
      auto& p = item.value();
      auto ends_with = [&](const std::string& s) { return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0; };
      if (name.find("ln_") != std::string::npos) p.fill_(ends_with(".weight") ? 1.0 : 0.0);
      else if (ends_with(".bias")) p.zero_();
      else if (ends_with("c_proj.weight")) p.normal_(0.0, residual_std);
      else p.normal_(0.0, 0.02);
    }
  }

  // idx [B, T] int64 token ids -> logits [B, T, vocab]. `before(m)` runs right before module m's
  // parameters are first read (forward prefetch waits for them there); the tied head reads wte's
  // weight again at the end, by then long waited for.
  torch::Tensor forward(const torch::Tensor& idx, const std::function<void(torch::nn::Module&)>& before = {}) {
    const auto T = idx.size(1);
    if (T > cfg.context) throw std::invalid_argument("a sequence of " + std::to_string(T) + " tokens is longer than --context " + std::to_string(cfg.context));
    auto use = [&](torch::nn::Module& m) { if (before) before(m); };
    use(*wte);
    use(*wpe);
    auto x = wte(idx) + wpe(torch::arange(T, idx.options()));
    for (std::size_t i = 0; i < h->size(); ++i) {
      auto block = h[i];
      use(*block);
      x = block->as<Block>()->forward(x);
    }
    use(*ln_f);
    return torch::nn::functional::linear(ln_f(x), wte->weight);  // the head is the embedding, transposed
  }

  std::int64_t num_parameters() {
    std::int64_t n = 0;
    for (const auto& p : parameters()) n += p.numel();
    return n;
  }
};
TORCH_MODULE(Gpt);

}  // namespace gpt
