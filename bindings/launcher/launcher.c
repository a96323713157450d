/* _abp_launch: the compiled launcher of the abp Python package.
 *
 * One function, launch(entry, kernel, device, n, stream, *args), turns a launch's arguments into
 * the 8-byte words abp_kernel_launch reads and calls it with the GIL released. Each argument is
 * an int (an address, an i64 or the bits of an f32, taken modulo 2^64) or a tensor, whose
 * data_ptr() is read here. Doing this in C instead of building two ctypes arrays per launch is
 * most of what makes an abp call as cheap on the host as the torch op it replaces
 * (docs/design.md, "The launch path").
 *
 * It links against nothing: `entry` is the address of abp_kernel_launch in the libabp.so that
 * ctypes loaded, so one libabp serves both launchers. Built against Python's stable ABI (3.9),
 * so one module serves every CPython 3 from 3.9 on. */
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x03090000
#include <Python.h>
#include <stdint.h>

typedef int (*abp_launch_entry)(void *kernel, int device, void **args, int nargs, int64_t n, void *stream);

/* The most arguments one kernel takes: the manifest reader refuses more (kMaxKernelArgs,
 * runtime/Manifest.h). */
enum { kMaxArgs = 64 };

/* The word of one argument: an int as it is, anything else through its data_ptr(). */
static int word_of(PyObject *arg, Py_ssize_t index, uint64_t *word) {
  PyObject *value = arg;
  if (!PyLong_Check(arg)) {
    if (!PyObject_HasAttrString(arg, "data_ptr")) {
      PyErr_Format(PyExc_TypeError, "launch: argument %zd must be an int or a tensor, got an object "
                   "without data_ptr()", index);
      return -1;
    }
    value = PyObject_CallMethod(arg, "data_ptr", NULL);
    if (!value)
      return -1; /* data_ptr()'s own error (a tensor without storage) */
  }
  *word = (uint64_t)PyLong_AsUnsignedLongLongMask(value);
  if (value != arg)
    Py_DECREF(value);
  return PyErr_Occurred() ? -1 : 0;
}

static PyObject *launch(PyObject *self, PyObject *args) {
  (void)self;
  Py_ssize_t count = PyTuple_Size(args);
  if (count < 5) {
    PyErr_SetString(PyExc_TypeError, "launch(entry, kernel, device, n, stream, *args): too few arguments");
    return NULL;
  }
  Py_ssize_t nargs = count - 5;
  if (nargs > kMaxArgs) {
    PyErr_Format(PyExc_ValueError, "launch: %zd kernel arguments, at most %d", nargs, (int)kMaxArgs);
    return NULL;
  }
  /* Each conversion is checked before the next: the C API must not run with an error set. */
  void *entry = PyLong_AsVoidPtr(PyTuple_GetItem(args, 0));
  if (PyErr_Occurred())
    return NULL;
  void *kernel = PyLong_AsVoidPtr(PyTuple_GetItem(args, 1));
  if (PyErr_Occurred())
    return NULL;
  long device = PyLong_AsLong(PyTuple_GetItem(args, 2));
  if (PyErr_Occurred())
    return NULL;
  long long n = PyLong_AsLongLong(PyTuple_GetItem(args, 3));
  if (PyErr_Occurred())
    return NULL;
  PyObject *stream_arg = PyTuple_GetItem(args, 4);
  void *stream = stream_arg == Py_None ? NULL : PyLong_AsVoidPtr(stream_arg);
  if (PyErr_Occurred())
    return NULL;
  if (!entry || !kernel) {
    PyErr_SetString(PyExc_ValueError, "launch: entry and kernel must be non-null addresses");
    return NULL;
  }
  uint64_t words[kMaxArgs];
  void *pointers[kMaxArgs];
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    if (word_of(PyTuple_GetItem(args, 5 + i), i, &words[i]) < 0)
      return NULL;
    pointers[i] = &words[i];
  }
  int status;
  Py_BEGIN_ALLOW_THREADS
  status = ((abp_launch_entry)entry)(kernel, (int)device, pointers, (int)nargs, (int64_t)n, stream);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(status);
}

static PyMethodDef methods[] = {
    {"launch", launch, METH_VARARGS,
     "launch(entry, kernel, device, n, stream, *args) -> status of abp_kernel_launch"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_abp_launch",
                                    "The compiled launcher of abp (abp_kernel_launch without ctypes).",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__abp_launch(void) { return PyModule_Create(&module); }
