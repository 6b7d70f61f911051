/* fastkv.native._atomics: atomics, fences and the SPSC ring fast path on shared memory.
 *
 * Why C: Python has no atomic loads/stores or fences, and ctypes.CDLL drops and
 * re-takes the GIL on every call (a receiver thread beside a busy compute thread then
 * waits up to a switch interval per call). These functions hold the GIL and take
 * ~100 ns. Addresses are plain integers (see address()); the Python side keeps the
 * mapping alive and never calls in after unmapping.
 *
 * The ring byte layout is specified in fastkv/ipc/ring.py (class Ring); the offsets
 * below must match it. All shared words are 8-byte aligned 64-bit integers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define RING_MAGIC 0x31474E4952564B46ULL /* "FKVRING1" little-endian */
#define OFF_MAGIC 0
#define OFF_SLOT_SIZE 8
#define OFF_NSLOTS 16
#define OFF_CLOSED 24
#define OFF_DROPPED 32
#define OFF_HEAD 64
#define OFF_TAIL 128
#define HEADER_SIZE 512
#define SLOT_HDR 8
#define CONT_MARK 0xFFFFFFFFu

#define U64(base, off) ((uint64_t *)((char *)(base) + (off)))

static int get_addr(PyObject *o, char **out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (v == 0 || (v & 7)) {
        PyErr_SetString(PyExc_ValueError, "fastkv.native._atomics: address must be non-null and 8-byte aligned");
        return -1;
    }
    *out = (char *)(uintptr_t)v;
    return 0;
}

/* ---- plain atomics on one int64 word ---------------------------------------- */

static PyObject *a_address(PyObject *self, PyObject *obj) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) return NULL;
    uintptr_t p = (uintptr_t)view.buf;
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong((unsigned long long)p);
}

static PyObject *a_load(PyObject *self, PyObject *arg) {
    char *p;
    if (get_addr(arg, &p) < 0) return NULL;
    return PyLong_FromLongLong(__atomic_load_n((int64_t *)p, __ATOMIC_ACQUIRE));
}

static PyObject *a_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    char *p;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "store(addr, value) takes 2 arguments");
    if (get_addr(args[0], &p) < 0) return NULL;
    long long v = PyLong_AsLongLong(args[1]);
    if (v == -1 && PyErr_Occurred()) return NULL;
    __atomic_store_n((int64_t *)p, (int64_t)v, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *a_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    char *p;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "add(addr, delta) takes 2 arguments");
    if (get_addr(args[0], &p) < 0) return NULL;
    long long v = PyLong_AsLongLong(args[1]);
    if (v == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(__atomic_fetch_add((int64_t *)p, (int64_t)v, __ATOMIC_SEQ_CST));
}

