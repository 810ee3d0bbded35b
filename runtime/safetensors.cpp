#include "shardflow/safetensors.hpp"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <fstream>

#include "shardflow/errors.hpp"

namespace shardflow {
namespace {

std::size_t element_size(const std::string& dtype) {
  static const std::map<std::string, std::size_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4},
      {"I16", 2}, {"I8", 1},  {"U8", 1},  {"BOOL", 1}, {"U16", 2}, {"U32", 4}, {"U64", 8}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

}  // namespace

std::vector<float> Tensor::to_f32(const std::string& what) const {
  if (dtype != "F32") throw UsageError(what + ": expected dtype F32, the file has " + dtype);
  std::vector<float> out(numel());
  if (!out.empty()) std::memcpy(out.data(), data.data(), out.size() * 4);
  return out;
}

Tensor Tensor::from_f32(const float* p, Shape shape) {
  Tensor t;
  t.dtype = "F32";
  t.shape = std::move(shape);
  t.data.resize(t.numel() * 4);
  if (!t.data.empty()) std::memcpy(t.data.data(), p, t.data.size());
  return t;
}

TensorMap load_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("safetensors: cannot open '" + path + "'");
  in.seekg(0, std::ios::end);
  const auto file_size = std::uint64_t(in.tellg());
  in.seekg(0);
  std::uint8_t len_bytes[8];
  if (file_size < 8 || !in.read(reinterpret_cast<char*>(len_bytes), 8))
    throw Error("safetensors: '" + path + "' is too short to hold a header");
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > file_size - 8 || header_len > (std::uint64_t{100} << 20))
    throw Error("safetensors: '" + path + "' declares a header of " + std::to_string(header_len) +
                " bytes, the file has " + std::to_string(file_size));
  std::string header(header_len, '\0');
  in.read(header.data(), std::streamsize(header_len));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const std::exception& e) {
    throw Error("safetensors: '" + path + "' has a malformed JSON header: " + e.what());
  }
  if (!j.is_object()) throw Error("safetensors: '" + path + "': header is not a JSON object");
  const std::uint64_t data_start = 8 + header_len, data_len = file_size - data_start;

  TensorMap out;
  for (auto& [name, info] : j.items()) {
    if (name == "__metadata__") continue;
    const std::string where = "safetensors: '" + path + "', tensor '" + name + "'";
    try {
      Tensor t;
      t.dtype = info.at("dtype").get<std::string>();
      t.shape = info.at("shape").get<Shape>();
      auto offs = info.at("data_offsets").get<std::vector<std::uint64_t>>();
      const std::size_t es = element_size(t.dtype);
      if (es == 0) throw Error(where + ": unsupported dtype " + t.dtype);
      for (auto d : t.shape)
        if (d < 0) throw Error(where + ": negative dimension");
      if (offs.size() != 2 || offs[0] > offs[1] || offs[1] > data_len)
        throw Error(where + ": data_offsets out of the file's data section");
      if (offs[1] - offs[0] != t.numel() * es)
        throw Error(where + ": " + std::to_string(offs[1] - offs[0]) + " bytes of data for shape " +
                    shape_str(t.shape) + " " + t.dtype);
      t.data.resize(offs[1] - offs[0]);
      in.seekg(std::streamoff(data_start + offs[0]));
      if (!t.data.empty() && !in.read(reinterpret_cast<char*>(t.data.data()), std::streamsize(t.data.size())))
        throw Error(where + ": file truncated");
      out.emplace(name, std::move(t));
    } catch (const nlohmann::json::exception& e) {
      throw Error(where + ": malformed entry: " + e.what());
    }
  }
  return out;
}

void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json j;
  if (!metadata.empty()) j["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (t.data.size() != t.numel() * element_size(t.dtype))
      throw UsageError("save_safetensors: tensor '" + name + "' holds " + std::to_string(t.data.size()) +
                       " bytes, its shape " + shape_str(t.shape) + " " + t.dtype + " needs " +
                       std::to_string(t.numel() * element_size(t.dtype)));
    j[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string header = j.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error("safetensors: cannot write '" + path + "'");
    std::uint8_t len_bytes[8];
    std::uint64_t len = header.size();
    for (int i = 0; i < 8; ++i) len_bytes[i] = std::uint8_t(len >> (8 * i));
    out.write(reinterpret_cast<const char*>(len_bytes), 8);
    out.write(header.data(), std::streamsize(header.size()));
    for (const auto& [name, t] : tensors) out.write(reinterpret_cast<const char*>(t.data.data()), std::streamsize(t.data.size()));
    if (!out) throw Error("safetensors: writing '" + path + "' failed");
  }
  // Write-then-rename: a crash mid-save never leaves a half-written checkpoint under the real name.
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw Error("safetensors: cannot rename '" + tmp + "' to '" + path + "'");
}

}  // namespace shardflow
