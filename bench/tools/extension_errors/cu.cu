// bench/tools/extension_errors/probe_errors.py: errors raised from nvcc-compiled host code, built as csrc/ is.
#include <torch/extension.h>
#include <stdexcept>

__global__ void touch(int* x) { x[0] = 1; }
void cu_check() { TORCH_CHECK(false, "cu torch_check message"); }
void cu_num(int64_t k) { TORCH_CHECK(k < 0, "cu torch_check with a number: ", k); }
void cu_std() { throw std::runtime_error("cu std message"); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cu_check", &cu_check);
  m.def("cu_num", &cu_num);
  m.def("cu_std", &cu_std);
}
