#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/stream.hpp"
#include "shardflow/errors.hpp"

namespace shardflow::cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // not sticky unless the context is gone: let later calls report their own
  throw CommError(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

}  // namespace

void set_device(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }

Stream stream_create(int device, bool high_priority) {
  set_device(device);
  int least = 0, greatest = 0;
  check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, high_priority ? greatest : least),
        "cudaStreamCreateWithPriority");
  return s;
}

void stream_destroy(Stream s) {
  if (s) cudaStreamDestroy(static_cast<cudaStream_t>(s));
}

Event event_create(int device) {
  set_device(device);
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  return e;
}

void event_destroy(Event e) {
  if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

void event_record(Event e, Stream s) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s)), "cudaEventRecord");
}

void stream_wait_event(Stream s, Event e) {
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(e), 0), "cudaStreamWaitEvent");
}

Query event_query(Event e, std::string* error) {
  const cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(e));
  if (r == cudaSuccess) return Query::done;
  if (r == cudaErrorNotReady) return Query::pending;
  cudaGetLastError();
  if (error) *error = std::string(cudaGetErrorName(r)) + " (" + cudaGetErrorString(r) + ")";
  return Query::failed;
}

std::shared_ptr<std::byte> device_alloc(int device, std::size_t bytes) {
  set_device(device);
  void* p = nullptr;
  const std::size_t rounded = bytes ? (bytes + 255) / 256 * 256 : 256;
  check(cudaMalloc(&p, rounded), ("cudaMalloc of " + std::to_string(rounded) + " bytes on cuda:" + std::to_string(device)).c_str());
  check(cudaMemset(p, 0, rounded), "cudaMemset");
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [device](std::byte* q) {
    cudaSetDevice(device);
    cudaFree(q);
  });
}

std::shared_ptr<std::byte> pinned_alloc(std::size_t bytes) {
  void* p = nullptr;
  check(cudaMallocHost(&p, bytes ? bytes : 1), "cudaMallocHost");
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [](std::byte* q) { cudaFreeHost(q); });
}

int pointer_device(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}

void memcpy_async(void* dst, const void* src, std::size_t bytes, Stream s) {
  if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(s)), "cudaMemcpyAsync");
}

void memset_async(void* dst, std::size_t bytes, Stream s) {
  if (bytes) check(cudaMemsetAsync(dst, 0, bytes, static_cast<cudaStream_t>(s)), "cudaMemsetAsync");
}

void stream_sync(Stream s) { check(cudaStreamSynchronize(static_cast<cudaStream_t>(s)), "cudaStreamSynchronize"); }

}  // namespace shardflow::cuda
