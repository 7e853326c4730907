// Crash probe for bench/extension_errors/probe_errors.py: a SIGSEGV handler that prints the native stack (the frames
// Python's faulthandler does not show), and errors raised from g++-compiled extension code.
#include <torch/extension.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>
#include <stdexcept>

static void on_segv(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  _exit(100 + sig);
}
void install() { signal(SIGSEGV, on_segv); }
void cpp_check() { TORCH_CHECK(false, "cpp torch_check message"); }
void cpp_num(int64_t k) { TORCH_CHECK(k < 0, "cpp torch_check with a number: ", k); }
void cpp_std() { throw std::runtime_error("cpp std message"); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("cpp_check", &cpp_check);
  m.def("cpp_num", &cpp_num);
  m.def("cpp_std", &cpp_std);
}
