/* shmcache.node._native: the hot transactions of the node layer, one native call each.
 *
 * The lookup, the claim of a missed key (a new reservation, a takeover of a dead owner's, or
 * the one to wait on, with the stripe's eviction when it is full) and the seal are whole
 * transactions here, each in one stripe section. Python keeps the slow paths (the allocation
 * and eviction decisions of the arena, waiting, hand-over, repair, reaping); every step both
 * sides use has its one implementation here: entering and leaving a section, the key scan,
 * reading and writing a slot record with its crc, this process's pin records, its counters, the
 * access stamp and expiry. The allocator's two looks at the slot table (the first-fit gap, the
 * eviction order) are here too: one pass in C instead of a dozen numpy passes (allocator.py
 * decides what to do with them). The Python modules (sections.py, slots.py, pins.py,
 * counters.py, allocator.py, reservations.py) call these; lookups.py and index.py compose them.
 *
 * Byte layout: layout.py is the reference; this file repeats the few field offsets it needs as
 * constants and exports them (layout.py asserts that both agree at import).
 *
 * Concurrency protocol (the LMDB way: the rules next to the code that follows them)
 * ------------------------------------------------------------------------------------
 * 1. Writers.  Every write of a slot record, key record, pin record or refcount happens with the
 *    slot's stripe lock held: a process-shared robust pthread mutex in the index's lock table
 *    (the node lock is another).  Uncontended, taking and giving it back are one atomic
 *    read-modify-write each in user space, no system call (the futex is only entered to sleep
 *    or to wake a sleeper); the lock is an acquire barrier and the unlock a release barrier, so
 *    plain loads and stores inside a section are ordered against every other holder's.  Robust:
 *    every thread's held robust mutexes are on its robust list (glibc registers it with the
 *    kernel); when a thread dies holding one, SIGKILL included, the kernel marks it owner-died
 *    and wakes a waiter, whose lock then answers EOWNERDEAD: it holds the lock and makes it
 *    consistent.  That is the guarantee SEM_UNDO gave, without a system call per section (a
 *    SysV semop cost ~0.7 us here, four per hit).  A dead holder is only ever found this way:
 *    nothing else reads the owner.  A section is entered and left on one thread.  The GIL
 *    serialises this process's threads around the local pin bookkeeping (pin hash table, free
 *    list), which is only touched with the GIL held.
 * 2. Held markers.  After taking a section's lock the entrant sets the section's `held` u32 to
 *    its pid, and clears it right before giving the lock back after a clean exit.  Finding it
 *    set on entry means the previous holder died inside (EOWNERDEAD) or left by an exception:
 *    the native transactions then give the lock back WITHOUT touching the marker and answer
 *    SLOW, and Python enters the section itself, which runs the repair (sections.py) and then
 *    calls the same in-section function.  A holder that died after locking but before setting
 *    the marker had written nothing: the lock alone comes back.
 * 3. Records.  A slot record (44 bytes) and its crc (4 bytes, over the record and the slot's
 *    48-byte key record) are written by one memcpy of 48 bytes from a local copy: never field by
 *    field in place, so a lock-free reader sees either a record whose crc checks or a torn one
 *    whose crc fails (and then takes the locked path), never a half-written record that checks.
 *    A reservation names its slot's key in the same call, right before the record (the crc
 *    covers the key), so a writer killed between the two, which leaves a pair that fails its crc
 *    (quarantined by the stripe's repair, counted as a corrupt record), needs a kill between two
 *    stores rather than anywhere in the Python between them.
 * 4. Lock-free readers.  `contains`, `repeat_hit` and the LRU stamp run without the semaphore:
 *      - contains copies the key record and the slot record with its crc into locals, then
 *        verifies the crc over the copies (an acquire fence orders the loads after the scan);
 *        a crc failure answers SLOW (the locked lookup decides);
 *      - repeat_hit loads state and gen (two aligned loads); it is only used for an entry the
 *        caller holds a pin on, so the slot cannot be reused while it is read: a changed gen or
 *        state just means "not live any more";
 *      - last_access is one aligned 8-byte store and load (approximate LRU by design).
 *    Aligned loads and stores of 4 and 8 bytes are single-copy atomic on the platforms we build
 *    for (x86-64, aarch64); they go through __atomic builtins with relaxed order so the compiler
 *    neither tears nor caches them.
 * 5. Counters.  Each process adds only to its own client record (__atomic_fetch_add, relaxed);
 *    readers sum every record (counters.py), between two equal even reads of the retire
 *    sequence (point 8).
 * 6. Blocking.  A contended lock is waited for with the GIL released (pthread_mutex_clocklock on
 *    CLOCK_MONOTONIC in 50 ms slices, so a signal is seen, up to the lock timeout; the message
 *    names the pid in the held marker); everything else runs with the GIL held and never blocks.
 * 7. The allocator's look.  `gap` runs under the node section (so no other allocator takes space
 *    meanwhile) and reads every record without stripe locks, each by one copy of its fields:
 *    others may free extents while it looks (evict, abandon, or shrink a reservation's extent to
 *    a head of it), never take space.  A record read while it is being
 *    freed can mix old and new fields (an old state with the new zero offset): such phantom
 *    extents only make it more careful, because a gap starts at the running maximum of the ends
 *    seen so far (`first_fit`), so no live extent is ever handed out.  `evictable` reads the same
 *    way; the evictor re-reads each candidate under its stripe lock before it frees anything.
 * 8. The retire sequence (a seqlock).  Folding a leaving client's counters into the retired
 *    totals and zeroing its record (counters.py, under the node section) are many stores; a
 *    lock-free reader summing between them would count that client twice or not at all, and a
 *    Prometheus counter that goes down reads as a reset.  The retirer makes the u64 at
 *    H_RETIRE_SEQ odd (`retire_begin`: a relaxed store, then a release fence, so it is seen
 *    before any store of the fold), and even again when done (`retire_end`: a release store,
 *    seen after every store of the fold).  A reader loads it with acquire (`retire_seq`), sums,
 *    then loads it again after an acquire fence (`retire_seq(True)`): the sum is kept only if
 *    both loads gave the same even value.  A retire that died inside leaves it odd until the
 *    next node-section holder replays the journal and ends it; meanwhile readers read through
 *    the journal (counters.py).
 * 9. Reservation semaphores.  A claim (native, in the stripe section) reads a slot's SysV
 *    semaphore (GETVAL: 0 means nobody holds it, so a RESERVED record's owner is dead) and takes
 *    it with one semop of two operations, "wait for zero, then +1 with SEM_UNDO", both
 *    IPC_NOWAIT: the same pair as kernel/semaphores.py's try_acquire (reservations.py has the
 *    protocol). The semaphore number is the slot's (layout.slot_sem). The kernel orders the
 *    semop against every other process's; the record written after it, in the section, is what
 *    a waiter reads once the semaphore is released. Neither call blocks: the GIL is kept.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/sem.h>
#include <unistd.h>
#include <zlib.h>

/* ---------------------------------------------------------------------------- layout constants */
#define SLOT_SIZE 80
#define RECORD_SIZE 44 /* state u32, owner i32, gen u64, offset u64, size u64, sealed_at f64, refs u32 */
#define S_CRC 44
#define S_LAST_ACCESS 48
#define KEY_SIZE 48
#define STRIPE_SIZE 8
#define LOCK_SIZE 64 /* one process-shared robust mutex, padded to a cache line */
#define H_READY 12 /* the header's u32 `ready`: 1 ready, DESTROYED once destroy_namespace removed it */
#define H_RETIRE_SEQ 88 /* the header's u64 retire sequence (point 8) */
#define DESTROYED 2
#define CLIENT_HEAD_SIZE 512
#define C_COUNTERS 64
#define PIN_SIZE 16
#define ATTACHMENT_SIZE 192
#define SEALED_FIELDS 6 /* slots.SealedEntry: slot, gen, offset, size, pinned, attachment */

enum { EMPTY = 0, RESERVED = 1, SEALED = 2, STALE = 3 };
/* Counter indices used here (layout.Counter; checked from layout.py) */
enum {
    COUNTER_HITS_PROCESS = 0,
    COUNTER_HITS_NODE = 1,
    COUNTER_MISSES = 2,
    COUNTER_TAKEOVERS = 5,
    COUNTER_EVICTIONS_LRU = 6,
    COUNTER_EVICTIONS_TTL = 7
};
/* What a claim found (reservations.py's ClaimKind): ours, ours by a takeover of a dead owner's,
 * another live owner's to wait on, or no slot of the stripe to take */
enum { CLAIM_OWNER = 0, CLAIM_TAKEOVER = 1, CLAIM_WAIT = 2, CLAIM_FULL = 3 };
#define S_META 68 /* the slot's modality u8 and key kind u8 (informational, outside the crc) */

#pragma pack(push, 1)
typedef struct {
    uint32_t state;
    int32_t owner;
    uint64_t gen;
    uint64_t offset;
    uint64_t size;
    double sealed_at;
    uint32_t refs;
} record_t;
typedef struct {
    int32_t slot;
    uint32_t count;
    uint64_t gen;
} pin_t;
#pragma pack(pop)

_Static_assert(sizeof(record_t) == RECORD_SIZE, "slot record size");
_Static_assert(sizeof(pthread_mutex_t) <= LOCK_SIZE, "a mutex fits its lock cell");
_Static_assert(sizeof(pin_t) == PIN_SIZE, "pin record size");

/* What an in-section step found. */
enum { R_MISS = 0, R_HIT = 1, R_DAMAGED = 2, R_ERROR = -1 };

/* ---------------------------------------------------------------------------- crash points */
/* The crash points the native code reaches (crashpoints.py names them; `arm` selects one). */
enum { POINT_NONE = 0, POINT_IN_STRIPE_SECTION, POINT_SLOT_RECORD_TORN, POINT_HOLDING_PINS };
static int armed_point = POINT_NONE;

static void reached(int point) {
    if (armed_point == point) {
        kill(getpid(), SIGKILL);
    }
}

/* ---------------------------------------------------------------------------- errors */
static PyObject *LockTimeout, *CacheClosed, *PinLimitReached;

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------------------- the index object */
typedef struct {
    int32_t slot;
    int32_t index; /* pin record index, -1: free bucket */
    uint64_t gen;
} bucket_t;

typedef struct {
    uint64_t start, end;
} extent_t;

typedef struct {
    double rank; /* -1: expired, else the last access */
    Py_ssize_t slot;
} candidate_t;

typedef struct {
    PyObject_HEAD
    Py_buffer buffer;
    char *base;
    Py_ssize_t length;
    Py_ssize_t locks_off; /* the lock table: the node lock, then one per stripe */
    pid_t pid; /* this process: what its held markers hold */
    double lock_timeout;
    double ttl; /* 0: no TTL */
    Py_ssize_t stripes, ways, slots, clients, pins;
    Py_ssize_t stripes_off, slots_off, keys_off, attachments_off, clients_off, client_size;
    int semid; /* the namespace's SysV semaphore set: a slot's reservation semaphore is its number */
    uint32_t zero_crc;
    int row; /* this process's client record, -1 while detached */
    /* this process's pins: (slot, gen) -> pin record index, linear probing */
    bucket_t *table;
    Py_ssize_t table_mask;
    int32_t *free_pins; /* a stack of free pin record indices */
    Py_ssize_t free_top;
    PyTypeObject *sealed; /* slots.SealedEntry: a hit is one (a tuple subclass of 6 items) */
    /* the allocator's scratch, made once: `gap`'s extents and room to sort them (2 x slots), and
     * `evictable`'s candidates (slots); one user at a time, as both run under the node section
     * (allocator.py), which one thread of one process holds */
    extent_t *extents;
    candidate_t *candidates;
} Index;

static inline char *slot_at(Index *ix, Py_ssize_t slot) { return ix->base + ix->slots_off + SLOT_SIZE * slot; }
static inline char *key_at(Index *ix, Py_ssize_t slot) { return ix->base + ix->keys_off + KEY_SIZE * slot; }
static inline char *stripe_at(Index *ix, Py_ssize_t stripe) { return ix->base + ix->stripes_off + STRIPE_SIZE * stripe; }
static inline char *client_at(Index *ix, Py_ssize_t row) { return ix->base + ix->clients_off + ix->client_size * row; }
static inline pin_t *pin_at(Index *ix, Py_ssize_t index) {
    return (pin_t *)(client_at(ix, ix->row) + CLIENT_HEAD_SIZE + PIN_SIZE * index);
}
static inline pthread_mutex_t *lock_at(Index *ix, int lock) {
    return (pthread_mutex_t *)(ix->base + ix->locks_off + LOCK_SIZE * lock);
}
static inline int stripe_lock(Py_ssize_t stripe) { return (int)(1 + stripe); }

static uint32_t record_crc(const char *head, const char *key, uint32_t zero_crc) {
    uLong crc = crc32(0L, (const Bytef *)head, RECORD_SIZE);
    return (uint32_t)crc32(crc, (const Bytef *)key, KEY_SIZE) ^ zero_crc;
}

