// A model's parameters as a file, for planning a run before paying for it (`shardflow plan`):
// a JSON list in registration order, `[{"name": "...", "shape": [..], "dtype": "float32"}, ...]`,
// or a .safetensors file, whose header lists the tensors (taken in the header's order; the data
// is not read).
#pragma once

#include <string>
#include <vector>

#include "shardflow/types.hpp"

namespace shardflow {

// UsageError naming the file and the entry when it is missing, not JSON, or an entry lacks a
// name, has a negative or non-integer dimension, or an unknown dtype. "dtype" may be left out
// (float32); torch's spellings (float32, bfloat16, float16) and safetensors' (F32, BF16, F16) work.
std::vector<ParamSpec> read_param_list(const std::string& path);

// The same from text already in memory (`what` names it in errors).
std::vector<ParamSpec> parse_param_list(const std::string& json_text, const std::string& what);

}  // namespace shardflow
