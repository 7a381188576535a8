/* shmcache.format._arrays: the arrays of a value, made over the bytes that hold it.
 *
 * decode.py parses and checks a value's head once, then builds each array of the value over the
 * buffer: `array(buffer, offset, dtype, shape, writeable)` is that one step in C (numpy's C API: a
 * tenth of what `np.ndarray(shape, dtype, buffer=..., offset=...)` costs from Python, on every
 * hit). The array's base is `buffer`, so the bytes outlive it; it is C-contiguous and writable
 * only if asked and `buffer` is. Every bound is checked again here: a bad argument raises
 * ValueError or TypeError and makes nothing.
 *
 * A torch value is handed to torch as a DLPack capsule (`dlpack(buffer, offset, dltype,
 * shape)`; `torch.from_dlpack` takes it over): one tensor of any dtype torch exchanges over DLPack
 * (bfloat16 and float8 included, which numpy lacks), where `torch.from_numpy` needs a numpy array
 * first and a `.view` for those. The capsule's tensor holds a reference to `buffer` (its
 * `manager_ctx`) until torch calls its deleter, which may run in a thread without the GIL: it
 * takes the GIL for the decref, and does nothing once the interpreter is gone (the process is
 * exiting; the mapping goes with it). A capsule never taken over frees it in its destructor. The
 * type codes are not written here: `dltype(capsule)` reads them from a capsule torch made
 * (decode.py asks torch once per dtype), so they are always the codes this torch reads back.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <stdint.h>
#include <stdlib.h>

/* Dimensions a value's array may have (the value format's MAX_NDIM is lower). */
#define MAX_DIMS 32

/* The dimensions of `shape` (a tuple of ints, each >= 0) into `dims`, and the element count into
 * `count`; -1 with an error set otherwise (or if the count overflows). */
