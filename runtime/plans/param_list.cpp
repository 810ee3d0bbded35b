#include "runtime/plans/param_list.hpp"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>

#include "shardflow/errors.hpp"

namespace shardflow {
namespace {

using Json = nlohmann::ordered_json;  // the file's order is the registration order

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

DType dtype_of(const Json& v, const std::string& where) {
  if (!v.is_string()) throw UsageError(where + ": \"dtype\" must be a string such as \"float32\"");
  const std::string s = v.get<std::string>();
  if (s == "F32") return DType::f32;
  if (s == "BF16") return DType::bf16;
  if (s == "F16") return DType::f16;
  try {
    return parse_dtype(s.rfind("torch.", 0) == 0 ? s.substr(6) : s);
  } catch (const UsageError&) {
    throw UsageError(where + ": unknown dtype '" + s + "' (expected float32, bfloat16 or float16; F32, BF16 or F16)");
  }
}

Shape shape_of(const Json& v, const std::string& where) {
  if (!v.is_array()) throw UsageError(where + ": \"shape\" must be a list of dimensions, e.g. [1024, 512]");
  Shape s;
  for (const auto& d : v) {
    if (!d.is_number_integer() || d.get<std::int64_t>() < 0)
      throw UsageError(where + ": dimension " + d.dump() + " of \"shape\" is not a non-negative integer");
    s.push_back(d.get<std::int64_t>());
  }
  return s;
}

ParamSpec param_of(const std::string& name, const Json& entry, const std::string& where) {
  if (name.empty()) throw UsageError(where + ": the parameter has no name");
  if (!entry.contains("shape")) throw UsageError(where + " ('" + name + "'): no \"shape\"");
  ParamSpec p;
  p.name = name;
  p.shape = shape_of(entry["shape"], where + " ('" + name + "')");
  if (entry.contains("dtype")) p.dtype = dtype_of(entry["dtype"], where + " ('" + name + "')");
  return p;
}

std::vector<ParamSpec> from_list(const Json& j, const std::string& what) {
  if (!j.is_array()) throw UsageError(what + ": expected a JSON list of parameters [{\"name\": ..., \"shape\": [...]}, ...]");
  std::vector<ParamSpec> out;
  std::set<std::string> names;
  for (std::size_t i = 0; i < j.size(); ++i) {
    const std::string where = what + ": parameter " + std::to_string(i);
    const auto& e = j[i];
    if (!e.is_object()) throw UsageError(where + ": expected an object {\"name\": ..., \"shape\": [...], \"dtype\": ...}");
    if (!e.contains("name") || !e["name"].is_string()) throw UsageError(where + ": no \"name\" string");
    out.push_back(param_of(e["name"].get<std::string>(), e, where));
    if (!names.insert(out.back().name).second) throw UsageError(where + ": the name '" + out.back().name + "' appears twice");
  }
  if (out.empty()) throw UsageError(what + ": lists no parameters");
  return out;
}

// safetensors: 8 bytes of little-endian header length, then the JSON header
// {"name": {"dtype": "F32", "shape": [...], "data_offsets": [...]}, ..., "__metadata__": {...}}.
std::vector<ParamSpec> from_safetensors(std::ifstream& in, const std::string& what) {
  unsigned char len_bytes[8];
  if (!in.read(reinterpret_cast<char*>(len_bytes), 8)) throw UsageError(what + ": too short for a safetensors file");
  std::uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | len_bytes[i];
  if (len == 0 || len > (std::uint64_t{100} << 20))
    throw UsageError(what + ": safetensors header length " + std::to_string(len) + " is not plausible");
  std::string header(len, '\0');
  if (!in.read(header.data(), std::streamsize(len))) throw UsageError(what + ": the safetensors header is cut short");
  Json j;
  try {
    j = Json::parse(header);
  } catch (const Json::parse_error& e) {
    throw UsageError(what + ": the safetensors header is not JSON: " + e.what());
  }
  if (!j.is_object()) throw UsageError(what + ": the safetensors header is not a JSON object");
  std::vector<ParamSpec> out;
  for (const auto& [name, entry] : j.items()) {
    if (name == "__metadata__") continue;
    if (!entry.is_object()) throw UsageError(what + ": tensor '" + name + "' is not described by an object");
    out.push_back(param_of(name, entry, what + ": tensor"));
  }
  if (out.empty()) throw UsageError(what + ": holds no tensors");
  return out;
}

}  // namespace

std::vector<ParamSpec> parse_param_list(const std::string& text, const std::string& what) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::parse_error& e) {
    throw UsageError(what + ": not valid JSON: " + e.what());
  }
  return from_list(j, what);
}

std::vector<ParamSpec> read_param_list(const std::string& path) {
  const std::string what = "--params '" + path + "'";
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(what + ": cannot open it: " + std::strerror(errno));
  if (ends_with(path, ".safetensors")) return from_safetensors(in, what);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_param_list(text, what);
}

}  // namespace shardflow