/* ------------------------------------------------------------------------- records (rule 3) */
static int read_record(Index *ix, Py_ssize_t slot, record_t *out) {
    char copy[RECORD_SIZE + 4];
    memcpy(copy, slot_at(ix, slot), sizeof copy);
    memcpy(out, copy, RECORD_SIZE);
    uint32_t stored;
    memcpy(&stored, copy + S_CRC, 4);
    int known = out->state <= STALE;
    if (!known) {
        out->state = STALE;
    }
    return known && stored == record_crc(copy, key_at(ix, slot), ix->zero_crc);
}

static void write_record(Index *ix, Py_ssize_t slot, const record_t *rec) {
    char data[RECORD_SIZE + 4];
    memcpy(data, rec, RECORD_SIZE);
    uint32_t crc = record_crc(data, key_at(ix, slot), ix->zero_crc);
    memcpy(data + S_CRC, &crc, 4);
    if (armed_point == POINT_SLOT_RECORD_TORN && rec->state != EMPTY) {
        memcpy(slot_at(ix, slot), data, RECORD_SIZE); /* a dying writer got the fields out, not the crc */
        reached(POINT_SLOT_RECORD_TORN);
    }
    memcpy(slot_at(ix, slot), data, sizeof data);
}

static void freed(record_t *rec) {
    uint64_t gen = rec->gen;
    memset(rec, 0, sizeof *rec);
    rec->owner = -1;
    rec->gen = gen;
}

/* refs changed on a SEALED or STALE record: an unreferenced STALE record is freed */
static void set_refs(record_t *rec, uint32_t refs) {
    if (rec->state == STALE && refs == 0) {
        freed(rec);
    } else {
        rec->refs = refs;
    }
}

static double last_access(Index *ix, Py_ssize_t slot) {
    uint64_t bits = __atomic_load_n((uint64_t *)(slot_at(ix, slot) + S_LAST_ACCESS), __ATOMIC_RELAXED);
    double value;
    memcpy(&value, &bits, 8);
    return value;
}

static void touch(Index *ix, Py_ssize_t slot, double now) {
    uint64_t bits;
    memcpy(&bits, &now, 8);
    __atomic_store_n((uint64_t *)(slot_at(ix, slot) + S_LAST_ACCESS), bits, __ATOMIC_RELAXED);
}

static int expired(Index *ix, Py_ssize_t slot, double now) {
    return ix->ttl > 0 && now - last_access(ix, slot) > ix->ttl;
}

static void count(Index *ix, int counter, uint64_t n) {
    if (ix->row < 0) {
        return;
    }
    uint64_t *cell = (uint64_t *)(client_at(ix, ix->row) + C_COUNTERS + 8 * counter);
    __atomic_fetch_add(cell, n, __ATOMIC_RELAXED);
}

/* ---------------------------------------------------------------------- sections (rules 1, 2) */
static void lock_error(int rc, const char *what) {
    PyErr_Format(PyExc_OSError, "%s cannot be used (%s): the index segment is damaged", what, strerror(rc));
}

/* Wait for a contended lock with the GIL released, in slices so that a signal (Ctrl-C) is seen,
 * at most lock_timeout seconds: pthread's answer (0 or EOWNERDEAD: ours now), or -1 with an
 * exception set. */
static int wait_lock(Index *ix, pthread_mutex_t *m, Py_ssize_t held_off, const char *what) {
    double deadline = monotonic_now() + ix->lock_timeout;
    for (;;) {
        double now = monotonic_now(), slice = deadline - now;
        slice = slice > 0.05 ? 0.05 : slice < 0 ? 0 : slice;
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_nsec += (long)(slice * 1e9);
        until.tv_sec += until.tv_nsec / 1000000000L;
        until.tv_nsec %= 1000000000L;
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = pthread_mutex_clocklock(m, CLOCK_MONOTONIC, &until);
        Py_END_ALLOW_THREADS
        if (rc != ETIMEDOUT) {
            return rc;
        }
        if (PyErr_CheckSignals() < 0) {
            return -1;
        }
        if (monotonic_now() >= deadline) {
            int pid = (int)__atomic_load_n((uint32_t *)(ix->base + held_off), __ATOMIC_RELAXED);
            PyObject *limit = PyFloat_FromDouble(ix->lock_timeout);
            if (limit != NULL) {
                PyErr_Format(LockTimeout, "%s was held for more than lock_timeout_s=%Rs (holder pid %d)", what,
                             limit, pid);
                Py_DECREF(limit);
            }
            return -1;
        }
    }
}

/* Take lock `lock` (its held marker at `held_off` names the holder in a timeout's message):
 * 0, or -1 with an exception set. Uncontended, one atomic exchange in user space (no system
 * call, the GIL kept). A holder that died holding it (EOWNERDEAD, from the kernel's robust
 * futex list) leaves it to us: made consistent here; its held marker says what to repair. */
static int acquire(Index *ix, int lock, Py_ssize_t held_off, const char *what) {
    pthread_mutex_t *m = lock_at(ix, lock);
    int rc = pthread_mutex_trylock(m);
    if (rc == EBUSY) {
        rc = wait_lock(ix, m, held_off, what);
        if (rc < 0) {
            return -1;
        }
    }
    if (rc == EOWNERDEAD) {
        rc = pthread_mutex_consistent(m);
        if (rc != 0) {
            pthread_mutex_unlock(m);
        }
    }
    if (rc != 0) {
        lock_error(rc, what);
        return -1;
    }
    return 0;
}

static int give_back(Index *ix, int lock) {
    int rc = pthread_mutex_unlock(lock_at(ix, lock));
    if (rc != 0) {
        lock_error(rc, "a lock");
        return -1;
    }
    return 0;
}

/* Enter: 1 if the last holder died inside (marker set; now set by us), 0 if not, -1 on error. */
static int enter(Index *ix, int lock, Py_ssize_t held_off, const char *what) {
    if (acquire(ix, lock, held_off, what) < 0) {
        return -1;
    }
    uint32_t *held = (uint32_t *)(ix->base + held_off);
    int died_inside = __atomic_load_n(held, __ATOMIC_RELAXED) != 0;
    __atomic_store_n(held, (uint32_t)ix->pid, __ATOMIC_RELAXED);
    return died_inside;
}

static int leave(Index *ix, int lock, Py_ssize_t held_off, int clean) {
    if (clean) {
        __atomic_store_n((uint32_t *)(ix->base + held_off), 0, __ATOMIC_RELAXED);
    }
    return give_back(ix, lock);
}

/* Enter a stripe natively: 1 entered (marker clean), 0 the stripe needs its repair (semaphore
 * given back, marker untouched: Python enters it), -1 error. */
static int enter_stripe_fast(Index *ix, Py_ssize_t stripe) {
    int lock = stripe_lock(stripe);
    if (acquire(ix, lock, ix->stripes_off + STRIPE_SIZE * stripe, "a stripe lock") < 0) {
        return -1;
    }
    uint32_t *held = (uint32_t *)stripe_at(ix, stripe);
    if (__atomic_load_n(held, __ATOMIC_RELAXED) != 0) {
        return give_back(ix, lock) < 0 ? -1 : 0;
    }
    __atomic_store_n(held, (uint32_t)ix->pid, __ATOMIC_RELAXED);
    reached(POINT_IN_STRIPE_SECTION);
    return 1;
}

static int leave_stripe(Index *ix, Py_ssize_t stripe) {
    return leave(ix, stripe_lock(stripe), ix->stripes_off + STRIPE_SIZE * stripe, 1);
}

/* ------------------------------------------------------------------------------------ pins */
static inline Py_ssize_t bucket_of(Index *ix, int32_t slot, uint64_t gen) {
    uint64_t h = ((uint64_t)(uint32_t)slot * 0x9E3779B97F4A7C15ull) ^ (gen * 0xC2B2AE3D27D4EB4Full);
    return (Py_ssize_t)((h ^ (h >> 29)) & (uint64_t)ix->table_mask);
}

static Py_ssize_t find_bucket(Index *ix, int32_t slot, uint64_t gen) {
    Py_ssize_t b = bucket_of(ix, slot, gen);
    while (ix->table[b].index >= 0) {
        if (ix->table[b].slot == slot && ix->table[b].gen == gen) {
            return b;
        }
        b = (b + 1) & ix->table_mask;
    }
    return -1 - b; /* not found: -1 - the free bucket where it would go */
}

/* Remove bucket `b` (backward-shift deletion keeps every probe chain unbroken). */
static void drop_bucket(Index *ix, Py_ssize_t b) {
    Py_ssize_t hole = b, next = (b + 1) & ix->table_mask;
    while (ix->table[next].index >= 0) {
        Py_ssize_t home = bucket_of(ix, ix->table[next].slot, ix->table[next].gen);
        /* move `next` into the hole unless its home lies cyclically in (hole, next] */
        int stays = hole <= next ? (hole < home && home <= next) : (hole < home || home <= next);
        if (!stays) {
            ix->table[hole] = ix->table[next];
            hole = next;
        }
        next = (next + 1) & ix->table_mask;
    }
    ix->table[hole].index = -1;
}

static void write_pin(Index *ix, int32_t index, int32_t slot, uint32_t n, uint64_t gen) {
    pin_t pin = {slot, n, gen};
    memcpy(pin_at(ix, index), &pin, sizeof pin); /* one copy: repairs read it under the lock */
}

/* Add `n` pins on (slot, gen); -1 with PinLimitReached (a CapacityError) when every pin record is
 * in use. The caller holds the slot's stripe section and adds `n` to the refcount. */
static int pin_add(Index *ix, int32_t slot, uint64_t gen, uint32_t n) {
    if (ix->row < 0) { /* detached while a caller waited for its stripe: no record to pin in */
        PyErr_SetString(CacheClosed, "this process detached from the namespace");
        return -1;
    }
    Py_ssize_t b = find_bucket(ix, slot, gen);
    if (b >= 0) {
        int32_t index = ix->table[b].index;
        write_pin(ix, index, slot, pin_at(ix, index)->count + n, gen);
        return 0;
    }
    if (ix->free_top == 0) {
        PyErr_Format(PinLimitReached,
                     "this process holds pins on %zd entries (max_pins_per_process): release requests "
                     "with cleanup_request() or drop returned views",
                     ix->pins);
        return -1;
    }
    b = -1 - b;
    int32_t index = ix->free_pins[--ix->free_top];
    ix->table[b] = (bucket_t){slot, index, gen};
    write_pin(ix, index, slot, n, gen);
    return 0;
}

/* Remove up to `n` pins on (slot, gen): how many were held. */
static uint32_t pin_remove(Index *ix, int32_t slot, uint64_t gen, uint32_t n) {
    Py_ssize_t b = ix->row < 0 ? -1 : find_bucket(ix, slot, gen);
    if (b < 0) {
        return 0;
    }
    int32_t index = ix->table[b].index;
    uint32_t have = pin_at(ix, index)->count;
    uint32_t taken = n < have ? n : have;
    write_pin(ix, index, slot, have - taken, gen);
    if (have == taken) {
        drop_bucket(ix, b);
        ix->free_pins[ix->free_top++] = index;
    }
    return taken;
}

/* --------------------------------------------------------------- in-section steps (rule 1) */
typedef struct {
    Py_ssize_t slot;
    record_t rec;
    int pinned; /* the pins asked for were taken (a seal out of pin records takes none) */
    int has_attachment;
    char attachment[ATTACHMENT_SIZE]; /* copied inside the section: its writers hold it too */
} hit_t;

static Py_ssize_t stripe_of(Index *ix, const char *needle) {
    uint64_t bits;
    memcpy(&bits, needle + 16, 8);
    return (Py_ssize_t)(bits % (uint64_t)ix->stripes);
}

/* The first slot of `stripe` from `from` on whose key record is `needle`; -1 if none. The one key
 * scan, of lookups and claims. */
static Py_ssize_t next_match(Index *ix, Py_ssize_t stripe, const char *needle, Py_ssize_t from) {
    for (Py_ssize_t slot = from; slot < (stripe + 1) * ix->ways; slot++) {
        if (memcmp(key_at(ix, slot), needle, KEY_SIZE) == 0) {
            return slot;
        }
    }
    return -1;
}

/* Find and pin a sealed, unexpired entry of `needle` in `stripe` (whose section the caller
 * holds). An expired one is retired on the way. R_DAMAGED: `out->slot` failed its crc (nothing
 * changed after it; the caller quarantines and calls again). */
