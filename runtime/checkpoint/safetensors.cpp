#include "shardflow/safetensors.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <isa-l/crc.h>

#include "runtime/checkpoint/safetensors_stream.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {
std::size_t safetensors_element_size(const std::string& dtype) {
  static const std::map<std::string, std::size_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4},
      {"I16", 2}, {"I8", 1},  {"U8", 1},  {"BOOL", 1}, {"U16", 2}, {"U32", 4}, {"U64", 8}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

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

namespace {

void write_all(int fd, const void* data, std::uint64_t n, std::uint64_t at, const std::string& path) {
  std::uint64_t done = 0;
  while (done < n) {
    const auto put = ::pwrite(fd, static_cast<const char*>(data) + done, n - done, off_t(at + done));
    if (put <= 0) throw Error("safetensors: writing '" + path + "' failed: " + std::strerror(errno));
    done += std::uint64_t(put);
  }
}

}  // namespace

SafetensorsIndex read_safetensors_index(const std::string& path) {
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

  SafetensorsIndex index;
  index.path = path;
  for (auto& [name, info] : j.items()) {
    const std::string where = "safetensors: '" + path + "', tensor '" + name + "'";
    try {
      if (name == "__metadata__") {
        for (auto& [k, v] : info.items()) index.metadata[k] = v.is_string() ? v.get<std::string>() : v.dump();
        continue;
      }
      SafetensorsIndex::Entry t;
      t.dtype = info.at("dtype").get<std::string>();
      t.shape = info.at("shape").get<Shape>();
      auto offs = info.at("data_offsets").get<std::vector<std::uint64_t>>();
      const std::size_t es = safetensors_element_size(t.dtype);
      if (es == 0) throw Error(where + ": unsupported dtype " + t.dtype);
      for (auto d : t.shape)
        if (d < 0) throw Error(where + ": negative dimension");
      if (offs.size() != 2 || offs[0] > offs[1] || offs[1] > data_len)
        throw Error(where + ": data_offsets out of the file's data section (file truncated?)");
      if (offs[1] - offs[0] != std::uint64_t(numel(t.shape)) * es)
        throw Error(where + ": " + std::to_string(offs[1] - offs[0]) + " bytes of data for shape " + shape_str(t.shape) + " " + t.dtype);
      t.begin = data_start + offs[0];
      t.bytes = offs[1] - offs[0];
      index.tensors.emplace(name, std::move(t));
    } catch (const nlohmann::json::exception& e) {
      throw Error(where + ": malformed entry: " + e.what());
    }
  }
  return index;
}

void SafetensorsIndex::read(const std::string& name, std::uint64_t offset, void* out, std::uint64_t n) const {
  const auto& e = tensors.at(name);
  const std::string& path = e.file.empty() ? this->path : e.file;
  if (offset + n > e.bytes) throw Error("safetensors: '" + path + "', tensor '" + name + "': read past its data");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("safetensors: cannot open '" + path + "': " + std::strerror(errno));
  std::uint64_t done = 0;
  while (done < n) {
    const auto got = ::pread(fd, static_cast<char*>(out) + done, n - done, off_t(e.begin + offset + done));
    if (got <= 0) {
      ::close(fd);
      throw Error("safetensors: '" + path + "', tensor '" + name + "': file truncated");
    }
    done += std::uint64_t(got);
  }
  ::close(fd);
}

TensorMap load_safetensors(const std::string& path) {
  const auto index = read_safetensors_index(path);
  TensorMap out;
  for (const auto& [name, e] : index.tensors) {
    Tensor t;
    t.dtype = e.dtype;
    t.shape = e.shape;
    t.data.resize(e.bytes);
    if (e.bytes) index.read(name, 0, t.data.data(), e.bytes);
    out.emplace(name, std::move(t));
  }
  return out;
}

// ISA-L's folded CRC (carry-less multiply): ~32 GB/s here against zlib's 4.2 (the same
// polynomial and value as zlib.crc32, which Python users check with), so the checksum no
// longer costs a consolidated save a fifth of its time.
std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (n > 0) {  // ISA-L takes 64-bit lengths, but keep each call's run of the loop bounded
    const auto chunk = std::min<std::size_t>(n, std::size_t(1) << 30);
    crc = ::crc32_gzip_refl(crc, p, std::uint64_t(chunk));
    p += chunk;
    n -= chunk;
  }
  return crc;
}

namespace {

// Note [Checksums in the header]
// safetensors puts its header before the data, but a streamed writer knows a tensor's checksum
// only after its last byte. So the header reserves the metadata value: a JSON object of every
// tensor name -> "00000000", whose length does not change when the digits do; commit() writes
// the real digits over it in place. Each tensor's CRC runs over its bytes as they are written in
// order (every writer here writes a tensor front to back); one written out of order is read back.
std::string checksum_value(const std::map<std::string, std::uint32_t>& crcs) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [name, crc] : crcs) {
    char hex[9];
    std::snprintf(hex, sizeof hex, "%08x", crc);
    j[name] = hex;
  }
  return j.dump();
}

}  // namespace

