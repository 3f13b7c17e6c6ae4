#include "ops/pass_groups.h"

#include <map>
#include <mutex>

namespace torchpp {
namespace {

thread_local Pass thread_pass = Pass::Forward;

struct Twins {
  std::mutex mutex;
  std::map<std::string, std::string> backward_of;
};

Twins& twins() {
  static Twins instance;
  return instance;
}

}  // namespace

PassGuard::PassGuard(Pass pass) : previous_(thread_pass) {
  thread_pass = pass;
}

PassGuard::~PassGuard() {
  thread_pass = previous_;
}

Pass current_pass() {
  return thread_pass;
}

void set_backward_group(const std::string& group_name, const std::string& twin_name) {
  auto& t = twins();
  std::lock_guard<std::mutex> lock(t.mutex);
  if (twin_name.empty()) {
    t.backward_of.erase(group_name);
  } else {
    t.backward_of[group_name] = twin_name;
  }
}

std::string group_for_current_pass(const std::string& group_name) {
  if (thread_pass == Pass::Forward) return group_name;
  auto& t = twins();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.backward_of.find(group_name);
  return it == t.backward_of.end() ? group_name : it->second;
}

}  // namespace torchpp
