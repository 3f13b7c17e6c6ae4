#include "runtime/timeline.h"

#include <chrono>

#include <c10/core/impl/VirtualGuardImpl.h>

namespace torchpp::runtime {
namespace {

bool on_accelerator(c10::Device device) {
  return device.type() != c10::DeviceType::CPU;
}

c10::Event timing_event(c10::Device device) {
  return c10::Event(device.type(), c10::EventFlag::BACKEND_DEFAULT);
}

c10::Stream current_stream(c10::Device device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

}  // namespace

double now_us() {
  using namespace std::chrono;
  return static_cast<double>(duration_cast<nanoseconds>(system_clock::now().time_since_epoch()).count()) / 1000.0;
}

Timeline::Timeline(c10::Device device) : device_(device) {}

void Timeline::begin_step() {
  records_.clear();
  device_spans_.clear();
  if (on_accelerator(device_)) {
    reference_ = std::make_unique<c10::Event>(timing_event(device_));
    reference_->record(current_stream(device_));
    reference_->synchronize();
    reference_us_ = now_us();
  }
}

size_t Timeline::start(const std::string& action, bool compute) {
  records_.push_back(ActionRecord{action, now_us(), 0.0, -1.0});
  if (compute && on_accelerator(device_)) {
    device_spans_.push_back(DeviceSpan{records_.size() - 1, timing_event(device_), timing_event(device_)});
    device_spans_.back().start.record(current_stream(device_));
  }
  return records_.size() - 1;
}

void Timeline::restart(size_t index) {
  records_[index].start_us = now_us();
  if (!device_spans_.empty() && device_spans_.back().index == index) {
    device_spans_.back().start.record(current_stream(device_));
  }
}

void Timeline::end(size_t index) {
  records_[index].end_us = now_us();
  if (!device_spans_.empty() && device_spans_.back().index == index) {
    device_spans_.back().end.record(current_stream(device_));
  }
}

void Timeline::end_at(size_t index, double when_us) {
  records_[index].end_us = when_us;
}

void Timeline::arrived(const std::string& recv_action, double when_us) {
  for (auto it = records_.rbegin(); it != records_.rend(); ++it) {
    if (it->action == recv_action) {
      it->arrived_us = when_us;
      return;
    }
  }
}

void Timeline::finish_step() {
  // One host wait per step, for the last span: those before it ran earlier on the same stream
  // (a span recorded on another stream, still running, is waited on by itself).
  if (!device_spans_.empty()) {
    device_spans_.back().end.synchronize();
  }
  for (auto& span : device_spans_) {
    if (!span.end.query()) {
      span.end.synchronize();
    }
    auto& record = records_[span.index];
    record.start_us = reference_us_ + reference_->elapsedTime(span.start) * 1000.0;
    record.end_us = reference_us_ + reference_->elapsedTime(span.end) * 1000.0;
  }
  device_spans_.clear();
}

}  // namespace torchpp::runtime
