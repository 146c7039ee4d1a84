// attnrnn._C: importing it loads libattnrnn_torch, whose static initializers register the
// torch.ops.attnrnn operators. The module itself holds nothing.
#include <Python.h>

static PyModuleDef attnrnn_module = {PyModuleDef_HEAD_INIT, "_C", "attnrnn operator registrations", -1,
                                     nullptr, nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&attnrnn_module); }