static int read_shape(PyObject *shape, npy_intp *dims, int *ndim, Py_ssize_t *count) {
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > MAX_DIMS) {
        PyErr_SetString(PyExc_TypeError, "shape must be a tuple of at most 32 ints");
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
            PyErr_SetString(PyExc_ValueError, "a dimension is negative or the shape too large");
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

/* The DLPack exchange ABI (dlpack.h, the unversioned "dltensor" capsule every DLPack consumer reads). */
typedef struct {
    int32_t device_type; /* 1: kDLCPU */
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

#define DLTENSOR "dltensor"
#define KDL_CPU 1

/* One allocation: the managed tensor, then its shape and strides (2 * ndim int64). */
typedef struct {
    DLManagedTensor managed;
    int64_t dims[];
} Exported;

/* The deleter torch calls when the tensor's storage dies, maybe in a thread without the GIL. */
static void release_exported(DLManagedTensor *self) {
    if (Py_IsInitialized()) {
        PyGILState_STATE gil = PyGILState_Ensure();
        Py_XDECREF((PyObject *)self->manager_ctx);
        PyGILState_Release(gil);
    }
    free(self);
}

/* A capsule no consumer took over (still named "dltensor") frees its tensor. */
static void capsule_destructor(PyObject *capsule) {
    if (PyCapsule_IsValid(capsule, DLTENSOR)) {
        DLManagedTensor *managed = PyCapsule_GetPointer(capsule, DLTENSOR);
        managed->deleter(managed);
    }
}

/* dlpack(buffer, offset, dltype, shape): a "dltensor" capsule of the C-contiguous CPU tensor of
 * DLPack type `dltype` (code, bits, lanes) and `shape` whose first byte is byte `offset` of `buffer` (a 1-D,
 * C-contiguous, writable uint8 ndarray, which the tensor keeps alive). */
static PyObject *dlpack(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "dlpack(buffer, offset, dltype, shape) takes 4 arguments, got %zd", nargs);
        return NULL;
    }
    PyArrayObject *buffer = (PyArrayObject *)args[0];
    if (!PyArray_Check(args[0]) || PyArray_NDIM(buffer) != 1 || PyArray_TYPE(buffer) != NPY_UINT8 ||
        !PyArray_IS_C_CONTIGUOUS(buffer) || !PyArray_ISWRITEABLE(buffer)) {
        PyErr_SetString(PyExc_TypeError, "dlpack: the buffer must be a 1-D, C-contiguous, writable uint8 ndarray");
        return NULL;
    }
    if (!PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) != 3) {
        PyErr_SetString(PyExc_TypeError, "dlpack: dltype must be a tuple (code, bits, lanes)");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    long code = PyLong_AsLong(PyTuple_GET_ITEM(args[2], 0)), bits = PyLong_AsLong(PyTuple_GET_ITEM(args[2], 1)),
         lanes = PyLong_AsLong(PyTuple_GET_ITEM(args[2], 2));
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (code < 0 || code > UINT8_MAX || bits <= 0 || bits > UINT8_MAX || lanes <= 0 || lanes > UINT16_MAX ||
        (bits * lanes) % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "dlpack: not a DLPack type of whole bytes");
        return NULL;
    }
    npy_intp dims[MAX_DIMS];
    int ndim;
    Py_ssize_t count, itemsize = bits * lanes / 8, length = PyArray_DIM(buffer, 0);
    if (read_shape(args[3], dims, &ndim, &count) < 0) {
        return NULL;
    }
    if (offset < 0 || offset > length || count > (length - offset) / itemsize) {
        PyErr_Format(PyExc_ValueError, "dlpack: %zd items of %zd bytes at %zd overrun a buffer of %zd bytes", count,
                     itemsize, offset, length);
        return NULL;
    }
    Exported *exported = malloc(sizeof(Exported) + 2 * (size_t)ndim * sizeof(int64_t));
    if (exported == NULL) {
        return PyErr_NoMemory();
    }
    int64_t *shape = exported->dims, *strides = exported->dims + ndim, step = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        shape[i] = dims[i];
        strides[i] = step;
        step *= dims[i] > 1 ? dims[i] : 1;
    }
    exported->managed = (DLManagedTensor){
        .dl_tensor = {.data = PyArray_BYTES(buffer) + offset,
                      .device = {KDL_CPU, 0},
                      .ndim = ndim,
                      .dtype = {(uint8_t)code, (uint8_t)bits, (uint16_t)lanes},
                      .shape = shape,
                      .strides = strides,
                      .byte_offset = 0},
        .manager_ctx = Py_NewRef(args[0]),
        .deleter = release_exported,
    };
    PyObject *capsule = PyCapsule_New(&exported->managed, DLTENSOR, capsule_destructor);
    if (capsule == NULL) {
        release_exported(&exported->managed);
    }
    return capsule;
}

/* dltype(capsule): (code, bits, lanes) of the tensor in a "dltensor" capsule not yet taken over. */
static PyObject *dltype(PyObject *Py_UNUSED(module), PyObject *capsule) {
    DLManagedTensor *managed = PyCapsule_GetPointer(capsule, DLTENSOR);
    if (managed == NULL) {
        return NULL;
    }
    DLDataType type = managed->dl_tensor.dtype;
    return Py_BuildValue("(iii)", type.code, type.bits, type.lanes);
}

static PyMethodDef arrays_methods[] = {
    {"array", (PyCFunction)(void (*)(void))array, METH_FASTCALL,
     "array(buffer, offset, dtype, shape, writeable): the C-contiguous array of dtype and shape at byte "
     "offset of buffer (a 1-D, C-contiguous uint8 ndarray, its base); writable only if asked and buffer is."},
    {"dlpack", (PyCFunction)(void (*)(void))dlpack, METH_FASTCALL,
     "dlpack(buffer, offset, dltype, shape): a 'dltensor' capsule of the C-contiguous CPU tensor of DLPack "
     "type dltype (code, bits, lanes) and shape at byte offset of buffer (a writable 1-D uint8 ndarray, kept alive by it)."},
    {"dltype", dltype, METH_O, "dltype(capsule): (code, bits, lanes) of the tensor in a 'dltensor' capsule."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef arrays_module = {
    PyModuleDef_HEAD_INIT, "shmcache.format._arrays", "The arrays of a value (see arrays.c).", -1, arrays_methods,
};

PyMODINIT_FUNC PyInit__arrays(void) {
    import_array1(NULL);
    return PyModule_Create(&arrays_module);
}