static PyObject *a_cas(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    char *p;
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "cas(addr, expected, new) takes 3 arguments");
    if (get_addr(args[0], &p) < 0) return NULL;
    long long e = PyLong_AsLongLong(args[1]);
    if (e == -1 && PyErr_Occurred()) return NULL;
    long long n = PyLong_AsLongLong(args[2]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    int64_t expected = e;
    int ok = __atomic_compare_exchange_n((int64_t *)p, &expected, (int64_t)n, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return PyBool_FromLong(ok);
}

static PyObject *a_fence(PyObject *self, PyObject *unused) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* Consumer side of a doorbell: announce "about to sleep", full fence, so a producer
 * that publishes after this point sees the flag (Dekker: each side stores, fences,
 * then loads the other's word). */
static PyObject *a_arm(PyObject *self, PyObject *arg) {
    char *p;
    if (get_addr(arg, &p) < 0) return NULL;
    __atomic_store_n((int64_t *)p, 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* Producer side: after publishing, full fence, then take the flag (1 -> 0). True means
 * the waiter may be asleep and the caller must post its semaphore. */
static inline int take_flag(char *flag) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int64_t one = 1;
    if (__atomic_load_n((int64_t *)flag, __ATOMIC_RELAXED) != 1) return 0;
    return __atomic_compare_exchange_n((int64_t *)flag, &one, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

/* ---- ring ---------------------------------------------------------------------- */

typedef struct {
    char *base;
    uint64_t slot_size, nslots, payload;
} ring_t;

static int ring_open(PyObject *addr, ring_t *r) {
    if (get_addr(addr, &r->base) < 0) return -1;
    if (*U64(r->base, OFF_MAGIC) != RING_MAGIC) {
        PyErr_SetString(PyExc_ValueError, "fastkv ring: bad magic (not a ring header, or unmapped)");
        return -1;
    }
    r->slot_size = *U64(r->base, OFF_SLOT_SIZE);
    r->nslots = *U64(r->base, OFF_NSLOTS);
    if (r->slot_size < 16 || (r->slot_size & 7) || r->nslots == 0) {
        PyErr_SetString(PyExc_ValueError, "fastkv ring: corrupt header (slot_size/nslots)");
        return -1;
    }
    r->payload = r->slot_size - SLOT_HDR;
    return 0;
}

static inline char *slot_at(const ring_t *r, uint64_t idx) {
    return r->base + HEADER_SIZE + (idx % r->nslots) * r->slot_size;
}

static inline uint64_t slots_for(const ring_t *r, uint64_t len) {
    return len == 0 ? 1 : (len + r->payload - 1) / r->payload;
}

/* Write one message at index head (space already checked); does not publish. */
static void write_msg(const ring_t *r, uint64_t head, const char *data, uint64_t len) {
    uint64_t k = slots_for(r, len), done = 0;
    for (uint64_t i = 0; i < k; i++) {
        char *s = slot_at(r, head + i);
        uint32_t hdr[2] = {i == 0 ? (uint32_t)len : CONT_MARK, (uint32_t)(head + i)};
        memcpy(s, hdr, SLOT_HDR);
        uint64_t n = len - done < r->payload ? len - done : r->payload;
        memcpy(s + SLOT_HDR, data + done, n);
        done += n;
    }
}

/* push_many(hdr_addr, buffers, bell_flag_addr) -> (n_pushed, must_post)
 * Pushes buffers in order while they fit; one release store of head publishes them
 * all. Raises ValueError (pushing nothing) if buffers[0] can never fit the ring. */
static PyObject *a_push_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ring_t r;
    char *flag;
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "push_many(hdr, buffers, bell_flag) takes 3 arguments");
    if (ring_open(args[0], &r) < 0 || get_addr(args[2], &flag) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[1], "push_many: buffers must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), pushed = 0;
    uint64_t head = __atomic_load_n(U64(r.base, OFF_HEAD), __ATOMIC_RELAXED); /* we are its only writer */
    uint64_t tail = __atomic_load_n(U64(r.base, OFF_TAIL), __ATOMIC_ACQUIRE); /* slots before tail are free */
    uint64_t h = head;
    for (; pushed < n; pushed++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, pushed), &view, PyBUF_SIMPLE) < 0) break;
        uint64_t len = (uint64_t)view.len, k = slots_for(&r, len);
        if (len >= CONT_MARK || k > r.nslots) {
            PyBuffer_Release(&view);
            PyErr_Format(PyExc_ValueError,
                         "message of %llu bytes exceeds the ring capacity of %llu bytes (%llu slots of %llu payload bytes)",
                         (unsigned long long)len, (unsigned long long)(r.nslots * r.payload),
                         (unsigned long long)r.nslots, (unsigned long long)r.payload);
            break;
        }
        if (h + k - tail > r.nslots) {
            PyBuffer_Release(&view);
            break;
        }
        write_msg(&r, h, (const char *)view.buf, len);
        PyBuffer_Release(&view);
        h += k;
    }
    Py_DECREF(seq);
    int post = 0;
    if (h != head) {
        __atomic_store_n(U64(r.base, OFF_HEAD), h, __ATOMIC_RELEASE);
        post = take_flag(flag);
    }
    if (PyErr_Occurred()) {
        if (pushed == 0) return NULL;
        PyErr_Clear(); /* the bad buffer stays first in line: the caller's next call raises on it */
    }
    return Py_BuildValue("(nO)", pushed, post ? Py_True : Py_False);
}

/* The end of a corrupt frame that starts at t: the next slot that is a sound frame start
 * (not a continuation, its own sequence number), or head. Its header cannot be trusted, so
 * its length is not used; its continuation slots (and any other garbage) are skipped, the
 * frames after it are kept. */
static uint64_t corrupt_frame_end(const ring_t *r, uint64_t t, uint64_t head) {
    uint64_t end = t + 1;
    for (; end != head; end++) {
        uint32_t hdr[2];
        memcpy(hdr, slot_at(r, end), SLOT_HDR);
        if (hdr[0] != CONT_MARK && hdr[1] == (uint32_t)end) break;
    }
    return end;
}

/* pop_many(hdr_addr, max_n, space_flag_addr) -> (list[bytes], must_post)
 * Copies up to max_n published messages out and frees their slots with one release
 * store of tail. A corrupt frame (bad length, continuation where a first slot belongs,
 * wrong sequence number, broken continuation) is dropped on its own (see
 * corrupt_frame_end), counted in the header's dropped word, and raises ValueError, so
 * the ring stays usable; messages popped before it in this call are returned and the
 * error is raised by the next call. */
static PyObject *a_pop_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ring_t r;
    char *flag;
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "pop_many(hdr, max_n, space_flag) takes 3 arguments");
    if (ring_open(args[0], &r) < 0 || get_addr(args[2], &flag) < 0) return NULL;
    Py_ssize_t max_n = PyLong_AsSsize_t(args[1]);
    if (max_n == -1 && PyErr_Occurred()) return NULL;
    uint64_t tail = __atomic_load_n(U64(r.base, OFF_TAIL), __ATOMIC_RELAXED); /* we are its only writer */
    uint64_t head = __atomic_load_n(U64(r.base, OFF_HEAD), __ATOMIC_ACQUIRE); /* slots before head are written */
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    uint64_t t = tail;
    const char *bad = NULL;
    while (t != head && PyList_GET_SIZE(out) < max_n) {
        char *s = slot_at(&r, t);
        uint32_t hdr[2];
        memcpy(hdr, s, SLOT_HDR);
        uint64_t len = hdr[0], k = slots_for(&r, len);
        if (hdr[0] == CONT_MARK) bad = "continuation slot where a message should start";
        else if (hdr[1] != (uint32_t)t) bad = "slot sequence number mismatch";
        else if (k > head - t) bad = "message length runs past the published slots";
        if (bad) break;
        PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len);
        if (!b) { Py_DECREF(out); return NULL; }
        char *dst = PyBytes_AS_STRING(b);
        uint64_t done = 0;
        for (uint64_t i = 0; i < k; i++) {
            char *si = slot_at(&r, t + i);
            if (i > 0) {
                memcpy(hdr, si, SLOT_HDR);
                if (hdr[0] != CONT_MARK || hdr[1] != (uint32_t)(t + i)) { bad = "broken continuation slot"; break; }
            }
            uint64_t n = len - done < r.payload ? len - done : r.payload;
            memcpy(dst + done, si + SLOT_HDR, n);
            done += n;
        }
        if (bad) { Py_DECREF(b); break; }
        if (PyList_Append(out, b) < 0) { Py_DECREF(b); Py_DECREF(out); return NULL; }
        Py_DECREF(b);
        t += k;
    }
    if (bad && t == tail) {
        Py_DECREF(out);
        uint64_t end = corrupt_frame_end(&r, t, head);
        __atomic_fetch_add(U64(r.base, OFF_DROPPED), 1, __ATOMIC_RELAXED); /* consumer-written, like tail */
        __atomic_store_n(U64(r.base, OFF_TAIL), end, __ATOMIC_RELEASE);
        PyErr_Format(PyExc_ValueError, "fastkv ring: corrupt frame at index %llu (%s); dropped %llu slots",
                     (unsigned long long)tail, bad, (unsigned long long)(end - tail));
        /* slots were freed: the caller posts the producer's space bell if it is armed */
        return NULL;
    }
    int post = 0;
    if (t != tail) {
        __atomic_store_n(U64(r.base, OFF_TAIL), t, __ATOMIC_RELEASE);
        post = take_flag(flag);
    }
    PyObject *res = Py_BuildValue("(OO)", out, post ? Py_True : Py_False);
    Py_DECREF(out);
    return res;
}

