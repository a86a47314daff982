/* The extension module `wide_compiler._C`. It exists to load libwide: the library's static
 * initialisers register every operator in torch.ops.wide. It defines no functions; the operators
 * are reached through torch.ops, never through this module. `import torch` must come first so that
 * libtorch is already loaded. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef wide_c_module = {
    PyModuleDef_HEAD_INIT, "_C", "Loads the wide_compiler C++ core (torch.ops.wide).", -1, NULL,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&wide_c_module); }