static int hit_in(Index *ix, Py_ssize_t stripe, const char *needle, double now, uint32_t pins, hit_t *out) {
    for (Py_ssize_t slot = next_match(ix, stripe, needle, stripe * ix->ways); slot >= 0;
         slot = next_match(ix, stripe, needle, slot + 1)) {
        record_t rec;
        if (!read_record(ix, slot, &rec)) {
            out->slot = slot;
            return R_DAMAGED;
        }
        if (rec.state != SEALED) {
            continue;
        }
        if (expired(ix, slot, now)) { /* a miss from now on, freed at its last release */
            uint32_t refs = rec.refs;
            if (refs) {
                rec.state = STALE;
            } else {
                freed(&rec);
                count(ix, COUNTER_EVICTIONS_TTL, 1);
            }
            write_record(ix, slot, &rec);
            continue;
        }
        if (pins) {
            if (pin_add(ix, (int32_t)slot, rec.gen, pins) < 0) {
                return R_ERROR;
            }
            rec.refs += pins;
            write_record(ix, slot, &rec);
            reached(POINT_HOLDING_PINS);
        }
        touch(ix, slot, now);
        out->slot = slot;
        out->rec = rec;
        out->pinned = 1;
        char *at = ix->base + ix->attachments_off + ATTACHMENT_SIZE * slot;
        uint64_t stamped;
        memcpy(&stamped, at, 8);
        out->has_attachment = rec.gen != 0 && stamped == rec.gen;
        if (out->has_attachment) {
            memcpy(out->attachment, at, ATTACHMENT_SIZE);
        }
        return R_HIT;
    }
    return R_MISS;
}

/* The fenced seal of our reservation (slot, gen), its stripe's section held: still RESERVED by
 * this process with `gen`, it becomes SEALED (stamped `now`) with `pins` pins of ours, and with
 * `attachment` (ATTACHMENT_SIZE bytes, its first 8 the generation; NULL: none) written first.
 * A process that detached (row -1) owns no reservation: fenced off.
 * Out of pin records it is sealed with none (`out->pinned` 0: the caller pins it later or keeps
 * its own value). R_MISS: fenced off (taken over), nothing written; R_DAMAGED: `out->slot`
 * fails its crc, nothing written (the caller quarantines it: the reservation is lost). */
static int seal_in(Index *ix, Py_ssize_t slot, uint64_t gen, uint32_t pins, const char *attachment, double now,
                   hit_t *out) {
    record_t rec;
    out->slot = slot;
    if (!read_record(ix, slot, &rec)) {
        return R_DAMAGED;
    }
    if (rec.state != RESERVED || rec.owner != ix->row || rec.gen != gen) {
        return R_MISS;
    }
    out->pinned = 1;
    if (pins && pin_add(ix, (int32_t)slot, gen, pins) < 0) {
        if (!PyErr_ExceptionMatches(PinLimitReached)) {
            return R_ERROR;
        }
        PyErr_Clear();
        pins = 0;
        out->pinned = 0;
    }
    out->has_attachment = attachment != NULL;
    if (attachment != NULL) {
        memcpy(out->attachment, attachment, ATTACHMENT_SIZE);
        memcpy(ix->base + ix->attachments_off + ATTACHMENT_SIZE * slot, attachment, ATTACHMENT_SIZE);
    }
    touch(ix, slot, now);
    rec.state = SEALED;
    rec.sealed_at = now;
    rec.refs = pins;
    write_record(ix, slot, &rec);
    out->rec = rec;
    return R_HIT;
}

/* A slot's reservation semaphore (rule 9): its value (0: nobody holds it), and the hold a
 * claim takes, "wait for zero, then +1 with SEM_UNDO" as one semop, both IPC_NOWAIT: the same
 * two operations as kernel/semaphores.py's try_acquire. A set removed under us (the namespace
 * destroyed) raises CacheClosed, as that module does. */
static int sem_failed(const char *what) {
    if (errno == EIDRM || errno == EINVAL) {
        PyErr_Format(CacheClosed, "%s: the namespace's semaphore set was removed (destroyed?)", what);
    } else {
        PyErr_SetFromErrno(PyExc_OSError);
    }
    return -1;
}

/* 1 if a live process holds slot's semaphore, 0 if nobody does, -1 with an exception set. */
static int sem_held(Index *ix, Py_ssize_t slot) {
    int value = semctl(ix->semid, (int)slot, GETVAL);
    return value < 0 ? sem_failed("semctl(GETVAL)") : value != 0;
}

/* Give back our hold of slot's semaphore (the -1 with SEM_UNDO of kernel/semaphores.py's
 * release): 0, or -1 with an exception set (the one already pending, if any, is kept). */
static int sem_give(Index *ix, Py_ssize_t slot) {
    struct sembuf op = {(unsigned short)slot, -1, SEM_UNDO | IPC_NOWAIT};
    if (semop(ix->semid, &op, 1) == 0) {
        return 0;
    }
    return PyErr_Occurred() ? -1 : sem_failed("release");
}

/* 1 taken, 0 not (someone holds it), -1 with an exception set. */
static int sem_take(Index *ix, Py_ssize_t slot) {
    struct sembuf ops[2] = {{(unsigned short)slot, 0, IPC_NOWAIT}, {(unsigned short)slot, 1, SEM_UNDO | IPC_NOWAIT}};
    if (semop(ix->semid, ops, 2) == 0) {
        return 1;
    }
    return errno == EAGAIN || errno == EINTR ? 0 : sem_failed("try_acquire");
}

/* A generation the slot never had, nor its attachment (a repaired record's generation may have
 * been torn, and must never meet an old attachment again). */
static uint64_t next_gen(Index *ix, Py_ssize_t slot, const record_t *rec) {
    uint64_t stamped;
    memcpy(&stamped, ix->base + ix->attachments_off + ATTACHMENT_SIZE * slot, 8);
    return (rec->gen > stamped ? rec->gen : stamped) + 1;
}

/* Take slot's semaphore and make its record RESERVED by us with `gen` (naming it for `needle`
 * unless NULL: a takeover keeps the key): CLAIM_OWNER, CLAIM_FULL if the semaphore is held, or
 * R_ERROR. */
static int take_in(Index *ix, Py_ssize_t slot, uint64_t gen, const char *needle, uint8_t modality, uint8_t kind) {
    int taken = sem_take(ix, slot);
    if (taken <= 0) {
        return taken < 0 ? R_ERROR : CLAIM_FULL;
    }
    record_t rec = {RESERVED, ix->row, gen, 0, 0, 0.0, 0};
    if (needle != NULL) {
        char *at = slot_at(ix, slot);
        at[S_META] = (char)modality;
        at[S_META + 1] = (char)kind;
        /* the key, then the record whose crc covers it, back to back (rule 3) */
        memcpy(key_at(ix, slot), needle, KEY_SIZE);
    }
    write_record(ix, slot, &rec);
    return CLAIM_OWNER;
}

/* The slot of `stripe` a new reservation may take (its section held): the first EMPTY one whose
 * semaphore nobody holds, else one made EMPTY by evicting the unreferenced SEALED entry that
 * expired (first) or was used least recently (counted), else a dead owner's reservation (freed).
 * -1: none; R_DAMAGED_SLOT(slot) = -2 - slot for a record that fails its crc (nothing changed);
 * R_ERROR_SLOT = INT64_MIN with an exception set. */
#define ERROR_SLOT PY_SSIZE_T_MIN
static Py_ssize_t victim_in(Index *ix, Py_ssize_t stripe, double now) {
    Py_ssize_t evict = -1, first = stripe * ix->ways, end = first + ix->ways;
    double best = 0.0;
    int best_expired = 0;
    for (Py_ssize_t slot = first; slot < end; slot++) {
        record_t r;
        if (!read_record(ix, slot, &r)) {
            return -2 - slot;
        }
        if (r.state == EMPTY) {
            int held = sem_held(ix, slot); /* held: emptied by a repair while its owner lives on */
            if (held <= 0) {
                return held < 0 ? ERROR_SLOT : slot;
            }
        } else if (r.state == SEALED && r.refs == 0) {
            int gone = expired(ix, slot, now);
            double rank = gone ? -1.0 : last_access(ix, slot);
            rank = isnan(rank) ? INFINITY : rank; /* a damaged stamp goes last, as in `evictable` */
            if (evict < 0 || rank < best) { /* the first of equal ranks */
                evict = slot;
                best = rank;
                best_expired = gone;
            }
        }
    }
    if (evict >= 0) {
        count(ix, best_expired ? COUNTER_EVICTIONS_TTL : COUNTER_EVICTIONS_LRU, 1);
    } else {
        for (Py_ssize_t slot = first; slot < end && evict < 0; slot++) {
            record_t r;
            read_record(ix, slot, &r); /* every record of the stripe verified above */
            int held = r.state == RESERVED ? sem_held(ix, slot) : 1;
            if (held < 0) {
                return ERROR_SLOT;
            }
            evict = held ? -1 : slot;
        }
        if (evict < 0) {
            return -1;
        }
    }
    record_t r;
    read_record(ix, evict, &r);
    freed(&r);
    write_record(ix, evict, &r);
    return evict;
}

/* After a miss of `needle` in `stripe` (its section held): take over the reservation of a dead
 * owner, wait on a live one's, or make ours (`modality`, `kind`: the key's, for inspection).
 * Fills (kind, slot, gen) of the claim; R_DAMAGED: `*slot` fails its crc, nothing changed (the
 * caller quarantines it and claims again); R_ERROR with an exception set. */
static int claim_in(Index *ix, Py_ssize_t stripe, const char *needle, uint8_t modality, uint8_t kind, double now,
                    int *what, Py_ssize_t *slot, uint64_t *gen) {
    for (Py_ssize_t at = next_match(ix, stripe, needle, stripe * ix->ways); at >= 0;
         at = next_match(ix, stripe, needle, at + 1)) {
        record_t rec;
        if (!read_record(ix, at, &rec)) {
            *slot = at;
            return R_DAMAGED;
        }
        if (rec.state != RESERVED) {
            continue;
        }
        int held = sem_held(ix, at);
        if (held < 0) {
            return R_ERROR;
        }
        *slot = at;
        *gen = held ? rec.gen : next_gen(ix, at, &rec);
        *what = held ? CLAIM_WAIT : take_in(ix, at, *gen, NULL, 0, 0);
        if (*what == R_ERROR) {
            return R_ERROR;
        }
        if (*what == CLAIM_FULL) { /* it just let go: wait, which looks again */
            *what = CLAIM_WAIT;
            *gen = rec.gen;
        } else if (*what == CLAIM_OWNER) {
            *what = CLAIM_TAKEOVER;
            count(ix, COUNTER_TAKEOVERS, 1);
        }
        return R_HIT;
    }
    Py_ssize_t victim = victim_in(ix, stripe, now);
    if (victim == ERROR_SLOT) {
        return R_ERROR;
    }
    if (victim < -1) {
        *slot = -2 - victim;
        return R_DAMAGED;
    }
    *slot = victim;
    *gen = 0;
    *what = CLAIM_FULL;
    if (victim >= 0) {
        record_t rec;
        read_record(ix, victim, &rec); /* EMPTY, verified (or just freed) */
        *gen = next_gen(ix, victim, &rec);
        *what = take_in(ix, victim, *gen, needle, modality, kind);
    }
    return *what == R_ERROR ? R_ERROR : R_HIT;
}

/* Give our reservation (slot, gen) the extent [offset, offset + size), or with `keep` cut its
 * extent to its first `size` bytes (at most what it has), in the stripe's section: R_HIT, R_MISS
 * (fenced off: not ours any more), R_DAMAGED (the record fails its crc; nothing written). */
static int extent_in(Index *ix, Py_ssize_t slot, uint64_t gen, uint64_t offset, uint64_t size, int keep) {
    record_t rec;
    if (!read_record(ix, slot, &rec)) {
        return R_DAMAGED;
    }
    if (rec.state != RESERVED || rec.owner != ix->row || rec.gen != gen) {
        return R_MISS;
    }
    rec.size = keep && rec.size < size ? rec.size : size;
    rec.offset = keep ? rec.offset : offset;
    write_record(ix, slot, &rec);
    return R_HIT;
}

/* Free slot's extent for the allocator if it is still an unreferenced sealed entry (an eviction,
 * counted as expired or least recently used) or a dead owner's reservation: R_HIT freed, R_MISS
 * not (pinned or reused since the allocator's look), R_DAMAGED (nothing written), R_ERROR. */
static int evict_in(Index *ix, Py_ssize_t slot, double now) {
    record_t rec;
    if (!read_record(ix, slot, &rec)) {
        return R_DAMAGED;
    }
    if (rec.state == SEALED && rec.refs == 0 && rec.size) {
        count(ix, expired(ix, slot, now) ? COUNTER_EVICTIONS_TTL : COUNTER_EVICTIONS_LRU, 1);
    } else if (rec.state == RESERVED) {
        int held = sem_held(ix, slot);
        if (held != 0) {
            return held < 0 ? R_ERROR : R_MISS;
        }
    } else {
        return R_MISS;
    }
    freed(&rec);
    write_record(ix, slot, &rec);
    return R_HIT;
}

/* Drop `n` of our pins on (slot, gen). R_DAMAGED: the record fails its crc (our pins are gone:
 * the caller quarantines it, and the recount there no longer counts them). */
