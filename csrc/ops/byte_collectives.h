// Byte-string collectives under torchpp's object gathers and broadcasts
// (torchpp/parallel/object_collectives.py pickles; these move the bytes).
//
// Their buffers are made here, so no Python object is ever attached to them. gloo's worker thread
// may drop a finished collective's last reference after the caller has returned; dropping a
// tensor Python has seen takes the GIL, and a worker that asks for the GIL while the interpreter
// exits kills the process ("terminate called without an active exception",
// pytorch/pytorch#190489). torch.distributed's all_gather_object makes its buffers in Python, so a
// script that exits (or raises) right after one can abort instead.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/Device.h>

namespace torchpp {

// Every rank's `mine`, in group-rank order. Buffers live on `device` (the group's backend's).
std::vector<std::string> all_gather_bytes(const std::string& group_name, const std::string& mine,
                                          c10::Device device);

// The bytes of group rank `src`, on every rank of the group (`mine` is ignored elsewhere).
std::string broadcast_bytes(const std::string& group_name, int64_t src, const std::string& mine, c10::Device device);

}  // namespace torchpp
