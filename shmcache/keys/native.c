/* shmcache.keys._native: the fixed per-key work of key construction, one native call per key.
 *
 * A key's digest is H(frame(H(header)) || extra || 0xC0 u64le(len(content)) || H(content)) under
 * its algorithm's one-shot function H (key.py has the schema and pins its digests). What runs once
 * per header stays in Python (key.py's `_build_header`: validation, framing, the header's digest);
 * what runs for every key is here, in one implementation: the memo of headers (`header`), the
 * digest composition and the key object (`Header.key`), and the whole of `from_raw_bytes`, the
 * hottest constructor, its type check of the input included.
 *
 * The memo maps (algorithm, kind, modality, id(config), type(salt), salt) to a Header, which
 * holds its config (so that id stays unique while the entry lives) and is only answered for the
 * very config object it was built from. Only salts of type None, str and bytes are memoised
 * (subclasses are converted by the builder every time); the memo is emptied past MEMO_MAX entries.
 * Everything runs with the GIL held; nothing here is shared between processes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>
#include <string.h>

#define CONTENT_TAG 0xC0 /* key.py's _CONTENT_TAG: the content's length and digest follow */
#define TAIL_SIZE 9      /* the tag and the content's length as u64 little endian */
#define MEMO_MAX 4096

typedef struct {
    PyObject_HEAD
    PyObject *config;    /* held: its id is part of the memo key */
    PyObject *hash_fn;   /* the algorithm's one-shot digest: bytes-like -> bytes */
    PyObject *framed;    /* bytes: frame(H(header)) */
    PyObject *algorithm; /* the canonical spelling */
    PyObject *modality;  /* the canonical spelling */
} Header;

static PyTypeObject HeaderType;

static PyObject *memo;        /* memo key -> Header */
static PyObject *last[6];     /* the arguments of the last memoised answer (held) and, last, it */
static PyObject *build;       /* key.py's `_build_header(algorithm, kind, modality, config, salt)` */
static PyObject *parts_slot;  /* EmbeddingCacheKey's `_parts` slot descriptor */
static PyObject *Unsupported; /* shmcache.errors.UnsupportedValue */
static PyObject *RAW, *XXH3, *EMPTY_BYTES, *EMPTY_TUPLE;

/* ---- Header ------------------------------------------------------------------------------- */

static PyObject *Header_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"config", "hash_fn", "framed", "algorithm", "modality", NULL};
    PyObject *config, *hash_fn, *framed, *algorithm, *modality;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!UU:Header", names, &config, &hash_fn, &PyBytes_Type,
                                     &framed, &algorithm, &modality)) {
        return NULL;
    }
    if (!PyCallable_Check(hash_fn)) {
        PyErr_SetString(PyExc_TypeError, "hash_fn must be callable");
        return NULL;
    }
    Header *self = (Header *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->config = Py_NewRef(config);
    self->hash_fn = Py_NewRef(hash_fn);
    self->framed = Py_NewRef(framed);
    self->algorithm = Py_NewRef(algorithm);
    self->modality = Py_NewRef(modality);
    return (PyObject *)self;
}

static int Header_traverse(Header *self, visitproc visit, void *arg) {
    Py_VISIT(self->config);
    Py_VISIT(self->hash_fn);
    Py_VISIT(self->framed);
    Py_VISIT(self->algorithm);
    Py_VISIT(self->modality);
    return 0;
}

static int Header_clear(Header *self) {
    Py_CLEAR(self->config);
    Py_CLEAR(self->hash_fn);
    Py_CLEAR(self->framed);
    Py_CLEAR(self->algorithm);
    Py_CLEAR(self->modality);
    return 0;
}