static int unpin_in(Index *ix, int32_t slot, uint64_t gen, uint32_t n) {
    uint32_t taken = pin_remove(ix, slot, gen, n);
    record_t rec;
    if (!read_record(ix, slot, &rec)) {
        return R_DAMAGED;
    }
    if (taken == 0 || rec.gen != gen || (rec.state != SEALED && rec.state != STALE)) {
        return R_MISS;
    }
    set_refs(&rec, rec.refs > taken ? rec.refs - taken : 0);
    if (rec.state == EMPTY) {
        count(ix, COUNTER_EVICTIONS_TTL, 1);
    }
    write_record(ix, slot, &rec);
    return R_HIT;
}

/* ------------------------------------------------------------------------- Python objects */
/* SLOW, the one instance of Slow: the answer that sends a caller to the locked Python path */
static PyTypeObject SlowType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmcache.node._native.Slow",
    .tp_basicsize = sizeof(PyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The type of SLOW: take the locked Python path (a stripe needs a repair, a record is damaged).",
};
static PyObject *SLOW;

/* A hit or a seal as a SealedEntry(slot, gen, offset, size, pinned, attachment), made as tuple.__new__
 * makes an instance of a tuple subclass: allocated once its items exist (no allocation runs
 * between, so the collector never sees it half made), then filled */
static PyObject *hit_tuple(Index *ix, const hit_t *hit) {
    PyObject *items[SEALED_FIELDS] = {
        PyLong_FromSsize_t(hit->slot),
        PyLong_FromUnsignedLongLong(hit->rec.gen),
        PyLong_FromUnsignedLongLong(hit->rec.offset),
        PyLong_FromUnsignedLongLong(hit->rec.size),
        Py_NewRef(hit->pinned ? Py_True : Py_False),
        hit->has_attachment ? PyBytes_FromStringAndSize(hit->attachment, ATTACHMENT_SIZE) : Py_NewRef(Py_None),
    };
    PyObject *entry = NULL;
    if (items[0] != NULL && items[1] != NULL && items[2] != NULL && items[3] != NULL && items[5] != NULL) {
        entry = ix->sealed->tp_alloc(ix->sealed, SEALED_FIELDS);
    }
    for (int i = 0; i < SEALED_FIELDS; i++) {
        if (entry != NULL) {
            PyTuple_SET_ITEM(entry, i, items[i]);
        } else {
            Py_XDECREF(items[i]);
        }
    }
#if PY_VERSION_HEX >= 0x030E0000
    if (entry != NULL) {
        ((PyTupleObject *)entry)->ob_hash = -1; /* 3.14 caches a tuple's hash: "not computed yet" */
    }
#endif
    return entry;
}

static int check_needle(PyObject *needle, const char **bytes) {
    if (!PyBytes_Check(needle) || PyBytes_GET_SIZE(needle) != KEY_SIZE) {
        PyErr_SetString(PyExc_ValueError, "a needle is 48 bytes");
        return -1;
    }
    *bytes = PyBytes_AS_STRING(needle);
    return 0;
}

static int check_ready(Index *ix) {
    if (ix->base == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the Index was not initialised");
        return -1;
    }
    return 0;
}

/* check_ready, and `CacheClosed` if the namespace was destroyed under us (its objects are gone;
 * this mapping outlives them): checked on entry by every call that reads or enters the index,
 * never by leave (a section held is always given back). */
static int check_live(Index *ix) {
    if (check_ready(ix) < 0) {
        return -1;
    }
    if (__atomic_load_n((uint32_t *)(ix->base + H_READY), __ATOMIC_RELAXED) == DESTROYED) {
        PyErr_SetString(CacheClosed, "the namespace was destroyed");
        return -1;
    }
    return 0;
}

static int check_slot(Index *ix, Py_ssize_t slot) {
    if (check_ready(ix) < 0) {
        return -1;
    }
    if (slot < 0 || slot >= ix->slots) {
        PyErr_Format(PyExc_IndexError, "slot %zd out of range", slot);
        return -1;
    }
    return 0;
}

static int check_bound(Index *ix) {
    if (check_ready(ix) < 0) {
        return -1;
    }
    if (ix->row < 0) {
        PyErr_SetString(CacheClosed, "no client record is bound (detached)");
        return -1;
    }
    return 0;
}

/* One whole lookup transaction: the answer for one needle, or SLOW, or NULL on error. When
 * `counted`, a hit or a miss is counted (HITS_NODE, MISSES); SLOW is no answer, nothing is. */
static PyObject *lookup_one(Index *ix, const char *needle, uint32_t pins, int counted) {
    Py_ssize_t stripe = stripe_of(ix, needle);
    int entered = enter_stripe_fast(ix, stripe);
    if (entered <= 0) {
        return entered < 0 ? NULL : Py_NewRef(SLOW);
    }
    hit_t hit;
    /* the clock is read in the section (a wait for the stripe must not age the stamp), and the
     * row is checked again: another thread may have detached while this one waited */
    int found = ix->row < 0 ? (PyErr_SetString(CacheClosed, "this process detached from the namespace"), R_ERROR)
                            : hit_in(ix, stripe, needle, monotonic_now(), pins, &hit);
    /* every path below leaves cleanly: a step writes whole records only, and R_ERROR
     * (PinLimitReached) is raised before anything is written */
    if (leave_stripe(ix, stripe) < 0) {
        return NULL;
    }
    if (counted && (found == R_HIT || found == R_MISS)) {
        count(ix, found == R_HIT ? COUNTER_HITS_NODE : COUNTER_MISSES, 1);
    }
    switch (found) {
    case R_HIT:
        return hit_tuple(ix, &hit);
    case R_MISS:
        Py_RETURN_NONE;
    case R_DAMAGED:
        return Py_NewRef(SLOW);
    default:
        return NULL;
    }
}

/* Argument converters: each checks its own result, so no conversion runs with an error pending. */
static int usage_error(Py_ssize_t nargs, Py_ssize_t want, const char *usage) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s", usage);
        return -1;
    }
    return 0;
}

