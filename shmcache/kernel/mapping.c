/* shmcache.kernel._mapping: copy-on-write views of a shared file (cowmap.py says why views have
 * private mappings). A Pool (one per arena file) makes them: a view is an object that exports the
 * mapped bytes as a writable buffer. When it dies its mapping is not unmapped but reset and kept
 * idle for the next view of the same pages: MADV_DONTNEED drops a private file mapping's written
 * (copied) pages and page-table entries, so the pages read the file again, exactly as a fresh
 * mapping would; one madvise at death instead of an munmap there and an mmap at the next view.
 * A mapping of 64 KiB to 32 MiB that no view wrote keeps its page-table entries instead (they map
 * the file's own pages, so they read whatever the file holds, as after a reset): the next view
 * of the same pages reads them without faults. A pool keeps at most IDLE_MAX of them and
 * IDLE_BYTES in all (the oldest go first, and all of them before an mmap gives up for lack of
 * room).
 * A batch of views (`map_many`) shares one mapping per run of nearby extents: each view is then a
 * window object holding that mapping, which is unmapped when the last of its windows dies.
 * A view is handed out as a numpy uint8 array made here over its Mapping (the array's base), so a
 * get makes no array in Python; an array derived from it keeps it, and so the Mapping, alive.
 * A view can be armed as it is made: its Mapping then calls on_death(arg) right after its bytes
 * became unreachable (a reader's view pin goes back then), counted in `watched` in the same
 * step, so no signal can land between making a view and watching it.
 * `copy_into` is how a writer fills shared memory (see there).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static PyObject *CapacityError;

/* A batch's extents share a mapping while the next one starts at most this far past the run's
 * end (the bytes between are mapped too, never exported: address space, not memory). */
#define RUN_GAP_BYTES ((Py_ssize_t)1 << 20)

/* Idle mappings a pool keeps (their pages were dropped), and at most this many bytes of them:
 * an idle mapping still counts towards vm.max_map_count and, under strict overcommit (where
 * MAP_NORESERVE is ignored), towards the commit charge. */
#define IDLE_MAX 64
#define IDLE_BYTES ((size_t)256 << 20)

typedef struct {
    void *address;
    size_t length;
    Py_ssize_t from; /* the file offset of its first byte */
} idle_t;

/* The mappings of one file: makes views, keeps up to IDLE_MAX reset mappings for reuse. */
typedef struct {
    PyObject_HEAD
    int fd; /* not owned (cowmap.CowMapper owns it); -1 once closed */
    int initialised; /* Pool(fd) ran: once */
    idle_t idle[IDLE_MAX]; /* oldest first */
    int n_idle;
    size_t idle_bytes;
    unsigned long long watched; /* views armed, ever, less those disarmed: counted as they are */
} Pool;

/* Bytes of a private (copy-on-write) mapping of a file's pages, exported as a writable buffer.
 * Either the owner of the mapping (`address`, `length`: given back to `pool` or unmapped when it
 * dies) or a window into one (`region`: the owner, kept alive by the window). */
typedef struct {
    PyObject_HEAD
    void *address; /* the mapping this object owns, NULL for a window */
    size_t length;
    Py_ssize_t from; /* an owner's file offset */
    Pool *pool; /* an owner that goes back to its pool when it dies, NULL: unmapped */
    PyObject *region; /* a window's owner, NULL for an owner */
    char *data; /* where the exported bytes begin */
    Py_ssize_t size;
    PyObject *on_death, *death_arg; /* on_death(death_arg) once its bytes are unreachable (NULL: none) */
} Mapping;

static int Mapping_getbuffer(Mapping *m, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)m, m->data, m->size, 0, flags);
}

/* Unmap the pool's oldest idle mapping (there is one). */
static void drop_oldest(Pool *pool) {
    munmap(pool->idle[0].address, pool->idle[0].length);
    pool->idle_bytes -= pool->idle[0].length;
    memmove(pool->idle, pool->idle + 1, sizeof(idle_t) * (size_t)(pool->n_idle - 1));
    pool->n_idle--;
}

/* A mapping of KEEP_MAPPED_MIN to KEEP_MAPPED_MAX bytes is reset only if a page of it was written
 * (see written()): an unwritten one keeps its page-table entries, so the next view of the same
 * pages reads without faults (~0.2 us per 4 KiB page here). Others are always reset: below, one
 * madvise is cheaper; above, reading the page map (8 bytes a page) costs more than it saves when
 * the view was not read (64 MiB: +1-3 us on the next hit, measured). */
