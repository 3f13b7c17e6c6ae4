// torchpp._C: importing it runs the static TORCH_LIBRARY registrations of csrc/ops.
// No pybind11 here: the ops reach Python through torch.ops.torchpp.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
