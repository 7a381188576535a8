/* shmcache.kernel._mapping: copy-on-write views of a shared file (cowmap.py says why each view
 * has its own private mapping): an object that exports the mapped bytes as a writable buffer and
 * unmaps them when it dies, so a view is one mmap system call and one array over that object.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static PyObject *CapacityError;

/* A private (copy-on-write) mapping of a file's pages, exported as a writable buffer and unmapped
 * when the object dies (cowmap.py explains why each view has its own). */
typedef struct {
    PyObject_HEAD
    void *address;
    size_t length;
    Py_ssize_t start; /* where the requested bytes begin inside the mapping */
    Py_ssize_t size;
    PyObject *on_death, *death_arg; /* on_death(death_arg) once unmapped (NULL: nothing to call) */
} Mapping;

static int Mapping_getbuffer(Mapping *m, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)m, (char *)m->address + m->start, m->size, 0, flags);
}

static void Mapping_dealloc(Mapping *m) {
    if (m->address != NULL) {
        munmap(m->address, m->length);
    }
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
     "on_death(callback, arg): call callback(arg) once, right after the mapping is unmapped."},
    {NULL, NULL, 0, NULL},
};

static PyBufferProcs Mapping_as_buffer = {(getbufferproc)Mapping_getbuffer, NULL};

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmcache.kernel._mapping.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A copy-on-write mapping of some bytes of a file, unmapped when it dies.",
    .tp_dealloc = (destructor)Mapping_dealloc,
    .tp_as_buffer = &Mapping_as_buffer,
    .tp_methods = Mapping_methods,
};

static PyObject *map_private(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "map_private(fd, offset, size)");
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    if (offset == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t size = PyLong_AsSsize_t(args[2]);
    if (size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (fd < 0 || fd > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return NULL;
    }
    if (offset < 0 || size < 0) {
        PyErr_SetString(PyExc_ValueError, "offset and size must not be negative");
        return NULL;
    }
    long page = sysconf(_SC_PAGESIZE);
    Py_ssize_t start = offset - offset % page;
    size_t length = (size_t)(((offset + size - start) + page - 1) / page * page);
    if (length == 0) {
        length = (size_t)page;
    }
    void *address = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, (int)fd, start);
    if (address == MAP_FAILED) {
        if (errno == ENOMEM) { /* the process's mapping count (vm.max_map_count) or address space */
            PyErr_Format(CapacityError, "cannot map %zu bytes for a view: %s", length, strerror(errno));
        } else {
            PyErr_SetFromErrno(PyExc_OSError);
        }
        return NULL;
    }
    Mapping *m = PyObject_New(Mapping, &MappingType);
    if (m == NULL) {
        munmap(address, length);
        return NULL;
    }
    m->address = address;
    m->length = length;
    m->start = offset - start;
    m->size = size;
    m->on_death = m->death_arg = NULL;
    return (PyObject *)m;
}

static PyMethodDef mapping_methods[] = {
    {"map_private", (PyCFunction)(void (*)(void))map_private, METH_FASTCALL,
     "map_private(fd, offset, size): a Mapping of those bytes of the file (copy-on-write)."},
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
