// safetensors without holding the whole file: an index of the tensors (name, dtype, shape, where
// its bytes are) to read ranges from, and a writer that lays out the header first and takes each
// tensor's bytes in pieces, at any offset, in any order. Checkpoints stream through these (Note
// [Checkpoints]): neither side ever holds more than a window beyond what it already keeps.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardflow/types.hpp"

namespace shardflow {

std::size_t safetensors_element_size(const std::string& dtype);  // 0: unknown

// CRC-32 (zlib's polynomial and value; computed by ISA-L) of n bytes, continuing from `crc` (0 to start).
std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t n);

// Checkpoint files carry each tensor's CRC-32 in their metadata under this key: a JSON object of
// tensor name -> 8 hex digits (Note [Checksums in the header]).
inline constexpr const char* kChecksumKey = "shardflow.crc32";


struct SafetensorsIndex {
  struct Entry {
    std::string dtype;
    Shape shape;
    std::uint64_t begin = 0, bytes = 0;  // absolute file offset of its data, and its length
    std::string file;                    // the file holding it, when not `path` (a split checkpoint)
  };
  std::string path;
  std::map<std::string, Entry> tensors;
  std::map<std::string, std::string> metadata;
  // Reads [offset, offset + n) of tensor `name`'s bytes; Error naming file and tensor if short.
  void read(const std::string& name, std::uint64_t offset, void* out, std::uint64_t n) const;
};
// Error naming the file (and the tensor) when it is missing, truncated or malformed.
SafetensorsIndex read_safetensors_index(const std::string& path);
// A checkpoint split over several files, as people lay out large safetensors: `index_json`
// (<name>.safetensors.index.json: {"metadata": {...}, "weight_map": {tensor: file}}) and the
// files it names, beside it, as one index. Error naming the file for a missing or short one, or a
// tensor its file does not hold.
SafetensorsIndex read_safetensors_split(const std::string& index_json);
// The files a split checkpoint's index names (paths beside it), without opening them.
std::vector<std::string> safetensors_split_files(const std::string& index_json);

// `content` under `path`, all or nothing: a temporary file, fsync, rename.
void write_file_atomically(const std::string& path, const std::string& content);
// The checksums of `index` (empty if it has none); Error naming the file if malformed.
std::map<std::string, std::uint32_t> safetensors_checksums(const SafetensorsIndex& index);

class SafetensorsWriter {
 public:
  struct Entry {
    std::string name, dtype;
    Shape shape;
  };
  // Writes the header to `path`.tmp.<pid>; nothing appears under `path` before commit().
  // `checksums`: each tensor's CRC-32 goes into the metadata under kChecksumKey at commit().
  SafetensorsWriter(std::string path, const std::vector<Entry>& tensors, const std::map<std::string, std::string>& metadata,
                    bool checksums = false);
  ~SafetensorsWriter();  // not committed: the temporary file goes
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  void write(const std::string& name, std::uint64_t offset, const void* data, std::uint64_t n);
  // fsync, then rename over `path`: a crash before this leaves the previous file as it was.
  void commit();

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  std::map<std::string, std::pair<std::uint64_t, std::uint64_t>> where_;  // begin, bytes
  // Checksums: each tensor's CRC over the bytes written in order so far (`written`), and where in
  // the file the reserved metadata value lies.
  struct Running {
    std::uint32_t crc = 0;
    std::uint64_t written = 0;
  };
  std::map<std::string, Running> running_;
  bool checksums_ = false;
  std::uint64_t checksum_at_ = 0;
  std::size_t checksum_len_ = 0;
};

// The writing side of read_safetensors_split: the tensors, in order, in files of at most
// `max_file_bytes` of data (a larger tensor alone in one) named <stem>-<id>-0000i-of-0000N.safetensors
// beside `index_json`, which commit() writes last (temporary file, fsync, rename), then removing
// the files of earlier saves the index no longer names. A crash before leaves the earlier save.
class SafetensorsSplitWriter {
 public:
  SafetensorsSplitWriter(std::string index_json, const std::vector<SafetensorsWriter::Entry>& tensors,
                         const std::map<std::string, std::string>& metadata, std::uint64_t max_file_bytes, bool checksums);
  void write(const std::string& name, std::uint64_t offset, const void* data, std::uint64_t n);
  void commit();
  std::size_t files() const { return files_.size(); }

 private:
  std::string index_json_, dir_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::string> names_;
  std::vector<std::unique_ptr<SafetensorsWriter>> files_;
  std::map<std::string, std::size_t> file_of_;
};

}  // namespace shardflow