static int as_ssize(PyObject *o, Py_ssize_t *out) {
    *out = PyLong_AsSsize_t(o);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* Parse a stripe number argument and check it names a stripe of a ready index. */
static int as_stripe(Index *ix, PyObject *arg, Py_ssize_t *stripe) {
    if (check_ready(ix) < 0 || as_ssize(arg, stripe) < 0) {
        return -1;
    }
    if (*stripe < 0 || *stripe >= ix->stripes) {
        PyErr_Format(PyExc_IndexError, "stripe %zd out of range", *stripe);
        return -1;
    }
    return 0;
}

static int as_u64(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *out = v;
    return 0;
}

static int as_u32(PyObject *o, uint32_t *out) {
    unsigned long v = PyLong_AsUnsignedLong(o);
    if (v == (unsigned long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (v > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a count must fit in 32 bits");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

static int as_int(PyObject *o, int *out) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "an index must fit in 32 bits");
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int as_flag(PyObject *o, int *out) {
    *out = PyObject_IsTrue(o);
    return *out < 0 ? -1 : 0;
}

static int as_double(PyObject *o, double *out) {
    *out = PyFloat_AsDouble(o);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* (slot, gen, count) arguments of the pin calls */
static int pin_args(Index *ix, PyObject *const *args, Py_ssize_t nargs, const char *usage, Py_ssize_t *slot,
                    uint64_t *gen, uint32_t *n) {
    if (usage_error(nargs, 3, usage) < 0 || check_bound(ix) < 0 || as_ssize(args[0], slot) < 0 ||
        as_u64(args[1], gen) < 0 || as_u32(args[2], n) < 0) {
        return -1;
    }
    return check_slot(ix, *slot);
}

static PyObject *Index_lookup(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    const char *needle;
    uint32_t pins;
    int counted;
    if (usage_error(nargs, 3, "lookup(needle, pins, counted)") < 0 || check_needle(args[0], &needle) < 0 ||
        as_u32(args[1], &pins) < 0 || as_flag(args[2], &counted) < 0 || check_bound(ix) < 0 ||
        check_live(ix) < 0) {
        return NULL;
    }
    return lookup_one(ix, needle, pins, counted);
}

/* Give the pending exception the attribute `name` = `value` (what the caller must still undo or
 * redo), keeping the exception as it is; a failure to set it is dropped. */
static void tag_error(const char *name, PyObject *value) {
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc != NULL && value != NULL && PyObject_SetAttrString(exc, name, value) < 0) {
        PyErr_Clear();
    }
    PyErr_Restore(type, exc, tb);
}

static PyObject *Index_lookup_many(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "lookup_many(needles: list[bytes], pins, counted)");
        return NULL;
    }
    uint32_t pins;
    int counted;
    if (as_u32(args[1], &pins) < 0 || as_flag(args[2], &counted) < 0 || check_bound(ix) < 0 ||
        check_live(ix) < 0) {
        return NULL;
    }
    /* our own references: the caller's list may change while a wait releases the GIL */
    PyObject *needles = PyList_AsTuple(args[0]);
    if (needles == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(needles);
    for (Py_ssize_t i = 0; i < n; i++) { /* every needle is checked before any lookup */
        const char *needle;
        if (check_needle(PyTuple_GET_ITEM(needles, i), &needle) < 0) {
            Py_DECREF(needles);
            return NULL;
        }
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(needles);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *answer = lookup_one(ix, PyBytes_AS_STRING(PyTuple_GET_ITEM(needles, i)), pins, counted);
        if (answer == NULL) {
            /* the hits before this one stay pinned: the caller releases them (it gets them back
             * through the exception's `answers` attribute) */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyList_SetSlice(out, i, n, NULL);
            PyErr_Restore(type, value, tb);
            tag_error("answers", out);
            Py_DECREF(out);
            Py_DECREF(needles);
            return NULL;
        }
        PyList_SET_ITEM(out, i, answer);
    }
    Py_DECREF(needles);
    return out;
}

static PyObject *Index_hit_in(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    const char *needle;
    Py_ssize_t stripe;
    double now;
    uint32_t pins;
    if (usage_error(nargs, 4, "hit_in(stripe, needle, now, pins)") < 0 || check_bound(ix) < 0 ||
        as_stripe(ix, args[0], &stripe) < 0 || check_needle(args[1], &needle) < 0 || as_double(args[2], &now) < 0 ||
        as_u32(args[3], &pins) < 0) {
        return NULL;
    }
    hit_t hit;
    switch (hit_in(ix, stripe, needle, now, pins, &hit)) {
    case R_HIT:
        return hit_tuple(ix, &hit);
    case R_MISS:
        Py_RETURN_NONE;
    case R_DAMAGED:
        return PyLong_FromSsize_t(hit.slot);
    default:
        return NULL;
    }
}

/* seal's arguments: (slot, gen, pins, attachment) and, for seal_in, `now`; the slot checked
 * against the index and the attachment against its size. */
static int seal_args(Index *ix, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage,
                     Py_ssize_t *slot, uint64_t *gen, uint32_t *pins, const char **attachment) {
    if (usage_error(nargs, want, usage) < 0 || as_ssize(args[0], slot) < 0 || as_u64(args[1], gen) < 0 ||
        as_u32(args[2], pins) < 0 || check_slot(ix, *slot) < 0) {
        return -1;
    }
    *attachment = NULL;
    if (args[3] == Py_None) {
        return 0;
    }
    if (!PyBytes_Check(args[3]) || PyBytes_GET_SIZE(args[3]) != ATTACHMENT_SIZE) {
        PyErr_Format(PyExc_ValueError, "an attachment is %d bytes", ATTACHMENT_SIZE);
        return -1;
    }
    *attachment = PyBytes_AS_STRING(args[3]);
    return 0;
}

/* What seal_in found, as Python: the SealedEntry, None (fenced off), for a record that fails its
 * crc SLOW (`slow`) or its slot number, or NULL on error. */
static PyObject *seal_answer(Index *ix, int found, const hit_t *sealed, int slow) {
    switch (found) {
    case R_HIT:
        return hit_tuple(ix, sealed);
    case R_MISS:
        Py_RETURN_NONE;
    case R_DAMAGED:
        return slow ? Py_NewRef(SLOW) : PyLong_FromSsize_t(sealed->slot);
    default:
        return NULL;
    }
}

/* seal(slot, gen, pins, attachment, release): the whole seal transaction (seal_in in a natively
 * entered section); SLOW if the stripe needs its repair or the record is damaged. With `release`
 * (the caller held the reservation's semaphore and forgot it), the semaphore is given back
 * whatever happens, except when the answer is SLOW (the locked path gives it back): in the
 * section after the seal, so that no claim sees the entry SEALED with its semaphore still held
 * (it would evict it, then fail to take the slot). */
static PyObject *Index_seal(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    uint64_t gen;
    uint32_t pins;
    const char *attachment;
    int release;
    if (seal_args(ix, args, nargs, 5, "seal(slot, gen, pins, attachment, release)", &slot, &gen, &pins,
                  &attachment) < 0 ||
        as_flag(args[4], &release) < 0) {
        return NULL;
    }
    Py_ssize_t stripe = slot / ix->ways;
    int entered = check_live(ix) < 0 ? -1 : enter_stripe_fast(ix, stripe);
    if (entered <= 0) {
        if (entered < 0 && release) {
            sem_give(ix, slot);
        }
        return entered < 0 ? NULL : Py_NewRef(SLOW);
    }
    hit_t sealed;
    /* a process that detached meanwhile (row -1) owns nothing: fenced off, as a late write's seal is */
    int found = seal_in(ix, slot, gen, pins, attachment, monotonic_now(), &sealed);
    int given = release && found != R_DAMAGED ? sem_give(ix, slot) : 0;
    /* whole records only, and an error is raised before anything is written: left clean */
    if (leave_stripe(ix, stripe) < 0 || given < 0) {
        return NULL;
    }
    return seal_answer(ix, found, &sealed, 1);
}

static PyObject *Index_seal_in(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    uint64_t gen;
    uint32_t pins;
    const char *attachment;
    double now;
    if (seal_args(ix, args, nargs, 5, "seal_in(slot, gen, pins, attachment, now)", &slot, &gen, &pins,
                  &attachment) < 0 ||
        as_double(args[4], &now) < 0) {
        return NULL;
    }
    hit_t sealed;
    int found = seal_in(ix, slot, gen, pins, attachment, now, &sealed);
    return seal_answer(ix, found, &sealed, 0);
}

/* A claim as Python: (kind, slot, gen), kind a CLAIM_* code (reservations.py's Claim). */
static PyObject *claim_tuple(int what, Py_ssize_t slot, uint64_t gen) {
    return Py_BuildValue("(inK)", what, slot, (unsigned long long)gen);
}

static int claim_args(PyObject *const *args, const char **needle, uint8_t *modality, uint8_t *kind) {
    uint32_t m, k;
    if (check_needle(args[0], needle) < 0 || as_u32(args[1], &m) < 0 || as_u32(args[2], &k) < 0) {
        return -1;
    }
    if (m > 255 || k > 255) {
        PyErr_SetString(PyExc_ValueError, "a modality and a key kind are bytes");
        return -1;
    }
    *modality = (uint8_t)m;
    *kind = (uint8_t)k;
    return 0;
}

/* reserve(needle, modality, kind, pins): one get-or-reserve step for `needle` in one stripe
 * section: a SealedEntry pinned `pins` times (a hit), a claim (kind, slot, gen), or SLOW (a
 * stripe that needs its repair or a damaged record: the locked path does the same steps). */
static PyObject *Index_reserve(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    const char *needle;
    uint8_t modality, kind;
    uint32_t pins;
    if (usage_error(nargs, 4, "reserve(needle, modality, kind, pins)") < 0 ||
        claim_args(args, &needle, &modality, &kind) < 0 || as_u32(args[3], &pins) < 0 || check_bound(ix) < 0 ||
        check_live(ix) < 0) {
        return NULL;
    }
    Py_ssize_t stripe = stripe_of(ix, needle);
    int entered = enter_stripe_fast(ix, stripe);
    if (entered <= 0) {
        return entered < 0 ? NULL : Py_NewRef(SLOW);
    }
    hit_t hit;
    int what = CLAIM_FULL;
    Py_ssize_t slot = -1;
    uint64_t gen = 0;
    double now = monotonic_now();
    /* the row is checked again in the section: another thread may have detached meanwhile */
    int found = ix->row < 0 ? (PyErr_SetString(CacheClosed, "this process detached from the namespace"), R_ERROR)
                            : hit_in(ix, stripe, needle, now, pins, &hit);
    if (found == R_MISS) {
        found = claim_in(ix, stripe, needle, modality, kind, now, &what, &slot, &gen);
        found = found == R_HIT ? R_MISS : found; /* R_MISS from here on: a claim */
    }
    /* whole records only (an error may follow an expiry or an eviction): the section is left clean */
    int left = leave_stripe(ix, stripe);
    PyObject *claim = left == 0 && found == R_MISS ? claim_tuple(what, slot, gen) : NULL;
    if (claim == NULL && found == R_MISS && (what == CLAIM_OWNER || what == CLAIM_TAKEOVER)) {
        sem_give(ix, slot); /* a reservation Python will not hear of: its owner reads as dead */
    }
    if (left < 0) {
        return NULL;
    }
    switch (found) {
    case R_HIT:
        return hit_tuple(ix, &hit);
    case R_MISS:
        return claim;
    case R_DAMAGED:
        return Py_NewRef(SLOW);
    default:
        return NULL;
    }
}

/* claim_in(stripe, needle, modality, kind, now): the claim step after a miss, the stripe's
 * section held: (kind, slot, gen), or the slot whose record fails its crc (quarantine it). */
static PyObject *Index_claim_in(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t stripe;
    const char *needle;
    uint8_t modality, kind;
    double now;
    if (usage_error(nargs, 5, "claim_in(stripe, needle, modality, kind, now)") < 0 || check_bound(ix) < 0 ||
        as_stripe(ix, args[0], &stripe) < 0 || claim_args(args + 1, &needle, &modality, &kind) < 0 ||
        as_double(args[4], &now) < 0) {
        return NULL;
    }
    int what = CLAIM_FULL;
    Py_ssize_t slot = -1;
    uint64_t gen = 0;
    PyObject *claim;
    switch (claim_in(ix, stripe, needle, modality, kind, now, &what, &slot, &gen)) {
    case R_HIT:
        claim = claim_tuple(what, slot, gen);
        if (claim == NULL && (what == CLAIM_OWNER || what == CLAIM_TAKEOVER)) {
            sem_give(ix, slot); /* a reservation Python will not hear of: its owner reads as dead */
        }
        return claim;
    case R_DAMAGED:
        return PyLong_FromSsize_t(slot);
    default:
        return NULL;
    }
}

/* A one-slot step's answer (R_HIT, R_MISS, R_DAMAGED, R_ERROR) as Python: True, False, SLOW (a
 * damaged record: the caller quarantines it on the locked path) or NULL. */
static PyObject *slot_answer(int found) {
    switch (found) {
    case R_HIT:
        Py_RETURN_TRUE;
    case R_MISS:
        Py_RETURN_FALSE;
    case R_DAMAGED:
        return Py_NewRef(SLOW);
    default:
        return NULL;
    }
}

static int extent_args(Index *ix, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t *slot, uint64_t *gen,
                       uint64_t *offset, uint64_t *size, int *keep) {
    if (usage_error(nargs, 4, "extent(slot, gen, offset, size)") < 0 || as_ssize(args[0], slot) < 0 ||
        as_u64(args[1], gen) < 0 || (args[2] != Py_None && as_u64(args[2], offset) < 0) ||
        as_u64(args[3], size) < 0 || check_slot(ix, *slot) < 0) {
        return -1;
    }
    *keep = args[2] == Py_None;
    return 0;
}

/* extent(slot, gen, offset, size): our reservation's extent set (offset None: cut to `size`);
 * True, False (fenced off) or SLOW. extent_in: the same step, the stripe's section held. */
static PyObject *Index_extent(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    uint64_t gen, offset = 0, size;
    int keep;
    if (extent_args(ix, args, nargs, &slot, &gen, &offset, &size, &keep) < 0 || check_live(ix) < 0) {
        return NULL;
    }
    int entered = enter_stripe_fast(ix, slot / ix->ways);
    if (entered <= 0) {
        return entered < 0 ? NULL : Py_NewRef(SLOW);
    }
    int found = extent_in(ix, slot, gen, offset, size, keep);
    return leave_stripe(ix, slot / ix->ways) < 0 ? NULL : slot_answer(found);
}

static PyObject *Index_extent_in(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    uint64_t gen, offset = 0, size;
    int keep;
    if (extent_args(ix, args, nargs, &slot, &gen, &offset, &size, &keep) < 0) {
        return NULL;
    }
    return slot_answer(extent_in(ix, slot, gen, offset, size, keep));
}

/* evict(slot, now): the allocator's eviction of one candidate; True (freed), False or SLOW.
 * evict_in: the same step, the stripe's section held. */
static PyObject *evict_call(Index *ix, PyObject *const *args, Py_ssize_t nargs, int enter) {
    Py_ssize_t slot;
    double now;
    if (usage_error(nargs, 2, enter ? "evict(slot, now)" : "evict_in(slot, now)") < 0 ||
        as_ssize(args[0], &slot) < 0 || as_double(args[1], &now) < 0 || check_slot(ix, slot) < 0 ||
        (enter && check_live(ix) < 0)) {
        return NULL;
    }
    if (!enter) {
        return slot_answer(evict_in(ix, slot, now));
    }
    int entered = enter_stripe_fast(ix, slot / ix->ways);
    if (entered <= 0) {
        return entered < 0 ? NULL : Py_NewRef(SLOW);
    }
    int found = evict_in(ix, slot, now);
    return leave_stripe(ix, slot / ix->ways) < 0 ? NULL : slot_answer(found);
}

static PyObject *Index_evict(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    return evict_call(ix, args, nargs, 1);
}

static PyObject *Index_evict_in(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    return evict_call(ix, args, nargs, 0);
}

/* contains: lock-free (rule 4). True, False, or SLOW. */
static PyObject *contains_one(Index *ix, const char *needle, double now) {
    Py_ssize_t stripe = stripe_of(ix, needle);
    for (Py_ssize_t slot = stripe * ix->ways; slot < (stripe + 1) * ix->ways; slot++) {
        char key[KEY_SIZE], head[RECORD_SIZE + 4];
        memcpy(key, key_at(ix, slot), KEY_SIZE);
        if (memcmp(key, needle, KEY_SIZE) != 0) {
            continue;
        }
        memcpy(head, slot_at(ix, slot), sizeof head);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        uint32_t stored;
        memcpy(&stored, head + S_CRC, 4);
        if (stored != record_crc(head, key, ix->zero_crc)) {
            return Py_NewRef(SLOW); /* torn by a writer right now, or damaged: the lock decides */
        }
        record_t rec;
        memcpy(&rec, head, RECORD_SIZE);
        if (rec.state == SEALED && !expired(ix, slot, now)) {
            touch(ix, slot, now);
            Py_RETURN_TRUE;
        }
    }
    Py_RETURN_FALSE;
}

static PyObject *Index_contains(Index *ix, PyObject *needle) {
    const char *bytes;
    if (check_live(ix) < 0 || check_needle(needle, &bytes) < 0) {
        return NULL;
    }
    return contains_one(ix, bytes, monotonic_now());
}

static PyObject *Index_contains_many(Index *ix, PyObject *needles) {
    if (check_live(ix) < 0) {
        return NULL;
    }
    if (!PyList_Check(needles)) {
        PyErr_SetString(PyExc_TypeError, "contains_many(needles: list[bytes])");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(needles);
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *bytes;
        if (check_needle(PyList_GET_ITEM(needles, i), &bytes) < 0) {
            return NULL;
        }
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    double now = monotonic_now();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyList_SET_ITEM(out, i, contains_one(ix, PyBytes_AS_STRING(PyList_GET_ITEM(needles, i)), now));
    }
    return out;
}

/* One (slot, gen, count) item of `release`. */
static int release_item(Index *ix, PyObject *item, Py_ssize_t *slot, uint64_t *gen, uint32_t *n) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
        PyErr_SetString(PyExc_TypeError, "release(pins: list[tuple[int, int, int]])");
        return -1;
    }
    return pin_args(ix, &PyTuple_GET_ITEM(item, 0), 3, "", slot, gen, n);
}

/* release(pins: list[(slot, gen, count)]) sorted by slot: drops them stripe by stripe; returns
 * the entries it could not finish natively (their stripe needs a repair, or a record is
 * damaged), for the locked Python path. A stripe held past the lock timeout (a stopped process
 * inside it) holds back only its own items: the other stripes are released, then the first
 * LockTimeout is raised. If it raises (a lock timeout, a signal while it waits), the
 * exception's `unreleased` lists the items it did not drop, those returned so far included, so
 * the caller can drop them later, never one twice ([] once this process detached: its pins went
 * with its record). */
static PyObject *Index_release(Index *ix, PyObject *arg) {
    if (!PyList_Check(arg) || check_bound(ix) < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "release(pins: list[tuple[int, int, int]])");
        }
        return NULL;
    }
    PyObject *pins = PyList_AsTuple(arg); /* our references: a wait releases the GIL */
    PyObject *left = pins == NULL ? NULL : PyList_New(0), *stuck = left == NULL ? NULL : PyList_New(0);
    if (stuck == NULL) {
        Py_XDECREF(left);
        Py_XDECREF(pins);
        return NULL;
    }
    /* pins[i:], `left` and `stuck` (the items of stripes held past the lock timeout) are not dropped
     * yet; `timeout` is the first such stripe's LockTimeout, raised once the others are done */
    Py_ssize_t n = PyTuple_GET_SIZE(pins), slot, i = 0;
    PyObject *timeout = NULL, *timeout_tb = NULL, *timeout_type = NULL;
    uint64_t gen;
    uint32_t count_;
    int detached = 0;
    for (Py_ssize_t k = 0; k < n; k++) { /* every item is checked before anything is released */
        if (release_item(ix, PyTuple_GET_ITEM(pins, k), &slot, &gen, &count_) < 0) {
            goto error;
        }
    }
    while (i < n) {
        if (release_item(ix, PyTuple_GET_ITEM(pins, i), &slot, &gen, &count_) < 0) {
            detached = ix->row < 0; /* another thread detached while we waited on a stuck stripe */
            goto error;
        }
        Py_ssize_t stripe = slot / ix->ways, end = i + 1; /* this stripe's run: [i, end) */
        while (end < n && PyLong_AsSsize_t(PyTuple_GET_ITEM(PyTuple_GET_ITEM(pins, end), 0)) / ix->ways == stripe) {
            end++;
        }
        int entered = enter_stripe_fast(ix, stripe);
        if (entered < 0 && PyErr_ExceptionMatches(LockTimeout)) {
            if (timeout == NULL) {
                PyErr_Fetch(&timeout_type, &timeout, &timeout_tb);
            } else {
                PyErr_Clear();
            }
            for (; i < end; i++) {
                if (PyList_Append(stuck, PyTuple_GET_ITEM(pins, i)) < 0) {
                    goto error;
                }
            }
            continue;
        }
        if (entered < 0) {
            goto error;
        }
        if (entered && ix->row < 0) { /* detached while we waited: our pins went with the record */
            leave_stripe(ix, stripe);
            PyErr_SetString(CacheClosed, "this process detached from the namespace");
            detached = 1;
            goto error;
        }
        for (; i < end; i++) {
            PyObject *item = PyTuple_GET_ITEM(pins, i);
            release_item(ix, item, &slot, &gen, &count_);
            if ((!entered || unpin_in(ix, (int32_t)slot, gen, count_) == R_DAMAGED) && PyList_Append(left, item) < 0) {
                if (entered) {
                    leave_stripe(ix, stripe);
                }
                goto error;
            }
        }
        if (entered && leave_stripe(ix, stripe) < 0) {
            goto error;
        }
    }
    if (timeout == NULL) {
        Py_DECREF(stuck);
        Py_DECREF(pins);
        return left;
    }
    PyErr_Restore(timeout_type, timeout, timeout_tb); /* every other stripe is done */
    timeout_type = timeout = timeout_tb = NULL;
