/* shmcache.format._arrays: the arrays of a value, made over the bytes that hold it.
 *
 * decode.py parses and checks a value's head once, then builds each array of the value over the
 * buffer: `array(buffer, offset, dtype, shape, writeable)` is that one step in C (numpy's C API: a
 * tenth of what `np.ndarray(shape, dtype, buffer=..., offset=...)` costs from Python, on every
 * hit). The array's base is `buffer`, so the bytes outlive it; it is C-contiguous and writable
 * only if asked and `buffer` is. Every bound is checked again here: a bad argument raises
 * ValueError or TypeError and makes nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

/* Dimensions a value's array may have (the value format's MAX_NDIM is lower). */
#define MAX_DIMS 32

/* The dimensions of `shape` (a tuple of ints, each >= 0) into `dims`, and the element count into
 * `count`; -1 with an error set otherwise (or if the count overflows). */
static int read_shape(PyObject *shape, npy_intp *dims, int *ndim, Py_ssize_t *count) {
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > MAX_DIMS) {
        PyErr_SetString(PyExc_TypeError, "array: shape must be a tuple of at most 32 ints");
        return -1;
    }
    *ndim = (int)PyTuple_GET_SIZE(shape);
    *count = 1;
    for (int i = 0; i < *ndim; i++) {
        Py_ssize_t dim = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (dim == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (dim < 0 || (dim > 0 && *count > PY_SSIZE_T_MAX / dim)) {
            PyErr_SetString(PyExc_ValueError, "array: a dimension is negative or the shape too large");
            return -1;
        }
        dims[i] = dim;
        *count *= dim;
    }
    return 0;
}

/* array(buffer, offset, dtype, shape, writeable): the C-contiguous array of `dtype` and `shape`
 * whose first byte is byte `offset` of `buffer` (a 1-D, C-contiguous uint8 ndarray; its base). */
static PyObject *array(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "array(buffer, offset, dtype, shape, writeable) takes 5 arguments, got %zd",
                     nargs);
        return NULL;
    }
    PyArrayObject *buffer = (PyArrayObject *)args[0];
    if (!PyArray_Check(args[0]) || PyArray_NDIM(buffer) != 1 || PyArray_TYPE(buffer) != NPY_UINT8 ||
        !PyArray_IS_C_CONTIGUOUS(buffer)) {
        PyErr_SetString(PyExc_TypeError, "array: the buffer must be a 1-D, C-contiguous uint8 ndarray");
        return NULL;
    }
    if (!PyArray_DescrCheck(args[2])) {
        PyErr_SetString(PyExc_TypeError, "array: dtype must be a numpy dtype");
        return NULL;
    }
    PyArray_Descr *dtype = (PyArray_Descr *)args[2];
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]), count, itemsize = PyDataType_ELSIZE(dtype);
    if (offset == -1 && PyErr_Occurred()) {
        return NULL;
    }
    npy_intp dims[MAX_DIMS];
    int ndim, writeable = PyObject_IsTrue(args[4]);
    if (writeable < 0 || read_shape(args[3], dims, &ndim, &count) < 0) {
        return NULL;
    }
    Py_ssize_t length = PyArray_DIM(buffer, 0);
    if (itemsize <= 0 || PyDataType_HASSUBARRAY(dtype) || PyDataType_REFCHK(dtype)) {
        PyErr_SetString(PyExc_TypeError, "array: dtype must be a plain fixed-size type");
        return NULL;
    }
    if (offset < 0 || offset > length || count > (length - offset) / itemsize) {
        PyErr_Format(PyExc_ValueError, "array: %zd items of %zd bytes at %zd overrun a buffer of %zd bytes", count,
                     itemsize, offset, length);
        return NULL;
    }
    int flags = writeable && PyArray_ISWRITEABLE(buffer) ? NPY_ARRAY_WRITEABLE : 0;
    Py_INCREF(dtype); /* stolen by the call, even on failure */
    PyObject *out = PyArray_NewFromDescr(&PyArray_Type, dtype, ndim, dims, NULL, PyArray_BYTES(buffer) + offset,
                                         flags, NULL);
    if (out == NULL) {
        return NULL;
    }
    if (PyArray_SetBaseObject((PyArrayObject *)out, Py_NewRef(args[0])) < 0) { /* stolen, even on failure */
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyMethodDef arrays_methods[] = {
    {"array", (PyCFunction)(void (*)(void))array, METH_FASTCALL,
     "array(buffer, offset, dtype, shape, writeable): the C-contiguous array of dtype and shape at byte "
     "offset of buffer (a 1-D, C-contiguous uint8 ndarray, its base); writable only if asked and buffer is."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef arrays_module = {
    PyModuleDef_HEAD_INIT, "shmcache.format._arrays", "The arrays of a value (see arrays.c).", -1, arrays_methods,
};

PyMODINIT_FUNC PyInit__arrays(void) {
    import_array1(NULL);
    return PyModule_Create(&arrays_module);
}