#define KEEP_MAPPED_MIN ((size_t)64 << 10)
#define KEEP_MAPPED_MAX ((size_t)32 << 20)

/* Whether a page of the private file mapping [address, address + length) was written, i.e. has
 * an anonymous copy: /proc/self/pagemap's entry of a present page has bit 61 ("file page or
 * shared anonymous") set for the file's own page and clear for a copy; a copy swapped out has
 * bit 62 (the file's pages are never swap entries of this mapping). 1 (reset it) when unsure. */
static int written(void *address, size_t length) {
    static int fd = -1;
    static pid_t owner = 0; /* the process `fd` describes: a forked child opens its own */
    if (fd < 0 || owner != getpid()) {
        if (fd >= 0) {
            close(fd);
        }
        fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
        owner = getpid();
        if (fd < 0) {
            return 1;
        }
    }
    long page = sysconf(_SC_PAGESIZE);
    uint64_t entries[512];
    size_t pages = length / (size_t)page, first = (uintptr_t)address / (size_t)page;
    for (size_t done = 0; done < pages;) {
        size_t n = pages - done < 512 ? pages - done : 512;
        ssize_t got = pread(fd, entries, n * sizeof(uint64_t), (off_t)((first + done) * sizeof(uint64_t)));
        if (got != (ssize_t)(n * sizeof(uint64_t))) {
            return 1;
        }
        for (size_t i = 0; i < n; i++) {
            if (((entries[i] >> 63 & 1) && !(entries[i] >> 61 & 1)) || (entries[i] >> 62 & 1)) {
                return 1;
            }
        }
        done += n;
    }
    return 0;
}

/* Keep an owner's mapping idle in its pool (reset: its written pages dropped), making room by
 * unmapping the oldest; 0 if it was kept, -1 if the caller must unmap it. */
static int keep_idle(Pool *pool, void *address, size_t length, Py_ssize_t from) {
    if (pool->fd < 0 || length > IDLE_BYTES) {
        return -1;
    }
    int keep_mapped = length >= KEEP_MAPPED_MIN && length <= KEEP_MAPPED_MAX && !written(address, length);
    if (!keep_mapped && madvise(address, length, MADV_DONTNEED) != 0) {
        return -1;
    }
    while (pool->n_idle > 0 && (pool->n_idle == IDLE_MAX || pool->idle_bytes + length > IDLE_BYTES)) {
        drop_oldest(pool);
    }
    pool->idle[pool->n_idle++] = (idle_t){address, length, from};
    pool->idle_bytes += length;
    return 0;
}

/* Unmap every idle mapping; views alive now are unmapped when they die. */
static void drain(Pool *pool) {
    while (pool->n_idle > 0) {
        drop_oldest(pool);
    }
}

static void Mapping_dealloc(Mapping *m) {
    if (m->address != NULL && (m->pool == NULL || keep_idle(m->pool, m->address, m->length, m->from) < 0)) {
        munmap(m->address, m->length);
    }
    Py_CLEAR(m->pool);
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

static PyBufferProcs Mapping_as_buffer = {(getbufferproc)Mapping_getbuffer, NULL};

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmcache.kernel._mapping.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Some bytes of a copy-on-write mapping of a file, unmapped when its last user dies.",
    .tp_dealloc = (destructor)Mapping_dealloc,
    .tp_as_buffer = &Mapping_as_buffer,
};

/* A new Mapping over [data, data + size): the owner of `address`/`length`, or a window of `region`. */
static Mapping *new_mapping(void *address, size_t length, PyObject *region, char *data, Py_ssize_t size) {
    Mapping *m = PyObject_New(Mapping, &MappingType);
    if (m == NULL) {
        return NULL;
    }
    m->address = address;
    m->length = length;
    m->from = 0;
    m->pool = NULL;
    m->region = Py_XNewRef(region);
    m->data = data;
    m->size = size;
    m->on_death = m->death_arg = NULL;
    return m;
}

/* An owner Mapping of the pages holding [start, end) of the pool's file, an idle one of exactly
 * those pages if the pool has it; given back to the pool when it dies if `keep`. */
