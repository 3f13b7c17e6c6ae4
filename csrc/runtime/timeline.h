// Start/end of every action this rank ran in the last step, for the real-run Chrome trace.
// Host clock (system clock, shared by all ranks of a machine) for everything; on accelerators
// compute actions are re-timed from device events so they show when the kernels ran, not when
// they were launched.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/Event.h>

namespace torchpp::runtime {

struct ActionRecord {
  std::string action;  // "0F3", "1SEND_F3", ...
  double start_us = 0.0;
  double end_us = 0.0;
  // RECV actions: when the consumer's wait for the message returned.
  double arrived_us = -1.0;
};

double now_us();

class Timeline {
 public:
  explicit Timeline(c10::Device device);
  void begin_step();
  // Returns the index of the record, to be finished by end().
  size_t start(const std::string& action, bool compute);
  // The action's inputs arrived: its span starts now (waiting is not compute).
  void restart(size_t index);
  void end(size_t index);
  // Ends a host-timed record at `when_us` (an action another thread ran).
  void end_at(size_t index, double when_us);
  void arrived(const std::string& recv_action, double when_us);
  // Resolves device events into timestamps (waits for the device).
  void finish_step();
  const std::vector<ActionRecord>& records() const { return records_; }

 private:
  c10::Device device_;
  std::vector<ActionRecord> records_;
  struct DeviceSpan {
    size_t index;
    c10::Event start;
    c10::Event end;
  };
  std::vector<DeviceSpan> device_spans_;
  std::unique_ptr<c10::Event> reference_;
  double reference_us_ = 0.0;
};

}  // namespace torchpp::runtime