static void Header_dealloc(Header *self) {
    PyObject_GC_UnTrack(self);
    Header_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The digest of one call of `hash_fn`, checked to be bytes. */
static PyObject *digest_of(PyObject *hash_fn, PyObject *data) {
    PyObject *digest = PyObject_Vectorcall(hash_fn, &data, 1, NULL);
    if (digest != NULL && !PyBytes_Check(digest)) {
        PyErr_Format(PyExc_TypeError, "a key's hash function returned %.100s, not bytes", Py_TYPE(digest)->tp_name);
        Py_CLEAR(digest);
    }
    return digest;
}

/* The key of `content` (`nbytes` long) under `header`: an instance of `cls` made the way
 * object.__new__(cls) makes one, its `_parts` set through the slot's own descriptor. */
static PyObject *compose(Header *header, PyObject *cls, PyObject *content, Py_ssize_t nbytes, PyObject *extra,
                         PyObject *kind) {
    if (header->hash_fn == NULL || header->framed == NULL) {
        PyErr_SetString(PyExc_ValueError, "this Header was cleared");
        return NULL;
    }
    if (!PyType_IsSubtype((PyTypeObject *)cls, PyDescr_TYPE(parts_slot))) {
        PyErr_Format(PyExc_TypeError, "keys are made as %.100s, not %.100s", PyDescr_TYPE(parts_slot)->tp_name,
                     ((PyTypeObject *)cls)->tp_name);
        return NULL;
    }
    PyObject *inner = digest_of(header->hash_fn, content);
    if (inner == NULL) {
        return NULL;
    }
    Py_ssize_t framed = PyBytes_GET_SIZE(header->framed), more = PyBytes_GET_SIZE(extra);
    Py_ssize_t width = PyBytes_GET_SIZE(inner);
    PyObject *joined = PyBytes_FromStringAndSize(NULL, framed + more + TAIL_SIZE + width);
    if (joined == NULL) {
        Py_DECREF(inner);
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(joined);
    memcpy(out, PyBytes_AS_STRING(header->framed), (size_t)framed);
    out += framed;
    memcpy(out, PyBytes_AS_STRING(extra), (size_t)more);
    out += more;
    *out++ = CONTENT_TAG;
    for (int i = 0; i < 8; i++) {
        *out++ = (unsigned char)((uint64_t)nbytes >> (8 * i));
    }
    memcpy(out, PyBytes_AS_STRING(inner), (size_t)width);
    Py_DECREF(inner);
    PyObject *digest = digest_of(header->hash_fn, joined);
    Py_DECREF(joined);
    if (digest == NULL) {
        return NULL;
    }
    PyObject *key = PyBaseObject_Type.tp_new((PyTypeObject *)cls, EMPTY_TUPLE, NULL);
    PyObject *parts = key == NULL ? NULL : PyTuple_Pack(4, header->algorithm, digest, header->modality, kind);
    Py_DECREF(digest);
    if (parts == NULL || Py_TYPE(parts_slot)->tp_descr_set(parts_slot, key, parts) < 0) {
        Py_XDECREF(parts);
        Py_XDECREF(key);
        return NULL;
    }
    Py_DECREF(parts);
    return key;
}

static PyObject *Header_key(Header *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyType_Check(args[0]) || !PyBytes_Check(args[3]) || !PyUnicode_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "key(cls, content, nbytes, extra: bytes, kind: str)");
        return NULL;
    }
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[2]);
    if (nbytes < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "nbytes must not be negative");
        }
        return NULL;
    }
    return compose(self, args[0], args[1], nbytes, args[3], args[4]);
}

