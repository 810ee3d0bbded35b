// Checkpoints too large for one file, in the layout people already use for sharded safetensors
// (<name>.safetensors.index.json with a weight_map), and the atomic small-file write both the
// split index and the sharded checkpoints' index go through.
#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include "runtime/checkpoint/safetensors_stream.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {

namespace fs = std::filesystem;

void write_file_atomically(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error("cannot create '" + tmp + "': " + std::strerror(errno));
  std::size_t done = 0;
  while (done < content.size()) {
    const auto n = ::write(fd, content.data() + done, content.size() - done);
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Error("cannot write '" + tmp + "': " + std::strerror(err));
    }
    done += std::size_t(n);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw Error("cannot write '" + path + "': " + std::strerror(err));
  }
}

namespace {

// "<dir>/checkpoint.safetensors.index.json" -> "checkpoint"
std::string stem_of(const std::string& index_json) {
  auto name = fs::path(index_json).filename().string();
  for (const char* suffix : {".index.json", ".safetensors"})
    if (const auto n = std::strlen(suffix); name.size() > n && name.compare(name.size() - n, n, suffix) == 0) name.resize(name.size() - n);
  return name;
}

}  // namespace

std::vector<std::string> safetensors_split_files(const std::string& index_json) {
  std::ifstream in(index_json);
  if (!in) throw Error("safetensors: cannot open '" + index_json + "': " + std::strerror(errno));
  std::set<std::string> files;
  try {
    const auto j = nlohmann::json::parse(in);
    for (auto it = j.at("weight_map").begin(); it != j.at("weight_map").end(); ++it)
      files.insert((fs::path(index_json).parent_path() / it.value().get<std::string>()).string());
  } catch (const std::exception& e) {
    throw Error("safetensors: '" + index_json + "' is not a split checkpoint's index (metadata, weight_map): " + e.what());
  }
  return {files.begin(), files.end()};
}

SafetensorsIndex read_safetensors_split(const std::string& index_json) {
  nlohmann::json j;
  {
    std::ifstream in(index_json);
    if (!in) throw Error("safetensors: cannot open '" + index_json + "': " + std::strerror(errno));
    try {
      j = nlohmann::json::parse(in);
      (void)j.at("weight_map").items();
    } catch (const std::exception& e) {
      throw Error("safetensors: '" + index_json + "' is not a split checkpoint's index (metadata, weight_map): " + e.what());
    }
  }
  const auto dir = fs::path(index_json).parent_path();
  SafetensorsIndex merged;
  merged.path = index_json;
  nlohmann::json checksums = nlohmann::json::object();
  std::map<std::string, SafetensorsIndex> files;
  for (auto it = j.at("weight_map").begin(); it != j.at("weight_map").end(); ++it) {
    const auto file = (dir / it.value().get<std::string>()).string();
    auto f = files.find(file);
    if (f == files.end()) {
      f = files.emplace(file, read_safetensors_index(file)).first;
      const auto& index = f->second;
      if (merged.metadata.empty()) merged.metadata = index.metadata;
      if (const auto c = index.metadata.find(kChecksumKey); c != index.metadata.end()) checksums.update(nlohmann::json::parse(c->second));
    }
    const auto t = f->second.tensors.find(it.key());
    if (t == f->second.tensors.end()) throw Error("safetensors: '" + file + "' has no tensor '" + it.key() + "' (its index names it there)");
    auto entry = t->second;
    entry.file = file;
    merged.tensors.emplace(it.key(), std::move(entry));
  }
  if (!checksums.empty()) merged.metadata[kChecksumKey] = checksums.dump();
  else merged.metadata.erase(kChecksumKey);
  if (j.contains("metadata"))
    for (auto it = j["metadata"].begin(); it != j["metadata"].end(); ++it)
      if (!merged.metadata.count(it.key())) merged.metadata[it.key()] = it.value().is_string() ? it.value().get<std::string>() : it.value().dump();
  return merged;
}

SafetensorsSplitWriter::SafetensorsSplitWriter(std::string index_json, const std::vector<SafetensorsWriter::Entry>& tensors,
                                               const std::map<std::string, std::string>& metadata, std::uint64_t max_file_bytes,
                                               bool checksums)
    : index_json_(std::move(index_json)), dir_(fs::path(index_json_).parent_path().string()), metadata_(metadata) {
  // Tensors in order, a new file whenever the next one would pass the limit.
  std::vector<std::vector<SafetensorsWriter::Entry>> groups(1);
  std::uint64_t in_group = 0;
  for (const auto& t : tensors) {
    const std::uint64_t bytes = std::uint64_t(numel(t.shape)) * safetensors_element_size(t.dtype);
    if (!groups.back().empty() && in_group + bytes > max_file_bytes) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(t);
    in_group += bytes;
  }
  char id[16];
  std::snprintf(id, sizeof id, "%08x", std::uint32_t(std::random_device{}()));  // this save's files replace no file the old index names
  const auto stem = stem_of(index_json_);
  for (std::size_t i = 0; i < groups.size(); ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "-%05zu-of-%05zu.safetensors", i + 1, groups.size());
    names_.push_back(stem + "-" + id + name);
    files_.push_back(std::make_unique<SafetensorsWriter>((fs::path(dir_) / names_.back()).string(), groups[i], metadata, checksums));
    for (const auto& t : groups[i]) file_of_[t.name] = i;
  }
}

void SafetensorsSplitWriter::write(const std::string& name, std::uint64_t offset, const void* data, std::uint64_t n) {
  const auto it = file_of_.find(name);
  if (it == file_of_.end()) throw UsageError("safetensors: no tensor '" + name + "' in the split checkpoint '" + index_json_ + "'");
  files_[it->second]->write(name, offset, data, n);
}

void SafetensorsSplitWriter::commit() {
  for (auto& f : files_) f->commit();
  nlohmann::json j;
  j["metadata"] = metadata_;
  j["weight_map"] = nlohmann::json::object();
  for (const auto& [name, i] : file_of_) j["weight_map"][name] = names_[i];
  write_file_atomically(index_json_, j.dump(1));
  // The index names this save's files: earlier saves' files of the same stem go.
  const std::set<std::string> mine(names_.begin(), names_.end());
  const auto prefix = stem_of(index_json_) + "-";
  for (const auto& e : fs::directory_iterator(dir_.empty() ? "." : dir_)) {
    const auto name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0 && name.find("-of-") != std::string::npos && e.path().extension() == ".safetensors" && !mine.count(name))
      fs::remove(e.path());
  }
}

}  // namespace shardflow
