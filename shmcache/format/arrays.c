/* shmcache.format._arrays: the arrays of a value, made over the bytes that hold it.
 *
 * decode.py parses and checks a value's head once, and gives each array a recipe (`Recipe` in
 * reading.py; read here by position): where it lies, and how it is made. `build(buffer, base,
 * recipe)` makes it over `buffer` (a 1-D, C-contiguous uint8 ndarray; the value's first byte is
 * byte `base`), in one call:
 *
 * - a numpy array (numpy's C API: a tenth of what `np.ndarray(shape, dtype, buffer=...)` costs
 *   from Python), read-only, or handed to `torch.from_numpy` when the value is a tensor of a dtype
 *   numpy has (writable: torch has no read-only tensors);
 * - a tensor of a dtype numpy lacks (bfloat16, float8, complex32 ...): a "dltensor" capsule over the
 *   bytes, handed to `torch.from_dlpack`: one tensor in one step, where `from_numpy` needs an
 *   integer array and a `.view`. The capsule's tensor holds a reference to `buffer` (its
 *   `manager_ctx`) until torch calls its deleter, which runs without the GIL, maybe in a thread
 *   Python does not know: it takes the GIL for the decref (at interpreter exit, only in the
 *   finalizing thread; any other leaves it to the exit). A capsule never taken over frees it in
 *   its destructor. The
 *   type codes are not written here: `dltype(capsule)` reads them from a capsule torch made
 *   (reading.py asks torch once per dtype), so they are the codes this torch reads back.
 *
 * Every array's base is `buffer` (the DLPack tensor's owner), so the bytes outlive it. Every bound
 * is checked again here: a bad argument raises ValueError or TypeError and makes nothing.
 *
 * `deliver(buffer, base, recipe, record_type, sealed, parsed)` is a hit's delivery of a one-array
 * value (process/views.py): the value, and the record a repeat hit aliases it by, made together:
 * `record_type(sealed, weakref(buffer), parsed, weakref(value), signature, recipe's aliasing,
 * None)` (mappings.py's `Mapping`, made by position as `tuple.__new__` makes it), where the
 * signature is what the aliasing's `signature` reads from the value as returned: (shape,
 * strides, dtype, writeable) of an array, (data_ptr, shape, strides, dtype) of a tensor (its
 * layout is the recipe's). `deliver_many` is `deliver` of a batch, all or none.
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
 * `count`; -1 with an error set otherwise, or if the bytes the C-contiguous strides of items of
 * `itemsize` span (the dimensions' product with each 0 counted as 1) overflow. */
