/* shmcache.kernel._mapping: copy-on-write views of a shared file (cowmap.py says why views have
 * private mappings): an object that exports the mapped bytes as a writable buffer and unmaps them
 * when it dies, so a view is one mmap system call and one array over that object. A batch of views
 * (`map_private_many`) shares one mapping per run of nearby extents: each view is then a window
 * object holding that mapping, which is unmapped when the last of its windows dies.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static PyObject *CapacityError;

/* A batch's extents share a mapping while the next one starts at most this far past the run's
 * end (the bytes between are mapped too, never exported: address space, not memory). */
#define RUN_GAP_BYTES ((Py_ssize_t)1 << 20)

/* Bytes of a private (copy-on-write) mapping of a file's pages, exported as a writable buffer.
 * Either the owner of the mapping (`address`, `length`: unmapped when it dies) or a window into
 * one (`region`: the owner, kept alive by the window). */
typedef struct {
    PyObject_HEAD
    void *address; /* the mapping this object owns, NULL for a window */
    size_t length;
    PyObject *region; /* a window's owner, NULL for an owner */
    char *data; /* where the exported bytes begin */
    Py_ssize_t size;
    PyObject *on_death, *death_arg; /* on_death(death_arg) once its bytes are unreachable (NULL: none) */
} Mapping;

static int Mapping_getbuffer(Mapping *m, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)m, m->data, m->size, 0, flags);
}

static void Mapping_dealloc(Mapping *m) {
    if (m->address != NULL) {
        munmap(m->address, m->length);
    }
    Py_CLEAR(m->region); /* a window: the owner unmaps when its last window is gone */
    if (m->on_death != NULL) { /* a deallocator may run with an exception set: keep it */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *result = PyObject_CallOneArg(m->on_death, m->death_arg);
        if (result == NULL) {
            PyErr_WriteUnraisable(m->on_death);
        }
        Py_XDECREF(result);
        PyErr_Restore(type, value, tb);
        Py_CLEAR(m->on_death);
        Py_CLEAR(m->death_arg);
    }
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyObject *Mapping_set_on_death(Mapping *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyCallable_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "on_death(callback, arg): callback must be callable");
        return NULL;
    }
    if (m->on_death != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "on_death was already set");
        return NULL;
    }
    m->on_death = Py_NewRef(args[0]);
    m->death_arg = Py_NewRef(args[1]);
    Py_RETURN_NONE;
}

static PyMethodDef Mapping_methods[] = {
    {"on_death", (PyCFunction)(void (*)(void))Mapping_set_on_death, METH_FASTCALL,
     "on_death(callback, arg): call callback(arg) once, right after these bytes became unreachable."},
    {NULL, NULL, 0, NULL},
};

static PyBufferProcs Mapping_as_buffer = {(getbufferproc)Mapping_getbuffer, NULL};

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmcache.kernel._mapping.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Some bytes of a copy-on-write mapping of a file, unmapped when its last user dies.",
    .tp_dealloc = (destructor)Mapping_dealloc,
    .tp_as_buffer = &Mapping_as_buffer,
    .tp_methods = Mapping_methods,
};

/* A new Mapping over [data, data + size): the owner of `address`/`length`, or a window of `region`. */
static Mapping *new_mapping(void *address, size_t length, PyObject *region, char *data, Py_ssize_t size) {
    Mapping *m = PyObject_New(Mapping, &MappingType);
    if (m == NULL) {
        return NULL;
    }
    m->address = address;
    m->length = length;
    m->region = Py_XNewRef(region);
    m->data = data;
    m->size = size;
    m->on_death = m->death_arg = NULL;
    return m;
}

/* An owner Mapping of the pages holding [start, end) of file `fd`; *first is the file offset of
 * its first byte. */
static Mapping *map_pages(int fd, Py_ssize_t start, Py_ssize_t end, Py_ssize_t *first) {
    long page = sysconf(_SC_PAGESIZE);
    Py_ssize_t from = start - start % page;
    size_t length = (size_t)((end - from + page - 1) / page * page);
    if (length == 0) {
        length = (size_t)page;
    }
    void *address = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, fd, from);
    if (address == MAP_FAILED) {
        if (errno == ENOMEM) { /* the process's mapping count (vm.max_map_count) or address space */
            PyErr_Format(CapacityError, "cannot map %zu bytes for a view: %s", length, strerror(errno));
        } else {
            PyErr_SetFromErrno(PyExc_OSError);
        }
        return NULL;
    }
    Mapping *m = new_mapping(address, length, NULL, (char *)address + (start - from), end - start);
    if (m == NULL) {
        munmap(address, length);
    }
    *first = from;
    return m;
}

static int as_fd(PyObject *arg, int *fd) {
    long value = PyLong_AsLong(arg);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (value < 0 || value > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return -1;
    }
    *fd = (int)value;
    return 0;
}