/* used(hdr_addr) -> published slots not yet consumed (head - tail). */
static PyObject *a_used(PyObject *self, PyObject *arg) {
    ring_t r;
    if (ring_open(arg, &r) < 0) return NULL;
    uint64_t tail = __atomic_load_n(U64(r.base, OFF_TAIL), __ATOMIC_ACQUIRE);
    uint64_t head = __atomic_load_n(U64(r.base, OFF_HEAD), __ATOMIC_ACQUIRE);
    return PyLong_FromUnsignedLongLong(head - tail);
}

/* any_used(list of hdr_addr) -> True if any ring has a published message. A closed ring
 * does not count: a consumer of several rings keeps sleeping on the open ones (the
 * closer rang the doorbell once; a closed, drained ring is reported by its own pop). */
static PyObject *a_any_used(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "any_used: expected a sequence of ring addresses");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int any = 0;
    for (Py_ssize_t i = 0; i < n && !any; i++) {
        ring_t r;
        if (ring_open(PySequence_Fast_GET_ITEM(seq, i), &r) < 0) { Py_DECREF(seq); return NULL; }
        uint64_t tail = __atomic_load_n(U64(r.base, OFF_TAIL), __ATOMIC_ACQUIRE);
        uint64_t head = __atomic_load_n(U64(r.base, OFF_HEAD), __ATOMIC_ACQUIRE);
        any = head != tail;
    }
    Py_DECREF(seq);
    return PyBool_FromLong(any);
}