static Mapping *map_pages(Pool *pool, Py_ssize_t start, Py_ssize_t end, int keep) {
    long page = sysconf(_SC_PAGESIZE);
    Py_ssize_t from = start - start % page;
    size_t length = (size_t)((end - from + page - 1) / page * page);
    if (length == 0) {
        length = (size_t)page;
    }
    void *address = MAP_FAILED;
    for (int i = pool->n_idle - 1; keep && i >= 0; i--) { /* the newest first */
        if (pool->idle[i].from == from && pool->idle[i].length == length) {
            address = pool->idle[i].address;
            pool->idle_bytes -= length;
            memmove(pool->idle + i, pool->idle + i + 1, sizeof(idle_t) * (size_t)(pool->n_idle - i - 1));
            pool->n_idle--;
            break;
        }
    }
    if (address == MAP_FAILED) {
        address = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, pool->fd, from);
    }
    if (address == MAP_FAILED && errno == ENOMEM && pool->n_idle > 0) { /* the idle ones go first */
        drain(pool);
        address = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, pool->fd, from);
    }
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
        return NULL;
    }
    m->from = from;
    if (keep) {
        m->pool = (Pool *)Py_NewRef(pool);
    }
    return m;
}

/* A writable, 1-D uint8 numpy array over `m`'s bytes, `m` its base (the reference is stolen: on
 * failure `m` is released, which gives its mapping back). */
static PyObject *as_array(Mapping *m) {
    if (m == NULL) {
        return NULL;
    }
    npy_intp length = m->size;
    PyObject *array = PyArray_New(&PyArray_Type, 1, &length, NPY_UINT8, NULL, m->data, 0,
                                  NPY_ARRAY_CARRAY, NULL);
    if (array == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyArray_SetBaseObject((PyArrayObject *)array, (PyObject *)m) < 0) { /* it took `m`: released */
        Py_DECREF(array);
        return NULL;
    }
    return array;
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

static int check_open(Pool *pool) {
    if (!pool->initialised || pool->fd < 0) {
        PyErr_SetString(PyExc_ValueError, "the pool is closed");
        return -1;
    }
    return 0;
}

/* Have the fresh view `view` (its base a Mapping with no death set) call on_death(arg) once, right
 * after its bytes became unreachable, counted in `watched` in the same step: the view is made and
 * armed in one native call, so no signal lands between the two. */
static void arm(Pool *pool, PyObject *view, PyObject *on_death, PyObject *arg) {
    Mapping *m = (Mapping *)PyArray_BASE((PyArrayObject *)view);
    m->on_death = Py_NewRef(on_death);
    m->death_arg = Py_NewRef(arg);
    pool->watched++;
}

/* The death a map call asks for: none with 2 arguments, (on_death, arg) with 4; -1 with TypeError
 * for anything else. */
static int death_of(PyObject *const *args, Py_ssize_t nargs, const char *usage) {
    if (nargs == 2) {
        return 0;
    }
    if (nargs == 4 && PyCallable_Check(args[2])) {
        return 1;
    }
    PyErr_SetString(PyExc_TypeError, usage);
    return -1;
}

static PyObject *Pool_map(Pool *pool, PyObject *const *args, Py_ssize_t nargs) {
    int death = death_of(args, nargs, "map(offset, size[, on_death, arg])");
    Py_ssize_t offset, size;
    if (death < 0 || check_open(pool) < 0 || as_extent(args[0], args[1], &offset, &size) < 0) {
        return NULL;
    }
    PyObject *view = as_array(map_pages(pool, offset, offset + size, 1));
    if (view != NULL && death) {
        arm(pool, view, args[2], args[3]);
    }
    return view;
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
static int map_runs(Pool *pool, extent_t *extents, Py_ssize_t n, PyObject *out) {
    Py_ssize_t i = 0;
    while (i < n) {
        Py_ssize_t j = i + 1, end = extents[i].offset + extents[i].size;
        while (j < n && extents[j].offset >= end && extents[j].offset - end <= RUN_GAP_BYTES) {
            Py_ssize_t e = extents[j].offset + extents[j].size;
            end = e > end ? e : end;
            j++;
        }
        Mapping *owner = map_pages(pool, extents[i].offset, end, 0);
        if (owner == NULL) {
            return -1;
        }
        for (; i < j; i++) {
            char *data = (char *)owner->address + (extents[i].offset - owner->from);
            PyObject *view = as_array(new_mapping(NULL, 0, (PyObject *)owner, data, extents[i].size));
            if (view == NULL) {
                Py_DECREF(owner);
                return -1;
            }
            PyList_SET_ITEM(out, extents[i].index, view);
        }
        Py_DECREF(owner); /* its windows hold it */
    }
    return 0;
}

static PyObject *Pool_map_many(Pool *pool, PyObject *const *args, Py_ssize_t nargs) {
    static const char usage[] = "map_many(offsets, sizes[, on_death, args]): lists of one length";
    int death = death_of(args, nargs, usage);
    if (death < 0) {
        return NULL;
    }
    if (!PyList_Check(args[0]) || !PyList_Check(args[1]) || PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1]) ||
        (death && (!PyList_Check(args[3]) || PyList_GET_SIZE(args[3]) != PyList_GET_SIZE(args[0])))) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    if (check_open(pool) < 0) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    extent_t *extents = PyMem_Malloc(sizeof(extent_t) * (size_t)(n ? n : 1));
    if (extents == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        extents[i].index = i;
        if (as_extent(PyList_GET_ITEM(args[0], i), PyList_GET_ITEM(args[1], i), &extents[i].offset,
                      &extents[i].size) < 0) {
            PyMem_Free(extents);
            return NULL;
        }
    }
    qsort(extents, (size_t)n, sizeof(extent_t), by_offset);
    PyObject *out = PyList_New(n); /* items NULL until set: a list dealloc skips them */
    if (out != NULL && map_runs(pool, extents, n, out) < 0) {
        Py_CLEAR(out); /* nothing armed yet: the views made so far die silently */
    }
    PyMem_Free(extents);
    for (Py_ssize_t i = 0; out != NULL && death && i < n; i++) { /* all made: arm them all */
        arm(pool, PyList_GET_ITEM(out, i), args[2], PyList_GET_ITEM(args[3], i));
    }
    return out;
}

