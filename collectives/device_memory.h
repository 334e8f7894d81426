// DeviceMemory: what the device transport (device_transport.h) needs from the accelerator besides
// the communicator: its own stream, staging buffers in device memory, and copies between host
// and device for the few host-memory messages a reshard sends (handshake records, message-tag
// records). CudaDeviceMemory is the real one (CUDA builds); tests use FakeDevice's
// (collectives/fake_nccl.h), which hands out host memory that it registers as "device" so that
// the fake NCCL communicator can refuse anything else, as NCCL refuses host pointers.
//
//   MORPH_ASSIGN_OR_RETURN(std::unique_ptr<DeviceMemory> mem, CudaDeviceMemory(device));
//   MORPH_ASSIGN_OR_RETURN(Buffer staging, mem->Allocate(4096));
//   MORPH_RETURN_IF_ERROR(mem->CopyToDevice(staging.data(), host_record, 16));  // on stream()
//
// Thread-safety: one owner thread (the transport's); the stream orders everything it enqueues.
#ifndef MORPH_COLLECTIVES_DEVICE_MEMORY_H_
#define MORPH_COLLECTIVES_DEVICE_MEMORY_H_

#include <cstddef>
#include <memory>
#include <string>

#include "morph/status.h"
#include "reshard/buffer.h"

namespace morph {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  // "cuda:0", "fake device": for messages.
  virtual std::string name() const = 0;
  // The stream everything of this device transport is enqueued on (CollectiveOp::stream: the
  // communicator's group runs after the copies enqueued before it). Null for the fake.
  virtual void* stream() const = 0;
  // True if [p, p + bytes) is memory the communicator can send from / receive into directly.
  virtual bool IsDevice(const void* p, size_t bytes) const = 0;
  // Device memory of `bytes` bytes (contents undefined); kResourceExhausted naming the size.
  virtual StatusOr<Buffer> Allocate(size_t bytes) = 0;
  // The allocator of Allocate, for the executor's staging (Transport::StagingAllocator).
  virtual Allocator StagingAllocator() = 0;
  // Enqueues host -> device on stream(); `src` must stay valid until the stream passed it
  // (the transport keeps it until its Wait returned).
  virtual Status CopyToDevice(void* dst, const void* src, size_t bytes) = 0;
  // Device -> host after everything enqueued on stream() so far; returns when done.
  virtual Status CopyToHost(void* dst, const void* src, size_t bytes) = 0;
};

// The CUDA device `device`, with a stream of its own (non-blocking). kUnavailable without a
// usable GPU, kUnimplemented in a build without CUDA. Any thread.
StatusOr<std::unique_ptr<DeviceMemory>> CudaDeviceMemory(int device);

}  // namespace morph

#endif  // MORPH_COLLECTIVES_DEVICE_MEMORY_H_