error:;
    Py_XDECREF(timeout_type); /* a later error (a signal while waiting) wins over a lock timeout */
    Py_XDECREF(timeout);
    Py_XDECREF(timeout_tb);
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *rest = PyTuple_GetSlice(pins, i, n), *unreleased = PyList_New(0);
    if (rest == NULL || unreleased == NULL ||
        (!detached && (PyList_SetSlice(unreleased, 0, 0, left) < 0 ||
                       PyList_SetSlice(unreleased, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, stuck) < 0 ||
                       PyList_SetSlice(unreleased, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, rest) < 0))) {
        PyErr_Clear(); /* no list: the caller cannot tell, and drops none again (a leak, never twice) */
        Py_CLEAR(unreleased);
    }
    PyErr_Restore(type, value, tb);
    tag_error("unreleased", unreleased);
    Py_XDECREF(unreleased);
    Py_XDECREF(rest);
    Py_DECREF(pins);
    Py_DECREF(left);
    Py_DECREF(stuck);
    return NULL;
}

static PyObject *Index_unpin_in(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    uint64_t gen;
    uint32_t n;
    if (pin_args(ix, args, nargs, "unpin_in(slot, gen, count)", &slot, &gen, &n) < 0) {
        return NULL;
    }
    return PyBool_FromLong(unpin_in(ix, (int32_t)slot, gen, n) != R_DAMAGED);
}

static int slot_now_args(Index *ix, PyObject *const *args, Py_ssize_t nargs, const char *usage, Py_ssize_t *slot,
                         double *now) {
    if (usage_error(nargs, 2, usage) < 0 || as_ssize(args[0], slot) < 0 || as_double(args[1], now) < 0) {
        return -1;
    }
    return check_slot(ix, *slot);
}

/* The repeat-hit check (rule 4): (slot, gen) is still sealed and unexpired; stamps the access,
 * and with `counted` counts a process hit (HITS_PROCESS). */
static PyObject *Index_repeat_hit(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    uint64_t gen;
    if (usage_error(nargs, 3, "repeat_hit(slot, gen, counted)") < 0 || as_ssize(args[0], &slot) < 0 ||
        as_u64(args[1], &gen) < 0 || check_slot(ix, slot) < 0 || check_live(ix) < 0) {
        return NULL;
    }
    int counted = PyObject_IsTrue(args[2]);
    if (counted < 0) {
        return NULL;
    }
    char *at = slot_at(ix, slot);
    uint32_t state = __atomic_load_n((uint32_t *)at, __ATOMIC_RELAXED);
    uint64_t current = __atomic_load_n((uint64_t *)(at + 8), __ATOMIC_RELAXED);
    double now = monotonic_now();
    if (state != SEALED || current != gen || expired(ix, slot, now)) {
        Py_RETURN_FALSE;
    }
    touch(ix, slot, now);
    if (counted) {
        count(ix, COUNTER_HITS_PROCESS, 1);
    }
    Py_RETURN_TRUE;
}

static PyObject *Index_touch(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    double now;
    if (slot_now_args(ix, args, nargs, "touch(slot, now)", &slot, &now) < 0) {
        return NULL;
    }
    touch(ix, slot, now);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------- the allocator's look (rule 7) */

#define RADIX_BITS 11
#define RADIX ((size_t)1 << RADIX_BITS)

/* Sorts `ext` by start (`tmp`: room for n more): a least-significant-digit radix sort, 11 bits a
 * pass, from the lowest bit any start has set to the highest (two passes for a 128 MiB arena of
 * 64-byte aligned extents): 22 us for the 4096 records of a full index, where qsort took 266 us,
 * and every put allocates under the node section, so it held all of the node's puts that long. */
static void sort_by_start(extent_t *ext, extent_t *tmp, Py_ssize_t n) {
    uint64_t any = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        any |= ext[i].start;
    }
    extent_t *from = ext, *to = tmp;
    for (int shift = any ? __builtin_ctzll(any) : 64; shift < 64 && (any >> shift) != 0; shift += RADIX_BITS) {
        size_t at[RADIX + 1] = {0};
        for (Py_ssize_t i = 0; i < n; i++) {
            at[((from[i].start >> shift) & (RADIX - 1)) + 1]++;
        }
        for (size_t b = 1; b <= RADIX; b++) {
            at[b] += at[b - 1];
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            to[at[(from[i].start >> shift) & (RADIX - 1)]++] = from[i];
        }
        extent_t *swap = from;
        from = to;
        to = swap;
    }
    if (from != ext) {
        memcpy(ext, from, sizeof *ext * (size_t)n);
    }
}

/* The lowest offset of `need` free bytes in [0, capacity) outside every extent, -1 if none. The
 * extents may overlap or be empty: each gap starts at the running maximum of the ends before it,
 * so no listed extent is ever handed out again (the order of equal starts does not matter).
 * Sorts `ext`, using `tmp` (room for n). */
static int64_t first_fit(extent_t *ext, extent_t *tmp, Py_ssize_t n, uint64_t need, uint64_t capacity) {
    sort_by_start(ext, tmp, n);
    uint64_t from = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ext[i].start >= from && ext[i].start - from >= need) {
            return (int64_t)from;
        }
        if (ext[i].end > from) {
            from = ext[i].end;
        }
    }
    return from <= capacity && capacity - from >= need ? (int64_t)from : -1;
}

static PyObject *fit_answer(int64_t offset) {
    return offset < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(offset);
}

/* first_fit(extents, need, capacity): the allocation rule over (start, end) pairs (for its tests). */
static PyObject *native_first_fit(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    uint64_t need, capacity;
    if (usage_error(nargs, 3, "first_fit(extents, need, capacity)") < 0 || as_u64(args[1], &need) < 0 ||
        as_u64(args[2], &capacity) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "extents must be a sequence of (start, end)");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    extent_t *ext = PyMem_Calloc(2 * (size_t)n + 1, sizeof *ext); /* the extents, then room to sort */
    if (ext == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || as_u64(PyTuple_GET_ITEM(pair, 0), &ext[i].start) < 0 ||
            as_u64(PyTuple_GET_ITEM(pair, 1), &ext[i].end) < 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_TypeError, "extents must be (start, end) tuples of ints");
            }
            PyMem_Free(ext);
            Py_DECREF(seq);
            return NULL;
        }
    }
    int64_t offset = first_fit(ext, ext + n, n, need, capacity);
    PyMem_Free(ext);
    Py_DECREF(seq);
    return fit_answer(offset);
}

/* One lock-free copy of a record's fields (rule 7): no crc check, a torn copy is allowed. */
static void look_at(Index *ix, Py_ssize_t slot, record_t *out) { memcpy(out, slot_at(ix, slot), RECORD_SIZE); }

static PyObject *Index_gap(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t need, capacity;
    if (usage_error(nargs, 2, "gap(need, capacity)") < 0 || check_ready(ix) < 0 || as_u64(args[0], &need) < 0 ||
        as_u64(args[1], &capacity) < 0) {
        return NULL;
    }
    extent_t *ext = ix->extents; /* the extents, then room to sort */
    Py_ssize_t n = 0;
    for (Py_ssize_t slot = 0; slot < ix->slots; slot++) {
        record_t r;
        look_at(ix, slot, &r);
        /* an extent outside the arena is a damaged record (its stripe's repair quarantines it):
         * its bytes name no memory */
        if (r.state != EMPTY && r.size > 0 && r.size <= capacity && r.offset <= capacity - r.size) {
            ext[n].start = r.offset;
            ext[n].end = r.offset + r.size;
            n++;
        }
    }
    return fit_answer(first_fit(ext, ext + ix->slots, n, need, capacity));
}

static int append_slot(PyObject *list, Py_ssize_t slot) {
    PyObject *item = PyLong_FromSsize_t(slot);
    int rc = item == NULL ? -1 : PyList_Append(list, item);
    Py_XDECREF(item);
    return rc;
}


static int by_rank(const void *a, const void *b) {
    const candidate_t *x = a, *y = b;
    if (x->rank != y->rank) {
        return x->rank < y->rank ? -1 : 1;
    }
    return x->slot < y->slot ? -1 : x->slot > y->slot;
}

/* Order the best `limit` of `n` candidates first (by_rank), when `limit` is small: an insertion
 * into the sorted best-so-far, O(n) when the candidates are in no particular order. */
static void select_best(candidate_t *c, Py_ssize_t n, Py_ssize_t limit) {
    for (Py_ssize_t i = 1; i < n; i++) {
        Py_ssize_t kept = i < limit ? i : limit; /* c[0, kept) are the best of c[0, i), in order */
        if (kept == limit && by_rank(&c[i], &c[limit - 1]) >= 0) {
            continue;
        }
        candidate_t item = c[i];
        Py_ssize_t at = kept == limit ? limit - 1 : kept; /* the slot it may take */
        for (; at > 0 && by_rank(&item, &c[at - 1]) < 0; at--) {
            c[at] = c[at - 1];
        }
        c[at] = item;
    }
}

#define SELECT_MAX 64 /* larger limits sort every candidate */

/* evictable(now, limit): (RESERVED slots with an extent, the best `limit` unreferenced SEALED
 * slots in eviction order, whether those are all of them). Read lock-free (rule 7). */
static PyObject *Index_evictable(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    double now;
    Py_ssize_t limit;
    if (usage_error(nargs, 2, "evictable(now, limit)") < 0 || as_double(args[0], &now) < 0 ||
        as_ssize(args[1], &limit) < 0 || check_ready(ix) < 0) {
        return NULL;
    }
    if (limit < 1) {
        PyErr_SetString(PyExc_ValueError, "evictable: limit must be at least 1");
        return NULL;
    }
    candidate_t *sealed = ix->candidates;
    PyObject *reserved = PyList_New(0);
    if (reserved == NULL) {
        return NULL;
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t slot = 0; slot < ix->slots; slot++) {
        record_t r;
        look_at(ix, slot, &r);
        if (r.size == 0) {
            continue;
        }
        if (r.state == SEALED && r.refs == 0) {
            double rank = expired(ix, slot, now) ? -1.0 : last_access(ix, slot);
            sealed[n].rank = isnan(rank) ? INFINITY : rank; /* a damaged stamp sorts last: sorting needs an order */
            sealed[n].slot = slot;
            n++;
        } else if (r.state == RESERVED && append_slot(reserved, slot) < 0) {
            Py_DECREF(reserved);
            return NULL;
        }
    }
    if (n > limit && limit <= SELECT_MAX) {
        select_best(sealed, n, limit);
    } else {
        qsort(sealed, (size_t)n, sizeof *sealed, by_rank);
    }
    Py_ssize_t count = n < limit ? n : limit;
    PyObject *order = PyList_New(count);
    for (Py_ssize_t i = 0; order != NULL && i < count; i++) {
        PyObject *item = PyLong_FromSsize_t(sealed[i].slot);
        if (item == NULL) {
            Py_CLEAR(order);
            break;
        }
        PyList_SET_ITEM(order, i, item);
    }
    if (order == NULL) {
        Py_DECREF(reserved);
        return NULL;
    }
    PyObject *out = Py_BuildValue("(NNO)", reserved, order, n <= limit ? Py_True : Py_False);
    return out;
}