/* spin_any(hdrs, budget_ns[, keep_gil]) -> bool: looks at the rings for up to budget_ns,
 * yielding the core between looks; True as soon as one has a published message. A waiter
 * calls it before it sleeps on its doorbell: waking a process whose vCPU has halted costs
 * tens of microseconds on a VM, more than most answers take (fastkv/ipc/doorbell.py). It
 * releases the GIL unless keep_gil: the transfer loop keeps it, so that its low-priority
 * storage thread cannot take it and be preempted holding it (fastkv/transfer/lanes.py). The
 * caller keeps the mappings alive and closes no ring it is spinning on. */
static PyObject *a_spin_any(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "spin_any(hdrs, budget_ns[, keep_gil]) takes 2 or 3 arguments");
        return NULL;
    }
    long long budget = PyLong_AsLongLong(args[1]);
    if (budget == -1 && PyErr_Occurred()) return NULL;
    int keep_gil = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
    if (keep_gil < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "spin_any: expected a sequence of ring addresses");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    char **bases = PyMem_Malloc((n ? n : 1) * sizeof(char *));
    if (!bases) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < n; i++) {
        ring_t r;
        if (ring_open(PySequence_Fast_GET_ITEM(seq, i), &r) < 0) { PyMem_Free(bases); Py_DECREF(seq); return NULL; }
        bases[i] = r.base;
    }
    Py_DECREF(seq);
    int any = 0;
    PyThreadState *released = keep_gil ? NULL : PyEval_SaveThread();
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long end = ts.tv_sec * 1000000000LL + ts.tv_nsec + budget;
    for (;;) {
        for (Py_ssize_t i = 0; i < n && !any; i++)
            any = __atomic_load_n(U64(bases[i], OFF_HEAD), __ATOMIC_ACQUIRE) !=
                  __atomic_load_n(U64(bases[i], OFF_TAIL), __ATOMIC_ACQUIRE);
        if (any) break;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        if (ts.tv_sec * 1000000000LL + ts.tv_nsec >= end) break;
        sched_yield(); /* any runnable thread gets this core; the vCPU stays awake */
    }
    if (released) PyEval_RestoreThread(released);
    PyMem_Free(bases);
    return PyBool_FromLong(any);
}

static PyMethodDef methods[] = {
    {"address", a_address, METH_O, "address(buffer) -> int: start address of a writable buffer"},
    {"load", a_load, METH_O, "load(addr) -> int: acquire load of an int64"},
    {"store", (PyCFunction)(void (*)(void))a_store, METH_FASTCALL, "store(addr, v): seq_cst store of an int64"},
    {"add", (PyCFunction)(void (*)(void))a_add, METH_FASTCALL, "add(addr, d) -> old: seq_cst fetch-add"},
    {"cas", (PyCFunction)(void (*)(void))a_cas, METH_FASTCALL, "cas(addr, expected, new) -> bool"},
    {"fence", a_fence, METH_NOARGS, "fence(): seq_cst thread fence"},
    {"arm", a_arm, METH_O, "arm(flag_addr): store 1 then full fence (waiter about to sleep)"},
    {"push_many", (PyCFunction)(void (*)(void))a_push_many, METH_FASTCALL,
     "push_many(hdr, buffers, bell_flag) -> (n_pushed, must_post)"},
    {"pop_many", (PyCFunction)(void (*)(void))a_pop_many, METH_FASTCALL,
     "pop_many(hdr, max_n, space_flag) -> (list[bytes], must_post)"},
    {"used", a_used, METH_O, "used(hdr) -> head - tail"},
    {"any_used", a_any_used, METH_O, "any_used(hdrs) -> bool: any ring non-empty"},
    {"spin_any", (PyCFunction)(void (*)(void))a_spin_any, METH_FASTCALL,
     "spin_any(hdrs, budget_ns[, keep_gil]) -> bool: look at the rings (GIL released unless keep_gil) until one "
     "is non-empty or the budget ends"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "fastkv.native._atomics",
                                       "Shared-memory atomics and the SPSC ring fast path.", -1, methods};

PyMODINIT_FUNC PyInit__atomics(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0 || PyModule_AddIntConstant(m, "SLOT_HDR", SLOT_HDR) < 0 ||
        PyModule_AddIntConstant(m, "OFF_HEAD", OFF_HEAD) < 0 || PyModule_AddIntConstant(m, "OFF_TAIL", OFF_TAIL) < 0 ||
        PyModule_AddIntConstant(m, "OFF_CLOSED", OFF_CLOSED) < 0 || PyModule_AddIntConstant(m, "OFF_DROPPED", OFF_DROPPED) < 0 ||
        PyModule_AddObject(m, "RING_MAGIC", PyLong_FromUnsignedLongLong(RING_MAGIC)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
