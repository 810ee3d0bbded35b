// The CUDA runtime calls the runtime and the device backends need (streams, events, device memory,
// async copies), behind opaque handles so that code including this header builds without CUDA. In
// a build without CUDA (device_stub.cpp) every call throws CommError saying so; nothing here ever
// blocks on the GPU except the explicitly synchronous helpers.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace shardflow::cuda {

using Stream = void*;  // cudaStream_t
using Event = void*;   // cudaEvent_t

// Makes `device` current on the calling thread (CUDA's current device is per thread: every thread
// that touches a rank's memory or streams must call this first).
void set_device(int device);

// A non-blocking stream (it does not synchronise with the legacy default stream) at the highest
// priority when `high_priority`: communication kernels should not queue behind compute.
Stream stream_create(int device, bool high_priority);
void stream_destroy(Stream s);

// Events are created without timing (cheaper to record and to wait on).
Event event_create(int device);
void event_destroy(Event e);
void event_record(Event e, Stream s);
// `s` waits for the work before `e`'s last record, on the device: no host synchronisation.
void stream_wait_event(Stream s, Event e);

enum class Query { pending, done, failed };
// Non-blocking; on failure `error` (if given) gets CUDA's message.
Query event_query(Event e, std::string* error = nullptr);

// Zeroed device memory, freed when the last reference goes (cudaFree synchronises the device: keep
// such buffers long-lived, which buckets are).
std::shared_ptr<std::byte> device_alloc(int device, std::size_t bytes);
// Page-locked host memory: device-to-host copies into it are truly asynchronous.
std::shared_ptr<std::byte> pinned_alloc(std::size_t bytes);
// Where a pointer lives: -1 for host memory, else the CUDA device index.
int pointer_device(const void* p);

// Asynchronous on `s` (host memory may be pageable: the copy is then staged by the driver).
void memcpy_async(void* dst, const void* src, std::size_t bytes, Stream s);
void memset_async(void* dst, std::size_t bytes, Stream s);
void stream_sync(Stream s);  // for set-up, tests and benchmarks only

}  // namespace shardflow::cuda