std::map<std::string, std::uint32_t> safetensors_checksums(const SafetensorsIndex& index) {
  std::map<std::string, std::uint32_t> out;
  const auto it = index.metadata.find(kChecksumKey);
  if (it == index.metadata.end()) return out;
  try {
    const auto j = nlohmann::json::parse(it->second);
    for (auto e = j.begin(); e != j.end(); ++e) out[e.key()] = std::uint32_t(std::stoul(e.value().get<std::string>(), nullptr, 16));
  } catch (const std::exception& e) {
    throw Error("safetensors: '" + index.path + "': malformed checksums in its metadata: " + e.what());
  }
  return out;
}

SafetensorsWriter::SafetensorsWriter(std::string path, const std::vector<Entry>& tensors,
                                     const std::map<std::string, std::string>& metadata, bool checksums)
    : path_(std::move(path)), tmp_(path_ + ".tmp." + std::to_string(::getpid())), checksums_(checksums) {
  nlohmann::ordered_json j;
  std::string reserved;
  auto meta = metadata;
  if (checksums_) {
    std::map<std::string, std::uint32_t> zeros;
    for (const auto& t : tensors) zeros[t.name] = 0;
    reserved = checksum_value(zeros);
    meta[kChecksumKey] = reserved;
  }
  if (!meta.empty()) j["__metadata__"] = meta;
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    const std::uint64_t bytes = std::uint64_t(numel(t.shape)) * safetensors_element_size(t.dtype);
    if (where_.count(t.name)) throw UsageError("safetensors: tensor '" + t.name + "' appears twice");
    j[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    where_[t.name] = {offset, bytes};
    offset += bytes;
  }
  std::string header = j.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  if (checksums_) {
    const std::string encoded = nlohmann::json(reserved).dump();  // as it stands in the header
    const auto at = header.find(encoded);
    if (at == std::string::npos) throw Error("safetensors: '" + path_ + "': the checksums' place in the header was not found");
    checksum_at_ = 8 + at;
    checksum_len_ = encoded.size();
  }
  for (auto& [name, w] : where_) w.first += 8 + header.size();
  fd_ = ::open(tmp_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);  // read back for checksums
  if (fd_ < 0) throw Error("safetensors: cannot write '" + tmp_ + "': " + std::strerror(errno));
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[std::size_t(i)] = char(std::uint8_t(std::uint64_t(header.size()) >> (8 * i)));
  head += header;
  write_all(fd_, head.data(), head.size(), 0, tmp_);
  // The data section at its full length now: a tensor never written reads as zeros, not short.
  if (::ftruncate(fd_, off_t(head.size() + offset)) != 0) throw Error("safetensors: cannot size '" + tmp_ + "': " + std::strerror(errno));
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void SafetensorsWriter::write(const std::string& name, std::uint64_t offset, const void* data, std::uint64_t n) {
  const auto it = where_.find(name);
  if (it == where_.end() || offset + n > it->second.second)
    throw UsageError("safetensors: writing past tensor '" + name + "' of '" + path_ + "'");
  write_all(fd_, data, n, it->second.first + offset, tmp_);
  if (checksums_) {
    auto& r = running_[name];
    if (offset == r.written) {
      r.crc = crc32_update(r.crc, data, n);
      r.written += n;
    } else {
      r.written = ~std::uint64_t(0);  // out of order: read back at commit
    }
  }
}

void SafetensorsWriter::commit() {
  if (checksums_) {
    std::map<std::string, std::uint32_t> crcs;
    std::vector<char> buf;
    for (const auto& [name, w] : where_) {
      const auto r = running_.find(name);
      if (r != running_.end() && r->second.written == w.second) {
        crcs[name] = r->second.crc;
        continue;
      }
      std::uint32_t crc = 0;  // written out of order, in part or not at all (zeros): read it back
      constexpr std::uint64_t kPiece = 1 << 22;
      for (std::uint64_t done = 0; done < w.second; done += kPiece) {
        buf.resize(std::min(kPiece, w.second - done));
        if (::pread(fd_, buf.data(), buf.size(), off_t(w.first + done)) != ssize_t(buf.size()))
          throw Error("safetensors: cannot read back '" + tmp_ + "': " + std::strerror(errno));
        crc = crc32_update(crc, buf.data(), buf.size());
      }
      crcs[name] = crc;
    }
    const std::string encoded = nlohmann::json(checksum_value(crcs)).dump();
    if (encoded.size() != checksum_len_) throw Error("safetensors: '" + path_ + "': the checksums changed length");
    write_all(fd_, encoded.data(), encoded.size(), checksum_at_, tmp_);
  }
  if (::fsync(fd_) != 0) throw Error("safetensors: fsync of '" + tmp_ + "' failed: " + std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    ::unlink(tmp_.c_str());
    throw Error("safetensors: cannot rename '" + tmp_ + "' to '" + path_ + "': " + std::strerror(errno));
  }
}

void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& [name, t] : tensors) {
    if (t.data.size() != t.numel() * safetensors_element_size(t.dtype))
      throw UsageError("save_safetensors: tensor '" + name + "' holds " + std::to_string(t.data.size()) +
                       " bytes, its shape " + shape_str(t.shape) + " " + t.dtype + " needs " +
                       std::to_string(t.numel() * safetensors_element_size(t.dtype)));
    entries.push_back({name, t.dtype, t.shape});
  }
  // Write-then-rename: a crash mid-save never leaves a half-written file under the real name.
  SafetensorsWriter out(path, entries, metadata);
  for (const auto& [name, t] : tensors) out.write(name, 0, t.data.data(), t.data.size());
  out.commit();
}

}  // namespace shardflow
