// Built instead of the .cu files when shardflow is configured without CUDA (SHARDFLOW_CUDA=OFF or
// no nvcc): every entry point that needs a GPU says so instead of failing later in a stranger way.
#include <string>

#include "kernels/cuda/device.hpp"
#include "kernels/cuda/stream.hpp"
#include "shardflow/errors.hpp"

namespace shardflow::cuda {
namespace {

[[noreturn]] void no_cuda(const char* what) {
  throw CommError(std::string(what) + ": shardflow was built without CUDA (rebuild with SHARDFLOW_CUDA=ON where nvcc exists)");
}

}  // namespace

bool compiled_with_cuda() { return false; }
int device_count() { return 0; }
std::string describe() { return "built without CUDA (SHARDFLOW_CUDA=OFF or no nvcc at configure time)"; }
void scale_f32_sync(float*, std::size_t, float) { no_cuda("scale_f32_sync"); }

void set_device(int) { no_cuda("set_device"); }
Stream stream_create(int, bool) { no_cuda("stream_create"); }
void stream_destroy(Stream) {}
Event event_create(int) { no_cuda("event_create"); }
void event_destroy(Event) {}
void event_record(Event, Stream) { no_cuda("event_record"); }
void stream_wait_event(Stream, Event) { no_cuda("stream_wait_event"); }
Query event_query(Event, std::string*) { no_cuda("event_query"); }
std::shared_ptr<std::byte> device_alloc(int, std::size_t) { no_cuda("device_alloc"); }
std::shared_ptr<std::byte> pinned_alloc(std::size_t) { no_cuda("pinned_alloc"); }
int pointer_device(const void*) { return -1; }
void memcpy_async(void*, const void*, std::size_t, Stream) { no_cuda("memcpy_async"); }
void memset_async(void*, std::size_t, Stream) { no_cuda("memset_async"); }
void stream_sync(Stream) { no_cuda("stream_sync"); }

}  // namespace shardflow::cuda