static int as_extent(PyObject *offset_arg, PyObject *size_arg, Py_ssize_t *offset, Py_ssize_t *size) {
    *offset = PyLong_AsSsize_t(offset_arg);
    if (*offset == -1 && PyErr_Occurred()) {
        return -1;
    }
    *size = PyLong_AsSsize_t(size_arg);
    if (*size == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*offset < 0 || *size < 0 || *offset > PY_SSIZE_T_MAX - *size) {
        PyErr_SetString(PyExc_ValueError, "offset and size must not be negative");
        return -1;
    }
    return 0;
}

static PyObject *map_private(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "map_private(fd, offset, size)");
        return NULL;
    }
    int fd;
    Py_ssize_t offset, size, first;
    if (as_fd(args[0], &fd) < 0 || as_extent(args[1], args[2], &offset, &size) < 0) {
        return NULL;
    }
    return (PyObject *)map_pages(fd, offset, offset + size, &first);
}

typedef struct {
    Py_ssize_t offset, size, index;
} extent_t;

static int by_offset(const void *a, const void *b) {
    Py_ssize_t x = ((const extent_t *)a)->offset, y = ((const extent_t *)b)->offset;
    return (x > y) - (x < y);
}

/* Windows for extents[0:n] (sorted by offset) into `out`, one mapping per run of nearby extents.
 * An extent that overlaps the run (the same entry asked for twice) starts a new run: two windows
 * of one mapping over the same bytes would see each other's writes. */
static int map_runs(int fd, extent_t *extents, Py_ssize_t n, PyObject *out) {
    Py_ssize_t i = 0;
    while (i < n) {
        Py_ssize_t j = i + 1, end = extents[i].offset + extents[i].size;
        while (j < n && extents[j].offset >= end && extents[j].offset - end <= RUN_GAP_BYTES) {
            Py_ssize_t e = extents[j].offset + extents[j].size;
            end = e > end ? e : end;
            j++;
        }
        Py_ssize_t first;
        Mapping *owner = map_pages(fd, extents[i].offset, end, &first);
        if (owner == NULL) {
            return -1;
        }
        for (; i < j; i++) {
            char *data = (char *)owner->address + (extents[i].offset - first);
            Mapping *window = new_mapping(NULL, 0, (PyObject *)owner, data, extents[i].size);
            if (window == NULL) {
                Py_DECREF(owner);
                return -1;
            }
            PyList_SET_ITEM(out, extents[i].index, (PyObject *)window);
        }
        Py_DECREF(owner); /* its windows hold it */
    }
    return 0;
}

static PyObject *map_private_many(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[1]) || !PyList_Check(args[2]) ||
        PyList_GET_SIZE(args[1]) != PyList_GET_SIZE(args[2])) {
        PyErr_SetString(PyExc_TypeError, "map_private_many(fd, offsets, sizes): two lists of one length");
        return NULL;
    }
    int fd;
    if (as_fd(args[0], &fd) < 0) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[1]);
    extent_t *extents = PyMem_Malloc(sizeof(extent_t) * (size_t)(n ? n : 1));
    if (extents == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        extents[i].index = i;
        if (as_extent(PyList_GET_ITEM(args[1], i), PyList_GET_ITEM(args[2], i), &extents[i].offset,
                      &extents[i].size) < 0) {
            PyMem_Free(extents);
            return NULL;
        }
    }
    qsort(extents, (size_t)n, sizeof(extent_t), by_offset);
    PyObject *out = PyList_New(n); /* items NULL until set: a list dealloc skips them */
    if (out != NULL && map_runs(fd, extents, n, out) < 0) {
        Py_CLEAR(out);
    }
    PyMem_Free(extents);
    return out;
}

static PyMethodDef mapping_methods[] = {
    {"map_private", (PyCFunction)(void (*)(void))map_private, METH_FASTCALL,
     "map_private(fd, offset, size): a Mapping of those bytes of the file (copy-on-write)."},
    {"map_private_many", (PyCFunction)(void (*)(void))map_private_many, METH_FASTCALL,
     "map_private_many(fd, offsets, sizes): a Mapping per extent, in order; nearby extents share one "
     "copy-on-write mapping, unmapped when the last of them dies."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mapping_module = {
    PyModuleDef_HEAD_INIT, "shmcache.kernel._mapping", "Copy-on-write mappings (see mapping.c).", -1,
    mapping_methods,
};

PyMODINIT_FUNC PyInit__mapping(void) {
    if (PyType_Ready(&MappingType) < 0) {
        return NULL;
    }
    PyObject *errors = PyImport_ImportModule("shmcache.errors");
    if (errors == NULL) {
        return NULL;
    }
    CapacityError = PyObject_GetAttrString(errors, "CapacityError");
    Py_DECREF(errors);
    if (CapacityError == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&mapping_module);
    if (m != NULL && PyModule_AddObjectRef(m, "Mapping", (PyObject *)&MappingType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