static PyObject *Pool_close(Pool *pool, PyObject *Py_UNUSED(ignored)) {
    drain(pool);
    pool->fd = -1;
    Py_RETURN_NONE;
}

static PyObject *Pool_idle(Pool *pool, PyObject *Py_UNUSED(ignored)) { return PyLong_FromLong(pool->n_idle); }

static int Pool_init(Pool *pool, PyObject *args, PyObject *kwds) {
    PyObject *fd_arg;
    static char *names[] = {"fd", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", names, &fd_arg)) {
        return -1;
    }
    if (pool->initialised) {
        PyErr_SetString(PyExc_RuntimeError, "a Pool is initialised once");
        return -1;
    }
    if (as_fd(fd_arg, &pool->fd) < 0) {
        return -1;
    }
    pool->initialised = 1;
    return 0;
}

static void Pool_dealloc(Pool *pool) {
    drain(pool);
    Py_TYPE(pool)->tp_free((PyObject *)pool);
}

/* ------------------------------------------------------------- death of the views' bytes */

/* The Mapping under the numpy array `view` made by map or map_many (a new reference), or NULL
 * with TypeError. */
static Mapping *mapping_of(PyObject *view) {
    PyObject *base = PyArray_Check(view) ? PyArray_BASE((PyArrayObject *)view) : NULL;
    if (base == NULL || !PyObject_TypeCheck(base, &MappingType)) {
        PyErr_SetString(PyExc_TypeError, "not a view made by CowMapper.view or view_many");
        return NULL;
    }
    return (Mapping *)Py_NewRef(base);
}

/* pool.disarm(view): the view's death calls nothing after all (it was armed by map or map_many),
 * and `watched` no longer counts it; False if it was not armed. For a caller that gives the
 * view's pin back itself (a view it will not hand out). */
static PyObject *Pool_disarm(Pool *pool, PyObject *view) {
    Mapping *m = mapping_of(view);
    if (m == NULL) {
        return NULL;
    }
    int armed = m->on_death != NULL;
    if (armed) {
        Py_CLEAR(m->on_death);
        Py_CLEAR(m->death_arg);
        pool->watched--;
    }
    Py_DECREF(m);
    return PyBool_FromLong(armed);
}

static PyObject *Pool_watched(Pool *pool, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromUnsignedLongLong(pool->watched);
}

/* is_watched(view): whether the death of the view's mapping is watched (armed by map or map_many). */
static PyObject *is_watched(PyObject *Py_UNUSED(module), PyObject *view) {
    Mapping *m = mapping_of(view);
    if (m == NULL) {
        return NULL;
    }
    PyObject *answer = PyBool_FromLong(m->on_death != NULL);
    Py_DECREF(m);
    return answer;
}