static PyMethodDef Header_methods[] = {
    {"key", (PyCFunction)(void (*)(void))Header_key, METH_FASTCALL,
     "key(cls, content, nbytes, extra, kind): the key of `content` (`nbytes` long), `extra` framed "
     "between the header and the content."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Header_members[] = {
    {"config", T_OBJECT_EX, offsetof(Header, config), READONLY, "The preprocessing config it was built from."},
    {"framed", T_OBJECT_EX, offsetof(Header, framed), READONLY, "frame(H(header))."},
    {"algorithm", T_OBJECT_EX, offsetof(Header, algorithm), READONLY, "The hash algorithm."},
    {"modality", T_OBJECT_EX, offsetof(Header, modality), READONLY, "The modality."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject HeaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmcache.keys._native.Header",
    .tp_basicsize = sizeof(Header),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Header(config, hash_fn, framed, algorithm, modality): the memoised key header of one "
              "(algorithm, namespace, modality, config, salt); makes the keys built with it.",
    .tp_new = Header_new,
    .tp_dealloc = (destructor)Header_dealloc,
    .tp_traverse = (traverseproc)Header_traverse,
    .tp_clear = (inquiry)Header_clear,
    .tp_methods = Header_methods,
    .tp_members = Header_members,
};

/* ---- the memo ----------------------------------------------------------------------------- */

/* Whether these are the very objects of the last memoised answer: then the memo key is equal too. */
static int same_as_last(PyObject *algorithm, PyObject *kind, PyObject *modality, PyObject *config, PyObject *salt) {
    return last[5] != NULL && algorithm == last[0] && kind == last[1] && modality == last[2] && config == last[3] &&
           salt == last[4];
}

static void remember(PyObject *algorithm, PyObject *kind, PyObject *modality, PyObject *config, PyObject *salt,
                     PyObject *header) {
    PyObject *now[6] = {algorithm, kind, modality, config, salt, header}, *old[6];
    for (int i = 0; i < 6; i++) { /* all six are set before a decref can run any code */
        old[i] = last[i];
        last[i] = Py_NewRef(now[i]);
    }
    for (int i = 0; i < 6; i++) {
        Py_XDECREF(old[i]);
    }
}

/* The Header for these settings: memoised, or built by key.py (which validates them). The last
 * memoised answer is kept with its arguments: the same objects again (the common case: one config,
 * literal strings) skip the memo key and its lookup. */
static PyObject *header_of(PyObject *algorithm, PyObject *kind, PyObject *modality, PyObject *config,
                           PyObject *salt) {
    if (same_as_last(algorithm, kind, modality, config, salt)) {
        return Py_NewRef(last[5]);
    }
    if (build == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "shmcache.keys._native is not bound (key.py binds it at import)");
        return NULL;
    }
    PyObject *id = PyLong_FromVoidPtr(config);
    PyObject *salt_type = (PyObject *)Py_TYPE(salt); /* "s" and b"s" are told apart */
    PyObject *memo_key = id == NULL ? NULL : PyTuple_Pack(6, algorithm, kind, modality, id, salt_type, salt);
    Py_XDECREF(id);
    if (memo_key == NULL) {
        return NULL;
    }
    PyObject *found = PyDict_GetItemWithError(memo, memo_key); /* borrowed */
    if (found == NULL && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) { /* an unhashable argument: the builder refuses it */
            Py_DECREF(memo_key);
            return NULL;
        }
        PyErr_Clear();
    }
    if (found != NULL && ((Header *)found)->config == config) {
        Py_INCREF(found); /* ours before `remember` may run code (a decref) that changes the memo */
        Py_DECREF(memo_key);
        remember(algorithm, kind, modality, config, salt, found);
        return found;
    }
    PyObject *made = PyObject_CallFunctionObjArgs(build, algorithm, kind, modality, config, salt, NULL);
    if (made != NULL && !PyObject_TypeCheck(made, &HeaderType)) {
        PyErr_SetString(PyExc_TypeError, "the key header builder must return a Header");
        Py_CLEAR(made);
    }
    if (made != NULL && (salt == Py_None || PyUnicode_CheckExact(salt) || PyBytes_CheckExact(salt))) {
        if (PyDict_GET_SIZE(memo) >= MEMO_MAX) {
            PyDict_Clear(memo);
        }
        if (PyDict_SetItem(memo, memo_key, made) < 0) {
            Py_CLEAR(made);
        } else {
            remember(algorithm, kind, modality, config, salt, made);
        }
    }
    Py_DECREF(memo_key);
    return made;
}

static PyObject *native_header(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "header(algorithm, kind, modality, config, tenant_salt)");
        return NULL;
    }
    return header_of(args[0], args[1], args[2], args[3], args[4]);
}

/* ---- from_raw_bytes ----------------------------------------------------------------------- */

enum { A_DATA, A_CONFIG, A_MODALITY, A_ALGORITHM, A_SALT, A_COUNT };
static const char *const RAW_NAMES[A_COUNT] = {"data", "config", "modality", "algorithm", "tenant_salt"};
static PyObject *raw_names[A_COUNT]; /* the same, interned: keyword names compare by identity first */
#define RAW_POSITIONAL 2 /* data and config may be given by position; the rest only by keyword */

/* The index of keyword `name` among RAW_NAMES, A_COUNT if none: interned names (the compiler's)
 * compare by identity, others by value. */
static int raw_index(PyObject *name) {
    for (int at = 0; at < A_COUNT; at++) {
        if (name == raw_names[at]) {
            return at;
        }
    }
    for (int at = 0; at < A_COUNT; at++) {
        if (PyUnicode_Compare(name, raw_names[at]) == 0) {
            return at;
        }
    }
    return A_COUNT;
}

/* Python's own argument errors for from_raw_bytes(cls, /, data, config, *, modality, ...). */
static int raw_arguments(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **given) {
    if (nargs > RAW_POSITIONAL) {
        PyErr_Format(PyExc_TypeError, "from_raw_bytes() takes %d positional arguments but %zd were given",
                     RAW_POSITIONAL + 1, nargs + 1);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        given[i] = args[i];
    }
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int at = raw_index(name);
        if (at == A_COUNT) {
            PyErr_Format(PyExc_TypeError, "from_raw_bytes() got an unexpected keyword argument '%U'", name);
            return -1;
        }
        if (given[at] != NULL) {
            PyErr_Format(PyExc_TypeError, "from_raw_bytes() got multiple values for argument '%s'", RAW_NAMES[at]);
            return -1;
        }
        given[at] = args[nargs + k];
    }
    for (int at = A_DATA; at <= A_MODALITY; at++) {
        if (given[at] == NULL) {
            PyErr_Format(PyExc_TypeError, "from_raw_bytes() missing 1 required %sargument: '%s'",
                         at == A_MODALITY ? "keyword-only " : "positional ", RAW_NAMES[at]);
            return -1;
        }
    }
    return 0;
}

