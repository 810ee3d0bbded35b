// The suites read checkpoint files through the streaming safetensors index under this path; the
// header itself lives with the checkpoints (runtime/checkpoint/). Nothing in the library includes
// this one.
#pragma once
#include "runtime/checkpoint/safetensors_stream.hpp"