static PyMethodDef Pool_methods[] = {
    {"map", (PyCFunction)(void (*)(void))Pool_map, METH_FASTCALL,
     "map(offset, size[, on_death, arg]): a writable uint8 numpy array of those bytes of the file "
     "(copy-on-write), over a Mapping (its base); with on_death, its bytes call on_death(arg) once, "
     "right after they became unreachable (the view and every array derived from it gone), "
     "counted in watched() as it is made."},
    {"map_many", (PyCFunction)(void (*)(void))Pool_map_many, METH_FASTCALL,
     "map_many(offsets, sizes[, on_death, args]): such an array per extent, in order (with on_death, "
     "each calls on_death(args[i]) at its death), all or none; nearby extents share one "
     "copy-on-write mapping, unmapped when the last of them dies."},
    {"disarm", (PyCFunction)Pool_disarm, METH_O,
     "disarm(view): its death calls nothing after all, and watched() no longer counts it; False if "
     "it was not armed."},
    {"watched", (PyCFunction)Pool_watched, METH_NOARGS,
     "watched(): how many views map and map_many armed, less those disarmed."},
    {"close", (PyCFunction)Pool_close, METH_NOARGS,
     "close(): unmap the idle mappings and make no more (views made earlier stay valid)."},
    {"idle", (PyCFunction)Pool_idle, METH_NOARGS, "idle(): how many reset mappings wait for reuse."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmcache.kernel._mapping.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(fd): the copy-on-write views of one file, with reset mappings kept for reuse.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
};

/* ------------------------------------------------------------- copying into shared memory */
/* A writer's copy into the arena: memory that was last written long ago (the arena is reused in
 * allocation order). From STREAM_MIN_BYTES on, on x86-64, it is copied with non-temporal stores,
 * which skip reading each destination line into the cache before overwriting it: ~16% less time
 * for 8 MiB, none below ~2 MiB (docs/benchmarks.md). The price: the bytes are not left in the
 * cache, so whoever reads them next (the debug checksum right after the copy, a reader on the
 * node) reads them from memory; at 2 MiB and more most of them would have left a core's caches
 * anyway.
 * Non-temporal stores are weakly ordered, so the copy ends with a store fence: every byte is
 * visible before any later store of this thread, the seal that publishes the entry included.
 * The GIL is released for copies of UNLOCKED_MIN_BYTES or more (the buffers stay exported). */
#define STREAM_MIN_BYTES ((size_t)2 << 20)
#define UNLOCKED_MIN_BYTES ((size_t)64 << 10)

static void copy_bytes(char *dst, const char *src, size_t n) {
#if defined(__x86_64__)
    if (n >= STREAM_MIN_BYTES) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* to the first 16-byte aligned store */
        memcpy(dst, src, head);
        size_t i = head;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + i, src + i, n - i);
        _mm_sfence();
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* copy_into(destination, source): copy every byte of `source` to the start of `destination`. */
static PyObject *copy_into(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "copy_into(destination, source) takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &src, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    int fits = src.len <= dst.len;
    if (!fits) {
        PyErr_Format(PyExc_ValueError, "copy_into: %zd bytes do not fit in %zd", src.len, dst.len);
    } else if ((size_t)src.len >= UNLOCKED_MIN_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        copy_bytes(dst.buf, src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
    } else {
        copy_bytes(dst.buf, src.buf, (size_t)src.len);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (!fits) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef mapping_methods[] = {
    {"is_watched", (PyCFunction)is_watched, METH_O,
     "is_watched(view): whether the death of the view's bytes is watched (armed by map or map_many)."},
    {"copy_into", (PyCFunction)(void (*)(void))copy_into, METH_FASTCALL,
     "copy_into(destination, source): copy the bytes of `source` to the start of the writable "
     "`destination` (from 2 MiB on x86-64 they bypass the cache; the GIL released from 64 KiB)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mapping_module = {
    PyModuleDef_HEAD_INIT, "shmcache.kernel._mapping", "Copy-on-write mappings (see mapping.c).", -1,
    mapping_methods,
};

PyMODINIT_FUNC PyInit__mapping(void) {
    if (PyType_Ready(&MappingType) < 0 || PyType_Ready(&PoolType) < 0) {
        return NULL;
    }
    import_array1(NULL);
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
    if (m != NULL && (PyModule_AddObjectRef(m, "Mapping", (PyObject *)&MappingType) < 0 ||
                      PyModule_AddObjectRef(m, "Pool", (PyObject *)&PoolType) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