static int read_shape(PyObject *shape, Py_ssize_t itemsize, npy_intp *dims, int *ndim, Py_ssize_t *count) {
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > MAX_DIMS) {
        PyErr_SetString(PyExc_TypeError, "shape must be a tuple of at most 32 ints");
        return -1;
    }
    *ndim = (int)PyTuple_GET_SIZE(shape);
    *count = 1;
    Py_ssize_t span = 1, limit = PY_SSIZE_T_MAX / itemsize;
    for (int i = 0; i < *ndim; i++) {
        Py_ssize_t dim = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (dim == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (dim < 0 || (dim > 0 && span > limit / dim)) {
            PyErr_SetString(PyExc_ValueError, "a dimension is negative or the shape too large");
            return -1;
        }
        dims[i] = dim;
        *count *= dim;
        span *= dim > 0 ? dim : 1;
    }
    return 0;
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

/* The deleter torch calls when the tensor's storage dies, without the GIL (torch lets it go
 * first), maybe in a thread Python does not know. During the interpreter's finalization
 * (`Py_IsInitialized` is 0 by then) the finalizing thread still has its thread state: it lets
 * the buffer go; any other thread leaves it to the exit. */
static void release_exported(DLManagedTensor *self) {
    if (Py_IsInitialized() || PyGILState_GetThisThreadState() != NULL) {
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

/* The method names called on a tensor, interned once (at import). */
static PyObject *view_name, *data_ptr_name;

/* A recipe's fields (reading.py's `Recipe`, in its order). */
enum { R_OFFSET, R_NP_DTYPE, R_DLPACK, R_SHAPE, R_TO_TORCH, R_VIEW_AS, R_LAYOUT, R_ALIASING, R_FIELDS };

/* `buffer` if it is a 1-D, C-contiguous uint8 ndarray; NULL with TypeError otherwise. */
static PyArrayObject *byte_buffer(PyObject *buffer) {
    PyArrayObject *array = (PyArrayObject *)buffer;
    if (!PyArray_Check(buffer) || PyArray_NDIM(array) != 1 || PyArray_TYPE(array) != NPY_UINT8 ||
        !PyArray_IS_C_CONTIGUOUS(array)) {
        PyErr_SetString(PyExc_TypeError, "the buffer must be a 1-D, C-contiguous uint8 ndarray");
        return NULL;
    }
    return array;
}

/* 0 if `count` items of `itemsize` bytes at `offset` lie inside `buffer`; -1 with ValueError. */
static int check_fits(PyArrayObject *buffer, Py_ssize_t offset, Py_ssize_t count, Py_ssize_t itemsize) {
    Py_ssize_t length = PyArray_DIM(buffer, 0);
    if (offset < 0 || offset > length || count > (length - offset) / itemsize) {
        PyErr_Format(PyExc_ValueError, "%zd items of %zd bytes at %zd overrun a buffer of %zd bytes", count, itemsize,
                     offset, length);
        return -1;
    }
    return 0;
}

/* The C-contiguous numpy array of `dtype` and `shape` at byte `offset` of `buffer` (its base);
 * writable only if asked and `buffer` is. */
static PyObject *make_array(PyArrayObject *buffer, Py_ssize_t offset, PyObject *dtype_object, PyObject *shape,
                            int writeable) {
    if (!PyArray_DescrCheck(dtype_object)) {
        PyErr_SetString(PyExc_TypeError, "a recipe's np_dtype must be a numpy dtype");
        return NULL;
    }
    PyArray_Descr *dtype = (PyArray_Descr *)dtype_object;
    Py_ssize_t count, itemsize = PyDataType_ELSIZE(dtype);
    if (itemsize <= 0 || PyDataType_HASSUBARRAY(dtype) || PyDataType_REFCHK(dtype)) {
        PyErr_SetString(PyExc_TypeError, "a recipe's np_dtype must be a plain fixed-size type");
        return NULL;
    }
    npy_intp dims[MAX_DIMS];
    int ndim;
    if (read_shape(shape, itemsize, dims, &ndim, &count) < 0 || check_fits(buffer, offset, count, itemsize) < 0) {
        return NULL;
    }
    int flags = writeable && PyArray_ISWRITEABLE(buffer) ? NPY_ARRAY_WRITEABLE : 0;
    Py_INCREF(dtype); /* stolen by the call, even on failure */
    PyObject *out = PyArray_NewFromDescr(&PyArray_Type, dtype, ndim, dims, NULL, PyArray_BYTES(buffer) + offset,
                                         flags, NULL);
    if (out == NULL) {
        return NULL;
    }
    if (PyArray_SetBaseObject((PyArrayObject *)out, Py_NewRef(buffer)) < 0) { /* stolen, even on failure */
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* A "dltensor" capsule of the C-contiguous CPU tensor of DLPack type `dltype` (code, bits, lanes)
 * and `shape` at byte `offset` of `buffer` (writable: a tensor always is), which it keeps alive. */
static PyObject *make_capsule(PyArrayObject *buffer, Py_ssize_t offset, PyObject *dltype, PyObject *shape) {
    if (!PyArray_ISWRITEABLE(buffer)) {
        PyErr_SetString(PyExc_TypeError, "a tensor's buffer must be writable");
        return NULL;
    }
    if (!PyTuple_Check(dltype) || PyTuple_GET_SIZE(dltype) != 3) {
        PyErr_SetString(PyExc_TypeError, "a recipe's dlpack must be a tuple (code, bits, lanes)");
        return NULL;
    }
    long fields[3];
    for (int i = 0; i < 3; i++) {
        fields[i] = PyLong_AsLong(PyTuple_GET_ITEM(dltype, i));
        if (fields[i] == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    long code = fields[0], bits = fields[1], lanes = fields[2];
    if (code < 0 || code > UINT8_MAX || bits <= 0 || bits > UINT8_MAX || lanes <= 0 || lanes > UINT16_MAX ||
        (bits * lanes) % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "a recipe's dlpack is not a DLPack type of whole bytes");
        return NULL;
    }
    npy_intp dims[MAX_DIMS];
    int ndim;
    Py_ssize_t count, itemsize = bits * lanes / 8;
    if (read_shape(shape, itemsize, dims, &ndim, &count) < 0 || check_fits(buffer, offset, count, itemsize) < 0) {
        return NULL;
    }
    Exported *exported = malloc(sizeof(Exported) + 2 * (size_t)ndim * sizeof(int64_t));
    if (exported == NULL) {
        return PyErr_NoMemory();
    }
    int64_t *sizes = exported->dims, *strides = exported->dims + ndim, step = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        sizes[i] = dims[i];
        strides[i] = step;
        step *= dims[i] > 1 ? dims[i] : 1;
    }
    exported->managed = (DLManagedTensor){
        .dl_tensor = {.data = PyArray_BYTES(buffer) + offset,
                      .device = {KDL_CPU, 0},
                      .ndim = ndim,
                      .dtype = {(uint8_t)code, (uint8_t)bits, (uint16_t)lanes},
                      .shape = sizes,
                      .strides = strides,
                      .byte_offset = 0},
        .manager_ctx = Py_NewRef(buffer),
        .deleter = release_exported,
    };
    PyObject *capsule = PyCapsule_New(&exported->managed, DLTENSOR, capsule_destructor);
    if (capsule == NULL) {
        release_exported(&exported->managed);
    }
    return capsule;
}

/* The array `recipe` describes, over `buffer` whose byte `base` is the value's first. */
static PyObject *make(PyObject *buffer_object, PyObject *base_object, PyObject *recipe) {
    PyArrayObject *buffer = byte_buffer(buffer_object);
    if (buffer == NULL) {
        return NULL;
    }
    if (!PyTuple_Check(recipe) || PyTuple_GET_SIZE(recipe) != R_FIELDS) {
        PyErr_SetString(PyExc_TypeError, "a recipe must be a tuple of 8 fields (reading.Recipe)");
        return NULL;
    }
    Py_ssize_t base = PyLong_AsSsize_t(base_object);
    if (base == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t within = PyLong_AsSsize_t(PyTuple_GET_ITEM(recipe, R_OFFSET));
    if (within == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (base < 0 || within < 0 || base > PY_SSIZE_T_MAX - within) {
        PyErr_SetString(PyExc_ValueError, "an array's offset is negative or too large");
        return NULL;
    }
    PyObject *np_dtype = PyTuple_GET_ITEM(recipe, R_NP_DTYPE), *to_torch = PyTuple_GET_ITEM(recipe, R_TO_TORCH);
    PyObject *shape = PyTuple_GET_ITEM(recipe, R_SHAPE), *made, *value;
    if (np_dtype != Py_None) {
        made = make_array(buffer, base + within, np_dtype, shape, to_torch != Py_None);
        if (made == NULL || to_torch == Py_None) {
            return made; /* a numpy value */
        }
    } else {
        made = make_capsule(buffer, base + within, PyTuple_GET_ITEM(recipe, R_DLPACK), shape);
        if (made == NULL) {
            return NULL;
        }
    }
    value = PyObject_CallOneArg(to_torch, made);
    Py_DECREF(made);
    PyObject *view_as = PyTuple_GET_ITEM(recipe, R_VIEW_AS);
    if (value == NULL || view_as == Py_None) {
        return value;
    }
    PyObject *viewed = PyObject_CallMethodOneArg(value, view_name, view_as);
    Py_DECREF(value);
    return viewed;
}

/* build(buffer, base, recipe): the array `recipe` describes (see the top of this file). */
static PyObject *build(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "build(buffer, base, recipe) takes 3 arguments, got %zd", nargs);
        return NULL;
    }
    return make(args[0], args[1], args[2]);
}

/* What the recipe's aliasing reads from `value` as `signature` (see the top of this file). */
static PyObject *signature_of(PyObject *value, PyObject *recipe) {
    PyObject *layout = PyTuple_GET_ITEM(recipe, R_LAYOUT);
    if (layout == Py_None) { /* a numpy array: read-only, as made */
        if (!PyArray_Check(value)) {
            PyErr_SetString(PyExc_TypeError, "a recipe without a layout must make a numpy array");
            return NULL;
        }
        PyArrayObject *array = (PyArrayObject *)value;
        int ndim = PyArray_NDIM(array);
        PyObject *shape = PyTuple_New(ndim), *strides = PyTuple_New(ndim);
        if (shape == NULL || strides == NULL) {
            Py_XDECREF(shape);
            Py_XDECREF(strides);
            return NULL;
        }
        for (int i = 0; i < ndim; i++) {
            PyObject *dim = PyLong_FromSsize_t(PyArray_DIM(array, i));
            PyObject *step = PyLong_FromSsize_t(PyArray_STRIDE(array, i));
            if (dim == NULL || step == NULL) {
                Py_XDECREF(dim);
                Py_XDECREF(step);
                Py_DECREF(shape);
                Py_DECREF(strides);
                return NULL;
            }
            PyTuple_SET_ITEM(shape, i, dim);
            PyTuple_SET_ITEM(strides, i, step);
        }
        PyObject *writeable = PyBool_FromLong(PyArray_ISWRITEABLE(array));
        PyObject *signature = PyTuple_Pack(4, shape, strides, (PyObject *)PyArray_DESCR(array), writeable);
        Py_DECREF(shape);
        Py_DECREF(strides);
        Py_DECREF(writeable);
        return signature;
    }
    if (!PyTuple_Check(layout) || PyTuple_GET_SIZE(layout) != 3) {
        PyErr_SetString(PyExc_TypeError, "a recipe's layout must be a tuple (shape, strides, dtype)");
        return NULL;
    }
    PyObject *pointer = PyObject_CallMethodNoArgs(value, data_ptr_name);
    if (pointer == NULL) {
        return NULL;
    }
    PyObject *signature = PyTuple_Pack(4, pointer, PyTuple_GET_ITEM(layout, 0), PyTuple_GET_ITEM(layout, 1),
                                       PyTuple_GET_ITEM(layout, 2));
    Py_DECREF(pointer);
    return signature;
}

/* `record_type` if it is a tuple subclass; NULL with TypeError otherwise. */
static PyTypeObject *record_type_of(PyObject *type) {
    if (!PyType_Check(type) || !PyType_IsSubtype((PyTypeObject *)type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "record_type must be a tuple subclass");
        return NULL;
    }
    return (PyTypeObject *)type;
}

/* (value, record) of one hit (see the top of this file); `make` checks the recipe first. */
static PyObject *deliver_one(PyObject *buffer, PyObject *base, PyObject *recipe, PyTypeObject *record_type,
                             PyObject *sealed, PyObject *parsed) {
    PyObject *value = make(buffer, base, recipe);
    if (value == NULL) {
        return NULL;
    }
    PyObject *out = NULL, *fields = NULL, *signature = signature_of(value, recipe);
    PyObject *holder = signature == NULL ? NULL : PyWeakref_NewRef(buffer, NULL);
    PyObject *template = holder == NULL ? NULL : PyWeakref_NewRef(value, NULL);
    if (template != NULL) {
        fields = PyTuple_Pack(7, sealed, holder, parsed, template, signature, PyTuple_GET_ITEM(recipe, R_ALIASING),
                              Py_None);
    }
    if (fields != NULL) { /* tuple.__new__(record_type, fields), as a NamedTuple's `_make` */
        PyObject *args = PyTuple_Pack(1, fields);
        PyObject *record = args == NULL ? NULL : PyTuple_Type.tp_new(record_type, args, NULL);
        Py_XDECREF(args);
        if (record != NULL) {
            out = PyTuple_Pack(2, value, record);
            Py_DECREF(record);
        }
    }
    Py_XDECREF(fields);
    Py_XDECREF(template);
    Py_XDECREF(holder);
    Py_XDECREF(signature);
    Py_DECREF(value);
    return out;
}

/* deliver(buffer, base, recipe, record_type, sealed, parsed): (value, record) of a hit (see the top
 * of this file); `record_type` is a tuple subclass of 7 fields. */
static PyObject *deliver(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError,
                     "deliver(buffer, base, recipe, record_type, sealed, parsed) takes 6 arguments, got %zd", nargs);
        return NULL;
    }
    PyTypeObject *record_type = record_type_of(args[3]);
    if (record_type == NULL) {
        return NULL;
    }
    return deliver_one(args[0], args[1], args[2], record_type, args[4], args[5]);
}

/* deliver_many(buffers, base, recipes, record_type, sealeds, parseds): `deliver` of each hit of a
 * batch (four lists of one length), as a list of (value, record) pairs in their order; all or none:
 * on a failure the values already made are dropped (the caller holds their buffers: no buffer
 * dies here). */
static PyObject *deliver_many(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError,
                     "deliver_many(buffers, base, recipes, record_type, sealeds, parseds) takes 6 arguments, got %zd",
                     nargs);
        return NULL;
    }
    PyTypeObject *record_type = record_type_of(args[3]);
    if (record_type == NULL) {
        return NULL;
    }
    PyObject *buffers = args[0], *recipes = args[2], *sealeds = args[4], *parseds = args[5];
    if (!PyList_Check(buffers) || !PyList_Check(recipes) || !PyList_Check(sealeds) || !PyList_Check(parseds)) {
        PyErr_SetString(PyExc_TypeError, "deliver_many: buffers, recipes, sealeds and parseds must be lists");
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(buffers);
    if (PyList_GET_SIZE(recipes) != count || PyList_GET_SIZE(sealeds) != count || PyList_GET_SIZE(parseds) != count) {
        PyErr_SetString(PyExc_ValueError, "deliver_many: the four lists differ in length");
        return NULL;
    }
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) { /* the lists are the caller's own: borrowed items stay */
        PyObject *pair = deliver_one(PyList_GET_ITEM(buffers, i), args[1], PyList_GET_ITEM(recipes, i), record_type,
                                     PyList_GET_ITEM(sealeds, i), PyList_GET_ITEM(parseds, i));
        if (pair == NULL) {
            Py_DECREF(out); /* its unset items are NULL: the list lets them be */
            return NULL;
        }
        PyList_SET_ITEM(out, i, pair);
    }
    return out;
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
    {"build", (PyCFunction)(void (*)(void))build, METH_FASTCALL,
     "build(buffer, base, recipe): the array a reading.Recipe describes, over buffer (a 1-D, C-contiguous uint8 "
     "ndarray) whose byte base is the value's first byte."},
    {"deliver", (PyCFunction)(void (*)(void))deliver, METH_FASTCALL,
     "deliver(buffer, base, recipe, record_type, sealed, parsed): (value, record) of a hit of a one-array value: "
     "the value as build makes it, and record_type(sealed, weakref(buffer), parsed, weakref(value), signature, "
     "recipe.aliasing, None)."},
    {"deliver_many", (PyCFunction)(void (*)(void))deliver_many, METH_FASTCALL,
     "deliver_many(buffers, base, recipes, record_type, sealeds, parseds): deliver of each hit of a batch (four "
     "lists of one length), as a list of (value, record) pairs; all or none."},
    {"dltype", dltype, METH_O, "dltype(capsule): (code, bits, lanes) of the tensor in a 'dltensor' capsule."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef arrays_module = {
    PyModuleDef_HEAD_INIT, "shmcache.format._arrays", "The arrays of a value (see arrays.c).", -1, arrays_methods,
};

PyMODINIT_FUNC PyInit__arrays(void) {
    import_array1(NULL);
    view_name = PyUnicode_InternFromString("view");
    data_ptr_name = PyUnicode_InternFromString("data_ptr");
    if (view_name == NULL || data_ptr_name == NULL) {
        return NULL;
    }
    return PyModule_Create(&arrays_module);
}