/* len(data) of bytes, a bytearray or a C-contiguous memoryview; -1 with UnsupportedValue else. */
static Py_ssize_t raw_length(PyObject *data) {
    if (PyBytes_Check(data)) {
        return PyBytes_GET_SIZE(data);
    }
    if (PyByteArray_Check(data)) {
        return PyByteArray_GET_SIZE(data);
    }
    if (!PyMemoryView_Check(data)) {
        PyErr_Format(Unsupported, "from_raw_bytes takes bytes, bytearray or memoryview, got %.100s",
                     Py_TYPE(data)->tp_name);
        return -1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_FULL_RO) < 0) { /* a released view: ValueError */
        return -1;
    }
    Py_ssize_t nbytes = PyBuffer_IsContiguous(&view, 'C') ? view.len : -1;
    PyBuffer_Release(&view);
    if (nbytes < 0) {
        PyErr_SetString(Unsupported, "from_raw_bytes needs a C-contiguous buffer");
    }
    return nbytes;
}

static PyObject *native_from_raw_bytes(PyObject *Py_UNUSED(module), PyObject *const *args, size_t nargsf,
                                       PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1 || !PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "from_raw_bytes is a classmethod of EmbeddingCacheKey");
        return NULL;
    }
    PyObject *given[A_COUNT] = {NULL};
    if (raw_arguments(args + 1, nargs - 1, kwnames, given) < 0) {
        return NULL;
    }
    Py_ssize_t nbytes = raw_length(given[A_DATA]);
    if (nbytes < 0) {
        return NULL;
    }
    PyObject *algorithm = given[A_ALGORITHM] != NULL ? given[A_ALGORITHM] : XXH3;
    PyObject *salt = given[A_SALT] != NULL ? given[A_SALT] : Py_None;
    Header *header = (Header *)header_of(algorithm, RAW, given[A_MODALITY], given[A_CONFIG], salt);
    if (header == NULL) {
        return NULL;
    }
    PyObject *key = compose(header, args[0], given[A_DATA], nbytes, EMPTY_BYTES, RAW);
    Py_DECREF(header);
    return key;
}

/* ---- binding ------------------------------------------------------------------------------ */

static PyObject *native_bind(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyCallable_Check(args[0]) || !PyObject_TypeCheck(args[1], &PyMemberDescr_Type) ||
        !PyExceptionClass_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "bind(build_header, parts_slot: a slot's member descriptor, UnsupportedValue)");
        return NULL;
    }
    Py_XSETREF(build, Py_NewRef(args[0]));
    Py_XSETREF(parts_slot, Py_NewRef(args[1]));
    Py_XSETREF(Unsupported, Py_NewRef(args[2]));
    PyDict_Clear(memo);
    for (int i = 0; i < 6; i++) {
        Py_CLEAR(last[i]);
    }
    Py_RETURN_NONE;
}

static PyMethodDef native_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))native_bind, METH_FASTCALL,
     "bind(build_header, parts_slot, unsupported): key.py's header builder, EmbeddingCacheKey's "
     "`_parts` slot descriptor and the UnsupportedValue error (key.py calls it at import)."},
    {"header", (PyCFunction)(void (*)(void))native_header, METH_FASTCALL,
     "header(algorithm, kind, modality, config, tenant_salt): the memoised Header for these "
     "settings (a miss builds and validates it)."},
    {"from_raw_bytes", (PyCFunction)(void (*)(void))native_from_raw_bytes, METH_FASTCALL | METH_KEYWORDS,
     "from_raw_bytes($module, cls, /, data, config, *, modality, algorithm='xxh3_128', tenant_salt=None)\n--\n\n"
     "Key of an input's raw bytes (the encoded image / audio file as received): bytes, bytearray "
     "or a C-contiguous memoryview."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "shmcache.keys._native", "Key construction's per-key work (see native.c).", -1,
    native_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&HeaderType) < 0) {
        return NULL;
    }
    memo = PyDict_New();
    RAW = PyUnicode_InternFromString("raw");
    XXH3 = PyUnicode_InternFromString("xxh3_128");
    EMPTY_BYTES = PyBytes_FromStringAndSize(NULL, 0);
    EMPTY_TUPLE = PyTuple_New(0);
    if (memo == NULL || RAW == NULL || XXH3 == NULL || EMPTY_BYTES == NULL || EMPTY_TUPLE == NULL) {
        return NULL;
    }
    for (int at = 0; at < A_COUNT; at++) {
        if ((raw_names[at] = PyUnicode_InternFromString(RAW_NAMES[at])) == NULL) {
            return NULL;
        }
    }
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Header", (PyObject *)&HeaderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