/* ----------------------------------------------------------------- primitives for Python */
/* The lock index and held marker offset of enter/leave: 0, or -1 with an exception set. */
static int section_args(Index *ix, PyObject *const *args, int *lock, Py_ssize_t *held_off) {
    if (check_ready(ix) < 0 || as_int(args[0], lock) < 0 || as_ssize(args[1], held_off) < 0) {
        return -1;
    }
    if (*lock < 0 || *lock > ix->stripes) {
        PyErr_SetString(PyExc_IndexError, "no such lock");
        return -1;
    }
    if (*held_off < 0 || *held_off + 4 > ix->length) {
        PyErr_SetString(PyExc_IndexError, "held marker out of range");
        return -1;
    }
    return 0;
}

static PyObject *Index_enter(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    int lock;
    Py_ssize_t held_off;
    const char *what;
    if (usage_error(nargs, 3, "enter(lock, held_off, what)") < 0 || section_args(ix, args, &lock, &held_off) < 0 ||
        check_live(ix) < 0 || (what = PyUnicode_AsUTF8(args[2])) == NULL) {
        return NULL;
    }
    int died = enter(ix, lock, held_off, what);
    return died < 0 ? NULL : PyBool_FromLong(died);
}

static PyObject *Index_leave(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    int lock, clean;
    Py_ssize_t held_off;
    if (usage_error(nargs, 3, "leave(lock, held_off, clean)") < 0 || section_args(ix, args, &lock, &held_off) < 0 ||
        (clean = PyObject_IsTrue(args[2])) < 0) {
        return NULL;
    }
    if (leave(ix, lock, held_off, clean) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Index_read_record(Index *ix, PyObject *arg) {
    Py_ssize_t slot;
    if (as_ssize(arg, &slot) < 0 || check_slot(ix, slot) < 0) {
        return NULL;
    }
    record_t r;
    int valid = read_record(ix, slot, &r);
    return Py_BuildValue("(IiKKKdIO)", r.state, r.owner, (unsigned long long)r.gen, (unsigned long long)r.offset,
                         (unsigned long long)r.size, r.sealed_at, r.refs, valid ? Py_True : Py_False);
}

static PyObject *Index_write_record(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    record_t r;
    Py_ssize_t slot;
    int owner;
    const char *needle = NULL;
    if (usage_error(nargs, 9, "write_record(slot, state, owner, gen, offset, size, sealed_at, refs, needle)") < 0 ||
        as_ssize(args[0], &slot) < 0 || as_u32(args[1], &r.state) < 0 || as_int(args[2], &owner) < 0 ||
        as_u64(args[3], &r.gen) < 0 || as_u64(args[4], &r.offset) < 0 || as_u64(args[5], &r.size) < 0 ||
        as_double(args[6], &r.sealed_at) < 0 || as_u32(args[7], &r.refs) < 0 ||
        (args[8] != Py_None && check_needle(args[8], &needle) < 0) || check_slot(ix, slot) < 0) {
        return NULL;
    }
    r.owner = owner;
    if (needle != NULL) {
        /* naming the slot for a new key: the key, then the record whose crc covers it, back to
         * back (a writer killed between the two leaves a pair that fails its crc) */
        memcpy(key_at(ix, slot), needle, KEY_SIZE);
    }
    write_record(ix, slot, &r);
    Py_RETURN_NONE;
}

static PyObject *Index_bind(Index *ix, PyObject *arg) {
    int row;
    if (check_ready(ix) < 0 || as_int(arg, &row) < 0) {
        return NULL;
    }
    if (row < -1 || row >= ix->clients) {
        PyErr_Format(PyExc_IndexError, "client row %d out of range", row);
        return NULL;
    }
    ix->row = (int)row;
    for (Py_ssize_t b = 0; b <= ix->table_mask; b++) {
        ix->table[b].index = -1;
    }
    ix->free_top = 0;
    for (Py_ssize_t i = ix->pins - 1; i >= 0; i--) {
        ix->free_pins[ix->free_top++] = (int32_t)i;
    }
    Py_RETURN_NONE;
}

static PyObject *Index_pin_add(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    uint64_t gen;
    uint32_t n;
    if (pin_args(ix, args, nargs, "pin_add(slot, gen, count)", &slot, &gen, &n) < 0 ||
        pin_add(ix, (int32_t)slot, gen, n) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Index_pin_remove(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    uint64_t gen;
    uint32_t n;
    if (pin_args(ix, args, nargs, "pin_remove(slot, gen, count)", &slot, &gen, &n) < 0) {
        return NULL;
    }
    return PyLong_FromUnsignedLong(pin_remove(ix, (int32_t)slot, gen, n));
}

static PyObject *Index_pins_held(Index *ix, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyDict_New();
    if (out == NULL || ix->base == NULL || ix->row < 0) {
        return out;
    }
    for (Py_ssize_t b = 0; b <= ix->table_mask; b++) {
        if (ix->table[b].index < 0) {
            continue;
        }
        PyObject *entry = Py_BuildValue("(iK)", ix->table[b].slot, (unsigned long long)ix->table[b].gen);
        PyObject *n = entry ? PyLong_FromUnsignedLong(pin_at(ix, ix->table[b].index)->count) : NULL;
        if (n == NULL || PyDict_SetItem(out, entry, n) < 0) {
            Py_XDECREF(entry);
            Py_XDECREF(n);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(entry);
        Py_DECREF(n);
    }
    return out;
}

static PyObject *Index_pins_spare(Index *ix, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSsize_t(ix->free_top);
}

/* The retire sequence (point 8). */
static uint64_t *retire_sequence(Index *ix) { return (uint64_t *)(ix->base + H_RETIRE_SEQ); }

static PyObject *Index_retire_begin(Index *ix, PyObject *Py_UNUSED(ignored)) {
    if (check_ready(ix) < 0) {
        return NULL;
    }
    uint64_t seq = __atomic_load_n(retire_sequence(ix), __ATOMIC_RELAXED);
    if ((seq & 1) == 0) { /* odd already: a retire that died inside, being redone */
        __atomic_store_n(retire_sequence(ix), seq + 1, __ATOMIC_RELAXED);
    }
    __atomic_thread_fence(__ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *Index_retire_end(Index *ix, PyObject *Py_UNUSED(ignored)) {
    if (check_ready(ix) < 0) {
        return NULL;
    }
    uint64_t seq = __atomic_load_n(retire_sequence(ix), __ATOMIC_RELAXED);
    if (seq & 1) {
        __atomic_store_n(retire_sequence(ix), seq + 1, __ATOMIC_RELEASE);
    }
    Py_RETURN_NONE;
}

static PyObject *Index_retire_seq(Index *ix, PyObject *again) {
    if (check_ready(ix) < 0) {
        return NULL;
    }
    int after_reads = PyObject_IsTrue(again);
    if (after_reads < 0) {
        return NULL;
    }
    if (after_reads) {
        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the sum's loads come before this one */
        return PyLong_FromUnsignedLongLong(__atomic_load_n(retire_sequence(ix), __ATOMIC_RELAXED));
    }
    return PyLong_FromUnsignedLongLong(__atomic_load_n(retire_sequence(ix), __ATOMIC_ACQUIRE));
}

static PyObject *Index_count(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    int counter;
    uint64_t n;
    if (usage_error(nargs, 2, "count(counter, n)") < 0 || check_ready(ix) < 0 || as_int(args[0], &counter) < 0 ||
        as_u64(args[1], &n) < 0) {
        return NULL;
    }
    if (counter < 0 || C_COUNTERS + 8 * counter + 8 > CLIENT_HEAD_SIZE) {
        PyErr_Format(PyExc_IndexError, "counter %d out of range", counter);
        return NULL;
    }
    count(ix, counter, n);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------- type plumbing */
/* `sealed` must be a NamedTuple class of SEALED_FIELDS fields and nothing else (hit_tuple fills it) */
static int check_sealed_type(PyObject *sealed) {
    if (!PyType_Check(sealed) || !PyType_IsSubtype((PyTypeObject *)sealed, &PyTuple_Type) ||
        ((PyTypeObject *)sealed)->tp_basicsize != PyTuple_Type.tp_basicsize) {
        PyErr_SetString(PyExc_TypeError, "sealed must be a tuple subclass without fields of its own");
        return -1;
    }
    PyObject *fields = PyObject_GetAttrString(sealed, "_fields");
    if (fields == NULL) {
        return -1;
    }
    Py_ssize_t n = PyTuple_Check(fields) ? PyTuple_GET_SIZE(fields) : -1;
    Py_DECREF(fields);
    if (n != SEALED_FIELDS) {
        PyErr_Format(PyExc_TypeError, "sealed must have %d fields (slot, gen, offset, size, pinned, attachment)",
                     SEALED_FIELDS);
        return -1;
    }
    return 0;
}
static int Index_init(Index *ix, PyObject *args, PyObject *kwds) {
    static char *names[] = {"buffer", "locks_off", "stripes", "ways", "clients", "pins", "stripes_off",
                            "slots_off", "keys_off", "attachments_off", "clients_off", "client_size",
                            "ttl", "lock_timeout", "sealed", "semid", NULL};
    PyObject *buffer, *sealed;
    if (ix->base != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "an Index is initialised once");
        return -1;
    }
    ix->semid = -1; /* none: a read-only look (ops/snapshot.py) makes no claims */
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnnnnnnnnnnnddO|i", names, &buffer, &ix->locks_off, &ix->stripes,
                                     &ix->ways, &ix->clients, &ix->pins, &ix->stripes_off, &ix->slots_off,
                                     &ix->keys_off, &ix->attachments_off, &ix->clients_off, &ix->client_size,
                                     &ix->ttl, &ix->lock_timeout, &sealed, &ix->semid)) {
        return -1;
    }
    if (check_sealed_type(sealed) < 0) {
        return -1;
    }
    if (ix->stripes <= 0 || ix->ways <= 0 || ix->clients <= 0 || ix->pins <= 0 || ix->pins > INT32_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "stripes, ways, clients and pins must be positive");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &ix->buffer, PyBUF_WRITABLE) < 0) {
        return -1;
    }
    ix->slots = ix->stripes * ix->ways;
    Py_ssize_t len = ix->buffer.len;
    int fits = ix->locks_off >= 0 && ix->locks_off + LOCK_SIZE * (1 + ix->stripes) <= len &&
               ix->stripes_off + STRIPE_SIZE * ix->stripes <= len && ix->slots_off + SLOT_SIZE * ix->slots <= len &&
               ix->keys_off + KEY_SIZE * ix->slots <= len &&
               ix->attachments_off + ATTACHMENT_SIZE * ix->slots <= len &&
               ix->clients_off + ix->client_size * ix->clients <= len &&
               ix->client_size >= CLIENT_HEAD_SIZE + PIN_SIZE * ix->pins && ix->stripes_off >= 0 &&
               ix->slots_off >= 0 && ix->keys_off >= 0 && ix->attachments_off >= 0 && ix->clients_off >= 0;
    if (!fits) {
        PyBuffer_Release(&ix->buffer);
        PyErr_SetString(PyExc_ValueError, "the buffer is smaller than the layout");
        return -1;
    }
    Py_ssize_t buckets = 1;
    while (buckets < 2 * ix->pins) {
        buckets <<= 1;
    }
    ix->table = PyMem_Calloc((size_t)buckets, sizeof(bucket_t));
    ix->free_pins = PyMem_Calloc((size_t)ix->pins, sizeof(int32_t));
    ix->extents = PyMem_Calloc(2 * (size_t)ix->slots, sizeof(extent_t));
    ix->candidates = PyMem_Calloc((size_t)ix->slots, sizeof(candidate_t));
    if (ix->table == NULL || ix->free_pins == NULL || ix->extents == NULL || ix->candidates == NULL) {
        PyBuffer_Release(&ix->buffer);
        PyMem_Free(ix->table);
        PyMem_Free(ix->free_pins);
        PyMem_Free(ix->extents);
        PyMem_Free(ix->candidates);
        ix->table = NULL;
        ix->free_pins = NULL;
        ix->extents = NULL;
        ix->candidates = NULL;
        PyErr_NoMemory();
        return -1;
    }
    ix->table_mask = buckets - 1;
    for (Py_ssize_t b = 0; b < buckets; b++) {
        ix->table[b].index = -1;
    }
    ix->base = ix->buffer.buf;
    ix->length = ix->buffer.len;
    char zeros[KEY_SIZE] = {0};
    ix->zero_crc = (uint32_t)crc32(crc32(0L, (const Bytef *)zeros, RECORD_SIZE), (const Bytef *)zeros, KEY_SIZE);
    ix->row = -1;
    ix->pid = getpid();
    ix->sealed = (PyTypeObject *)Py_NewRef(sealed);
    return 0;
}

static void Index_dealloc(Index *ix) {
    if (ix->base != NULL) {
        PyBuffer_Release(&ix->buffer);
    }
    PyMem_Free(ix->table);
    PyMem_Free(ix->free_pins);
    PyMem_Free(ix->extents);
    PyMem_Free(ix->candidates);
    Py_XDECREF(ix->sealed);
    Py_TYPE(ix)->tp_free((PyObject *)ix);
}

static PyMethodDef Index_methods[] = {
    {"lookup", (PyCFunction)(void (*)(void))Index_lookup, METH_FASTCALL,
     "lookup(needle, pins, counted): find and pin a sealed entry, one stripe section: a SealedEntry, None "
     "on a miss, SLOW when the stripe needs a repair or a record is damaged; `counted`: count the hit or miss."},
    {"lookup_many", (PyCFunction)(void (*)(void))Index_lookup_many, METH_FASTCALL,
     "lookup_many(needles, pins, counted): `lookup` of each needle, in order (one section per needle)."},
    {"reserve", (PyCFunction)(void (*)(void))Index_reserve, METH_FASTCALL,
     "reserve(needle, modality, kind, pins): a pinned SealedEntry, a claim (kind, slot, gen) made in the "
     "same stripe section, or SLOW (take the locked path)."},
    {"claim_in", (PyCFunction)(void (*)(void))Index_claim_in, METH_FASTCALL,
     "claim_in(stripe, needle, modality, kind, now): the claim after a miss, the stripe's section held: "
     "(kind, slot, gen), or the slot whose record fails its crc (quarantine it, then claim again)."},
    {"extent", (PyCFunction)(void (*)(void))Index_extent, METH_FASTCALL,
     "extent(slot, gen, offset, size): our reservation's extent set (offset None: cut to its first `size` "
     "bytes), in its stripe's section: True, False (fenced off) or SLOW (take the locked path)."},
    {"extent_in", (PyCFunction)(void (*)(void))Index_extent_in, METH_FASTCALL,
     "extent_in(slot, gen, offset, size): extent's step, the stripe's section held: True, False or SLOW "
     "(the record fails its crc: quarantine it)."},
    {"evict", (PyCFunction)(void (*)(void))Index_evict, METH_FASTCALL,
     "evict(slot, now): free an unreferenced sealed entry (counted) or a dead owner's reservation, in its "
     "stripe's section: True (freed), False (not evictable now) or SLOW (take the locked path)."},
    {"evict_in", (PyCFunction)(void (*)(void))Index_evict_in, METH_FASTCALL,
     "evict_in(slot, now): evict's step, the stripe's section held: True, False or SLOW (quarantine it)."},
    {"seal", (PyCFunction)(void (*)(void))Index_seal, METH_FASTCALL,
     "seal(slot, gen, pins, attachment, release): the fenced seal of our reservation, in its stripe's "
     "section (with `release`, its semaphore given back there, whatever happens, unless SLOW): a "
     "SealedEntry (pinned False: out of pin records), None (fenced off), or SLOW (take the locked path)."},
    {"seal_in", (PyCFunction)(void (*)(void))Index_seal_in, METH_FASTCALL,
     "seal_in(slot, gen, pins, attachment, now): seal's step, its stripe's section held: a SealedEntry, "
     "None, or the slot (its record fails its crc: quarantine it)."},
    {"hit_in", (PyCFunction)(void (*)(void))Index_hit_in, METH_FASTCALL,
     "hit_in(stripe, needle, now, pins): the lookup step inside a stripe section the caller holds; "
     "an int is the slot of a damaged record (quarantine it and call again)."},
    {"contains", (PyCFunction)Index_contains, METH_O,
     "contains(needle): lock-free existence check: True, False or SLOW."},
    {"contains_many", (PyCFunction)Index_contains_many, METH_O, "contains_many(needles): `contains` of each."},
    {"release", (PyCFunction)Index_release, METH_O,
     "release(pins): drop (slot, gen, count) pins sorted by slot; returns those left for the locked path."},
    {"unpin_in", (PyCFunction)(void (*)(void))Index_unpin_in, METH_FASTCALL,
     "unpin_in(slot, gen, count): drop pins inside the stripe section; False if the record is damaged."},
    {"repeat_hit", (PyCFunction)(void (*)(void))Index_repeat_hit, METH_FASTCALL,
     "repeat_hit(slot, gen, counted): lock-free: still sealed, same gen, unexpired (then the access "
     "is stamped and, if counted, a process hit counted)."},
    {"touch", (PyCFunction)(void (*)(void))Index_touch, METH_FASTCALL,
     "touch(slot, now): stamp an access (LRU, TTL): one aligned 8-byte store."},
    {"enter", (PyCFunction)(void (*)(void))Index_enter, METH_FASTCALL,
     "enter(lock, held_off, what): take a section; True if its last holder died inside."},
    {"leave", (PyCFunction)(void (*)(void))Index_leave, METH_FASTCALL,
     "leave(lock, held_off, clean): clear the held marker if clean, give the lock back."},
    {"read_record", (PyCFunction)Index_read_record, METH_O,
     "read_record(slot): (state, owner, gen, offset, size, sealed_at, refs, crc_ok)."},
    {"write_record", (PyCFunction)(void (*)(void))Index_write_record, METH_FASTCALL,
     "write_record(slot, state, owner, gen, offset, size, sealed_at, refs, needle): record and crc in one copy "
     "(after the slot's key, when `needle` is not None)."},
    {"bind", (PyCFunction)Index_bind, METH_O, "bind(row): this process's (zeroed) client record; -1 unbinds."},
    {"pin_add", (PyCFunction)(void (*)(void))Index_pin_add, METH_FASTCALL, "pin_add(slot, gen, count)."},
    {"pin_remove", (PyCFunction)(void (*)(void))Index_pin_remove, METH_FASTCALL,
     "pin_remove(slot, gen, count): how many were held."},
    {"pins_held", (PyCFunction)Index_pins_held, METH_NOARGS, "pins_held(): {(slot, gen): count}."},
    {"pins_spare", (PyCFunction)Index_pins_spare, METH_NOARGS, "pins_spare(): free pin records."},
    {"count", (PyCFunction)(void (*)(void))Index_count, METH_FASTCALL, "count(counter, n): add to our counter."},
    {"retire_begin", (PyCFunction)Index_retire_begin, METH_NOARGS,
     "retire_begin(): make the retire sequence odd (node section held; point 8)."},
    {"retire_end", (PyCFunction)Index_retire_end, METH_NOARGS,
     "retire_end(): make an odd retire sequence even (node section held; point 8)."},
    {"retire_seq", (PyCFunction)Index_retire_seq, METH_O,
     "retire_seq(again): the retire sequence; `again`: read after the reads it guards (point 8)."},
    {"gap", (PyCFunction)(void (*)(void))Index_gap, METH_FASTCALL,
     "gap(need, capacity): the lowest offset of `need` free bytes (node section held; rule 7), None if none."},
    {"evictable", (PyCFunction)(void (*)(void))Index_evictable, METH_FASTCALL,
     "evictable(now, limit): (RESERVED slots with an extent, the best `limit` unreferenced SEALED slots: "
     "expired first, then least recently used; whether that is all of them), read lock-free (rule 7)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmcache.node._native.Index",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One process's native handle on a mapped index (see native.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Index_init,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
};

static PyObject *native_arm(PyObject *Py_UNUSED(module), PyObject *arg) {
    if (arg == Py_None) {
        armed_point = POINT_NONE;
        Py_RETURN_NONE;
    }
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) {
        return NULL;
    }
    armed_point = strcmp(name, "in-stripe-section") == 0  ? POINT_IN_STRIPE_SECTION
                  : strcmp(name, "slot-record-torn") == 0 ? POINT_SLOT_RECORD_TORN
                  : strcmp(name, "holding-pins") == 0     ? POINT_HOLDING_PINS
                                                          : POINT_NONE;
    Py_RETURN_NONE;
}

static PyObject *native_init_locks(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t offset, count;
    if (usage_error(nargs, 3, "init_locks(buffer, offset, count)") < 0 || as_ssize(args[1], &offset) < 0 ||
        as_ssize(args[2], &count) < 0) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    int rc = 0;
    if (offset < 0 || count < 0 || offset % 64 != 0 || count > (view.len - offset) / LOCK_SIZE) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "the lock table does not fit the buffer");
        return NULL;
    }
    pthread_mutexattr_t attr;
    if ((rc = pthread_mutexattr_init(&attr)) == 0) {
        if ((rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED)) == 0 &&
            (rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST)) == 0) {
            for (Py_ssize_t i = 0; i < count && rc == 0; i++) {
                char *cell = (char *)view.buf + offset + LOCK_SIZE * i;
                memset(cell, 0, LOCK_SIZE);
                rc = pthread_mutex_init((pthread_mutex_t *)cell, &attr);
            }
        }
        pthread_mutexattr_destroy(&attr);
    }
    PyBuffer_Release(&view);
    if (rc != 0) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef native_methods[] = {
    {"init_locks", (PyCFunction)(void (*)(void))native_init_locks, METH_FASTCALL,
     "init_locks(buffer, offset, count): make `count` process-shared robust mutexes at `offset` (creation only)."},
    {"arm", (PyCFunction)native_arm, METH_O,
     "arm(point value or None): SIGKILL this process at that crash point if the native code reaches it."},
    {"first_fit", (PyCFunction)(void (*)(void))native_first_fit, METH_FASTCALL,
     "first_fit(extents, need, capacity): the allocation rule over (start, end) pairs; None if no gap."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "shmcache.node._native", "The node layer's hot transactions (see native.c).", -1,
    native_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&IndexType) < 0 || PyType_Ready(&SlowType) < 0) {
        return NULL;
    }
    PyObject *errors = PyImport_ImportModule("shmcache.errors");
    if (errors == NULL) {
        return NULL;
    }
    LockTimeout = PyObject_GetAttrString(errors, "LockTimeout");
    CacheClosed = PyObject_GetAttrString(errors, "CacheClosed");
    PinLimitReached = PyObject_GetAttrString(errors, "PinLimitReached");
    Py_DECREF(errors);
    if (LockTimeout == NULL || CacheClosed == NULL || PinLimitReached == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL) {
        return NULL;
    }
    SLOW = PyObject_New(PyObject, &SlowType);
    if (SLOW == NULL || PyModule_AddObjectRef(m, "SLOW", SLOW) < 0 ||
        PyModule_AddObjectRef(m, "Slow", (PyObject *)&SlowType) < 0 ||
        PyModule_AddObjectRef(m, "Index", (PyObject *)&IndexType) < 0 ||
        PyModule_AddIntConstant(m, "SLOT_SIZE", SLOT_SIZE) < 0 || PyModule_AddIntConstant(m, "S_CRC", S_CRC) < 0 ||
        PyModule_AddIntConstant(m, "S_LAST_ACCESS", S_LAST_ACCESS) < 0 ||
        PyModule_AddIntConstant(m, "KEY_SIZE", KEY_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "STRIPE_SIZE", STRIPE_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "LOCK_SIZE", LOCK_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "H_READY", H_READY) < 0 || PyModule_AddIntConstant(m, "DESTROYED", DESTROYED) < 0 ||
        PyModule_AddIntConstant(m, "H_RETIRE_SEQ", H_RETIRE_SEQ) < 0 ||
        PyModule_AddIntConstant(m, "CLIENT_HEAD_SIZE", CLIENT_HEAD_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "C_COUNTERS", C_COUNTERS) < 0 ||
        PyModule_AddIntConstant(m, "PIN_SIZE", PIN_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "ATTACHMENT_SIZE", ATTACHMENT_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "COUNTER_HITS_PROCESS", COUNTER_HITS_PROCESS) < 0 ||
        PyModule_AddIntConstant(m, "COUNTER_HITS_NODE", COUNTER_HITS_NODE) < 0 ||
        PyModule_AddIntConstant(m, "COUNTER_MISSES", COUNTER_MISSES) < 0 ||
        PyModule_AddIntConstant(m, "COUNTER_EVICTIONS_TTL", COUNTER_EVICTIONS_TTL) < 0 ||
        PyModule_AddIntConstant(m, "COUNTER_EVICTIONS_LRU", COUNTER_EVICTIONS_LRU) < 0 ||
        PyModule_AddIntConstant(m, "COUNTER_TAKEOVERS", COUNTER_TAKEOVERS) < 0 ||
        PyModule_AddIntConstant(m, "S_META", S_META) < 0 || PyModule_AddIntConstant(m, "CLAIM_OWNER", CLAIM_OWNER) < 0 ||
        PyModule_AddIntConstant(m, "CLAIM_TAKEOVER", CLAIM_TAKEOVER) < 0 ||
        PyModule_AddIntConstant(m, "CLAIM_WAIT", CLAIM_WAIT) < 0 || PyModule_AddIntConstant(m, "CLAIM_FULL", CLAIM_FULL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
