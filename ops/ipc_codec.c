/* fastkv._codec: fastkv's message codec, in C.
 *
 * The wire format and the field kinds are specified in fastkv/ipc/codec.py; this file
 * is its fast path (the pure-Python version there is the reference and the fallback).
 * Each message class is registered once (register()); after that one call encodes or
 * decodes a message, or a whole batch, with no Python code per message: scalars are
 * packed here, dataclass instances are built by allocating them and filling their slots
 * through the slot descriptors (what the generated __init__ does, minus the call), and
 * decoded arrays are read-only numpy views made with numpy's C API (~40 ns each, where a
 * np.frombuffer call costs ~180 ns).
 *
 * encode() returns None when a value is not already in its canonical type (an int for
 * i64/i32 in range, a float, a bool, an int32 numpy array, bytes, str, a list/tuple of
 * those) so Python can convert it, or raise a clear error. decode() raises ValueError
 * with the reason a message is malformed, naming the field.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "fastkv's wire format is little-endian and this codec copies it as native memory"
#endif

/* Field kinds; the numbers are fastkv/ipc/codec.py's _KIND_CODES. */
enum { K_I32 = 1, K_I64 = 2, K_BYTES = 3, K_STR = 4, K_BYTES_LIST = 5, K_STR_LIST = 6, K_RAGGED = 7,
       S_I64 = 11, S_I32 = 12, S_F64 = 13, S_BOOL = 14 };

static inline Py_ssize_t pad8(Py_ssize_t n) { return (8 - (n & 7)) & 7; }

/* Is this buffer format a little-endian integer of the given size? (x86/arm: native) */
static int int_format(const char *fmt, Py_ssize_t itemsize, Py_ssize_t want) {
    if (itemsize != want || fmt == NULL) return 0;
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    if (fmt[1] != '\0') return 0;
    if (want == 4) return *fmt == 'i' || (sizeof(long) == 4 && *fmt == 'l');
    return *fmt == 'q' || (sizeof(long) == 8 && *fmt == 'l');
}

/* Acquire a 1-D C-contiguous int buffer of itemsize `want`; 0 = not canonical (no error set).
 * A numpy array is read directly (its buffer export costs ~100 ns); v->obj stays NULL so
 * PyBuffer_Release does nothing for it. */
static int get_ints(PyObject *o, Py_buffer *v, Py_ssize_t want) {
    if (PyArray_CheckExact(o)) {
        PyArrayObject *a = (PyArrayObject *)o;
        int t = PyArray_TYPE(a);
        if (PyArray_NDIM(a) != 1 || !PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISNOTSWAPPED(a) ||
            PyArray_ITEMSIZE(a) != want || !(PyTypeNum_ISSIGNED(t) && PyTypeNum_ISINTEGER(t)))
            return 0;
        v->obj = NULL, v->buf = PyArray_DATA(a), v->itemsize = want, v->len = PyArray_NBYTES(a);
        return 1;
    }
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (v->ndim != 1 || !int_format(v->format, v->itemsize, want)) {
        PyBuffer_Release(v);
        return 0;
    }
    return 1;
}

typedef struct {
    char *p;
} out_t;

static void put_var_header(out_t *o, uint32_t count, uint32_t nbytes) {
    memcpy(o->p, &count, 4);
    memcpy(o->p + 4, &nbytes, 4);
    o->p += 8;
}

static void put_pad(out_t *o, Py_ssize_t n) {
    Py_ssize_t k = pad8(n);
    memset(o->p, 0, k);
    o->p += k;
}

/* Size pass (out == NULL) or write pass of one field. Returns bytes used, -1 = not canonical. */
static Py_ssize_t field(int kind, PyObject *v, out_t *out) {
    Py_buffer b;
    switch (kind) {
    case K_I32:
    case K_I64: {
        if (!get_ints(v, &b, kind == K_I32 ? 4 : 8)) return -1;
        Py_ssize_t n = b.len;
        if (out) {
            put_var_header(out, (uint32_t)(n / b.itemsize), (uint32_t)n);
            memcpy(out->p, b.buf, n);
            out->p += n;
            put_pad(out, n);
        }
        PyBuffer_Release(&b);
        return 8 + n + pad8(n);
    }
    case K_BYTES:
    case K_STR: {
        const char *s;
        Py_ssize_t n;
        if (kind == K_BYTES) {
            if (!PyBytes_CheckExact(v)) return -1;
            s = PyBytes_AS_STRING(v), n = PyBytes_GET_SIZE(v);
        } else {
            if (!PyUnicode_CheckExact(v)) return -1;
            s = PyUnicode_AsUTF8AndSize(v, &n);
            if (!s) { PyErr_Clear(); return -1; } /* lone surrogates: let Python raise */
        }
        if (out) {
            put_var_header(out, (uint32_t)n, (uint32_t)n);
            memcpy(out->p, s, n);
            out->p += n;
            put_pad(out, n);
        }
        return 8 + n + pad8(n);
    }
    case K_BYTES_LIST:
    case K_STR_LIST: {
        if (!PyList_CheckExact(v) && !PyTuple_CheckExact(v)) return -1;
        Py_ssize_t count = PySequence_Fast_GET_SIZE(v), n = 4 * count;
        PyObject **items = PySequence_Fast_ITEMS(v);
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_ssize_t len;
            if (kind == K_BYTES_LIST) {
                if (!PyBytes_CheckExact(items[i])) return -1;
                len = PyBytes_GET_SIZE(items[i]);
            } else {
                if (!PyUnicode_CheckExact(items[i]) || !PyUnicode_AsUTF8AndSize(items[i], &len)) {
                    PyErr_Clear();
                    return -1;
                }
            }
            n += len;
        }
        if (out) {
            put_var_header(out, (uint32_t)count, (uint32_t)n);
            char *lens = out->p, *data = out->p + 4 * count;
            for (Py_ssize_t i = 0; i < count; i++) {
                Py_ssize_t len;
                const char *s = kind == K_BYTES_LIST ? PyBytes_AS_STRING(items[i]) : PyUnicode_AsUTF8AndSize(items[i], &len);
                if (kind == K_BYTES_LIST) len = PyBytes_GET_SIZE(items[i]);
                uint32_t l32 = (uint32_t)len;
                memcpy(lens + 4 * i, &l32, 4);
                memcpy(data, s, len);
                data += len;
            }
            out->p = data;
            put_pad(out, n);
        }
        return 8 + n + pad8(n);
    }
    case K_RAGGED: {
        if (!PyList_CheckExact(v) && !PyTuple_CheckExact(v)) return -1;
        Py_ssize_t count = PySequence_Fast_GET_SIZE(v), values = 0;
        PyObject **items = PySequence_Fast_ITEMS(v);
        for (Py_ssize_t i = 0; i < count; i++) {
            if (!get_ints(items[i], &b, 4)) return -1;
            values += b.len / 4;
            PyBuffer_Release(&b);
        }
        if (values > INT32_MAX) return -1;
        Py_ssize_t n = 4 * (count + 1) + 4 * values;
        if (out) {
            put_var_header(out, (uint32_t)count, (uint32_t)n);
            char *offs = out->p, *data = out->p + 4 * (count + 1);
            int32_t acc = 0;
            memcpy(offs, &acc, 4);
            for (Py_ssize_t i = 0; i < count; i++) {
                if (!get_ints(items[i], &b, 4)) return -1; /* unreachable: checked above */
                memcpy(data, b.buf, b.len);
                data += b.len;
                acc += (int32_t)(b.len / 4);
                memcpy(offs + 4 * (i + 1), &acc, 4);
                PyBuffer_Release(&b);
            }
            out->p = data;
            put_pad(out, n);
        }
        return 8 + n + pad8(n);
    }
    }
    PyErr_Format(PyExc_ValueError, "fastkv._codec: unknown field kind %d", kind);
    return -2;
}


/* ---- registry ---------------------------------------------------------------------- */

#define MAX_FIELDS 64

typedef struct {
    int kind;
    Py_ssize_t off;    /* scalars: byte offset in the message */
    PyObject *descr;   /* the slot's member descriptor, or NULL: use getattr */
    PyObject *name;    /* attribute name */
    const char *where; /* "Class.field", for error messages */
} field_t;

typedef struct {
    PyTypeObject *cls;
    uint16_t type_id, tag;
    Py_ssize_t body;     /* 8 + the padded scalar block: where the variable fields start */
    int fast_new;        /* build instances by filling slots (see register()) */
    Py_ssize_t nfields;
    field_t f[MAX_FIELDS];
} spec_t;

static spec_t *by_type[65536];
static PyObject *by_class; /* dict: class -> type id */

static const spec_t *spec_of(PyTypeObject *t) {
    static const spec_t *last; /* one class per batch is the common case */
    if (last && last->cls == t) return last;
    PyObject *id = PyDict_GetItemWithError(by_class, (PyObject *)t);
    if (!id) return NULL;
    last = by_type[PyLong_AsLong(id)];
    return last;
}

static Py_ssize_t scalar_size(int kind) {
    switch (kind) {
    case S_I64: case S_F64: return 8;
    case S_I32: return 4;
    case S_BOOL: return 1;
    }
    return 0;
}

/* register(type_id, tag, cls, fields, scalar_block_size, fast_new)
 * fields: ((name, kind, "Class.name"), ...) in declaration order. fast_new is the Python
 * side's promise that cls(*values) only stores each value in its slot (a slots dataclass
 * without __post_init__ or a custom __new__); it is dropped here unless every field is a
 * member descriptor. The registry lives as long as the process (message classes do). */
static PyObject *c_register(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyType_Check(args[2]) || !PyTuple_Check(args[3]))
        return PyErr_Format(PyExc_TypeError, "register(type_id, tag, cls, fields, scalar_block_size, fast_new)");
    long type_id = PyLong_AsLong(args[0]), tag = PyLong_AsLong(args[1]);
    Py_ssize_t block = PyLong_AsSsize_t(args[4]);
    int fast = PyObject_IsTrue(args[5]);
    if (PyErr_Occurred() || fast < 0) return NULL;
    Py_ssize_t nf = PyTuple_GET_SIZE(args[3]);
    if (type_id < 1 || type_id > 0xFFFF || by_type[type_id] || tag < 0 || tag > 0xFFFF || nf > MAX_FIELDS)
        return PyErr_Format(PyExc_ValueError, "register: bad or taken type id %ld, tag %ld or %zd fields", type_id, tag, nf);
    PyTypeObject *cls = (PyTypeObject *)args[2];
    spec_t *s = PyMem_Calloc(1, sizeof(spec_t));
    if (!s) return PyErr_NoMemory();
    s->cls = cls, s->type_id = (uint16_t)type_id, s->tag = (uint16_t)tag;
    s->nfields = nf, s->fast_new = fast;
    Py_ssize_t off = 8;
    for (Py_ssize_t i = 0; i < nf; i++) {
        PyObject *t = PyTuple_GET_ITEM(args[3], i);
        field_t *f = &s->f[i];
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3 || !PyUnicode_Check(PyTuple_GET_ITEM(t, 0))) goto bad_spec;
        f->name = PyTuple_GET_ITEM(t, 0);
        f->kind = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 1));
        f->where = PyUnicode_AsUTF8(PyTuple_GET_ITEM(t, 2));
        if (!f->where || PyErr_Occurred()) goto fail;
        if ((f->kind < K_I32 || f->kind > K_RAGGED) && !scalar_size(f->kind)) goto bad_spec;
        f->off = off;
        off += scalar_size(f->kind);
        PyObject *d = PyDict_GetItemWithError(cls->tp_dict, f->name);
        if (d && Py_IS_TYPE(d, &PyMemberDescr_Type)) f->descr = d;
        else if (PyErr_Occurred()) goto fail;
        else s->fast_new = 0;
    }
    if (8 + block != off + ((8 - (off & 7)) & 7)) {
        PyErr_Format(PyExc_AssertionError, "register %s: scalar block of %zd bytes, C packs %zd", s->cls->tp_name, block, off - 8);
        goto fail;
    }
    s->body = 8 + block;
    PyObject *id = PyLong_FromLong(type_id);
    if (!id || PyDict_SetItem(by_class, (PyObject *)cls, id) < 0) { Py_XDECREF(id); goto fail; }
    Py_DECREF(id);
    Py_INCREF(cls);
    for (Py_ssize_t i = 0; i < nf; i++) {
        Py_INCREF(s->f[i].name);
        Py_XINCREF(s->f[i].descr);
        Py_INCREF(PyTuple_GET_ITEM(PyTuple_GET_ITEM(args[3], i), 2)); /* keeps `where` alive */
    }
    by_type[type_id] = s;
    Py_RETURN_NONE;
bad_spec:
    PyErr_SetString(PyExc_ValueError, "register: fields must be (name, kind, where) tuples with known kinds");
fail:
    PyMem_Free(s);
    return NULL;
}

/* ---- encode ------------------------------------------------------------------------ */

static PyObject *get_field(const spec_t *s, const field_t *f, PyObject *msg) {
    if (f->descr) return Py_TYPE(f->descr)->tp_descr_get(f->descr, msg, (PyObject *)s->cls);
    return PyObject_GetAttr(msg, f->name);
}

/* Pack one scalar; 0 = not canonical (Python converts or raises the error). */
static int put_scalar(int kind, PyObject *v, char *p) {
    switch (kind) {
    case S_I64:
    case S_I32: {
        if (!PyLong_Check(v)) return 0;
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || (x == -1 && PyErr_Occurred())) { PyErr_Clear(); return 0; }
        if (kind == S_I64) { memcpy(p, &x, 8); return 1; }
        if (x < INT32_MIN || x > INT32_MAX) return 0;
        int32_t y = (int32_t)x;
        memcpy(p, &y, 4);
        return 1;
    }
    case S_F64: {
        if (!PyFloat_CheckExact(v)) return 0;
        double x = PyFloat_AS_DOUBLE(v);
        memcpy(p, &x, 8);
        return 1;
    }
    case S_BOOL:
        if (v != Py_True && v != Py_False) return 0;
        *p = v == Py_True;
        return 1;
    }
    return 0;
}

/* One message -> new bytes, Py_None (new ref) when Python must handle it, NULL on error. */
static PyObject *encode_one(const spec_t *s, PyObject *msg) {
    PyObject *vals[MAX_FIELDS];
    PyObject *res = NULL;
    Py_ssize_t nf = s->nfields, got = 0, total = s->body;
    for (; got < nf; got++) {
        vals[got] = get_field(s, &s->f[got], msg);
        if (!vals[got]) { PyErr_Clear(); goto fallback; } /* unset field: Python raises the error */
    }
    for (Py_ssize_t i = 0; i < nf; i++) {
        if (s->f[i].kind >= S_I64) continue;
        Py_ssize_t n = field(s->f[i].kind, vals[i], NULL);
        if (n == -2) goto done;
        if (n < 0) goto fallback;
        total += n;
    }
    if (total > (Py_ssize_t)UINT32_MAX) goto fallback; /* Python raises the size error */
    res = PyBytes_FromStringAndSize(NULL, total);
    if (!res) goto done;
    char *base = PyBytes_AS_STRING(res);
    uint32_t tot = (uint32_t)total;
    memcpy(base, &s->type_id, 2);
    memcpy(base + 2, &s->tag, 2);
    memcpy(base + 4, &tot, 4);
    memset(base + 8, 0, s->body - 8); /* the scalar block's padding */
    out_t o = {base + s->body};
    for (Py_ssize_t i = 0; i < nf; i++) {
        const field_t *f = &s->f[i];
        int ok = f->kind >= S_I64 ? put_scalar(f->kind, vals[i], base + f->off) : field(f->kind, vals[i], &o) >= 0;
        if (!ok) { Py_CLEAR(res); goto fallback; } /* field() cannot fail after its size pass */
    }
    if (o.p != base + total) {
        Py_CLEAR(res);
        PyErr_Format(PyExc_AssertionError, "fastkv._codec.encode %s: size pass and write pass disagree", s->cls->tp_name);
    }
    goto done;
fallback:
    res = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < got; i++) Py_DECREF(vals[i]);
    return res;
}

/* encode(msg) -> bytes, or None when msg is not registered or needs converting */
static PyObject *c_encode(PyObject *self, PyObject *msg) {
    const spec_t *s = spec_of(Py_TYPE(msg));
    if (!s) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    return encode_one(s, msg);
}

/* encode_many(msgs, accept, fallback) -> list[bytes]. `fallback(msg)` encodes (or
 * rejects) any message this path cannot: unregistered, not in `accept` (a tuple of
 * classes, or None for any), or holding values that need converting. */
static PyObject *c_encode_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || (args[1] != Py_None && !PyTuple_Check(args[1])))
        return PyErr_Format(PyExc_TypeError, "encode_many(msgs, accept, fallback)");
    PyObject *seq = PySequence_Fast(args[0], "encode_many: msgs must be iterable");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (!out) { Py_DECREF(seq); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyTypeObject *t = Py_TYPE(items[i]);
        const spec_t *s = NULL;
        int ok = 1;
        if (args[1] != Py_None) {
            ok = 0;
            for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(args[1]); j++) ok |= PyTuple_GET_ITEM(args[1], j) == (PyObject *)t;
        }
        if (ok && !(s = spec_of(t)) && PyErr_Occurred()) goto fail;
        PyObject *buf = s ? encode_one(s, items[i]) : Py_NewRef(Py_None);
        if (buf == Py_None) {
            Py_DECREF(buf);
            buf = PyObject_CallOneArg(args[2], items[i]);
        }
        if (!buf) goto fail;
        PyList_SET_ITEM(out, i, buf);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

/* ---- decode ------------------------------------------------------------------------ */

static PyObject *bad(const char *where, const char *why) {
    return PyErr_Format(PyExc_ValueError, "%s: %s", where, why);
}

/* A read-only int32/int64 view of `count` items at buf[off:], keeping buf alive. */
static PyObject *int_view(PyObject *buf, int npy_type, Py_ssize_t count, Py_ssize_t off) {
    npy_intp dims[1] = {count};
    char *data = PyBytes_AS_STRING(buf) + off;
    int flags = NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_F_CONTIGUOUS; /* no NPY_ARRAY_WRITEABLE: read-only */
    if (((uintptr_t)data & (npy_type == NPY_INT32 ? 3 : 7)) == 0) flags |= NPY_ARRAY_ALIGNED;
    PyObject *a = PyArray_NewFromDescr(&PyArray_Type, PyArray_DescrFromType(npy_type), 1, dims, NULL, data, flags, NULL);
    if (!a) return NULL;
    if (PyArray_SetBaseObject((PyArrayObject *)a, Py_NewRef(buf)) < 0) {
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

static PyObject *scalar(int kind, const char *p) {
    switch (kind) {
    case S_I64: { int64_t x; memcpy(&x, p, 8); return PyLong_FromLongLong(x); }
    case S_I32: { int32_t x; memcpy(&x, p, 4); return PyLong_FromLong(x); }
    case S_F64: { double x; memcpy(&x, p, 8); return PyFloat_FromDouble(x); }
    case S_BOOL: return PyBool_FromLong(*p != 0);
    }
    return PyErr_Format(PyExc_AssertionError, "fastkv._codec: scalar kind %d", kind);
}

/* The variable field at *off (advanced past it); NULL with ValueError when malformed. */
static PyObject *var_field(const field_t *f, PyObject *buf, Py_ssize_t *offp) {
    const char *base = PyBytes_AS_STRING(buf), *name = f->where;
    Py_ssize_t n = PyBytes_GET_SIZE(buf), off = *offp;
    uint32_t count, nbytes;
    PyObject *v = NULL;
    if (off + 8 > n) return bad(name, "truncated field header");
    memcpy(&count, base + off, 4);
    memcpy(&nbytes, base + off + 4, 4);
    off += 8;
    if ((Py_ssize_t)nbytes > n - off) return bad(name, "field runs past the end of the message");
    const char *d = base + off;
    switch (f->kind) {
    case K_I32:
    case K_I64: {
        Py_ssize_t item = f->kind == K_I32 ? 4 : 8;
        if ((uint64_t)count * item != nbytes) return bad(name, "element count and byte size disagree");
        v = int_view(buf, f->kind == K_I32 ? NPY_INT32 : NPY_INT64, count, off);
        break;
    }
    case K_BYTES:
        if (count != nbytes) return bad(name, "count and byte size disagree");
        v = PyBytes_FromStringAndSize(d, nbytes);
        break;
    case K_STR:
        if (count != nbytes) return bad(name, "count and byte size disagree");
        v = PyUnicode_DecodeUTF8(d, nbytes, "strict");
        if (!v && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) { PyErr_Clear(); return bad(name, "invalid UTF-8"); }
        break;
    case K_BYTES_LIST:
    case K_STR_LIST: {
        if ((uint64_t)count * 4 > nbytes) return bad(name, "item lengths do not fit");
        uint64_t sum = 4 * (uint64_t)count;
        for (uint32_t j = 0; j < count; j++) {
            uint32_t l;
            memcpy(&l, d + 4 * j, 4);
            sum += l;
        }
        if (sum != nbytes) return bad(name, "item lengths do not add up to the field size");
        v = f->kind == K_BYTES_LIST ? PyTuple_New(count) : PyList_New(count);
        if (!v) return NULL;
        const char *p = d + 4 * (Py_ssize_t)count;
        for (uint32_t j = 0; j < count; j++) {
            uint32_t l;
            memcpy(&l, d + 4 * j, 4);
            PyObject *it = f->kind == K_BYTES_LIST ? PyBytes_FromStringAndSize(p, l) : PyUnicode_DecodeUTF8(p, l, "strict");
            if (!it) {
                Py_DECREF(v);
                if (f->kind == K_STR_LIST && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                    PyErr_Clear();
                    bad(name, "invalid UTF-8");
                }
                return NULL;
            }
            if (f->kind == K_BYTES_LIST) PyTuple_SET_ITEM(v, j, it);
            else PyList_SET_ITEM(v, j, it);
            p += l;
        }
        break;
    }
    case K_RAGGED: {
        if (nbytes % 4 || (uint64_t)(count + 1) * 4 > nbytes) return bad(name, "offsets do not fit");
        uint32_t nvals = nbytes / 4 - count - 1;
        int32_t prev = 0, cur;
        memcpy(&cur, d, 4);
        if (cur != 0) return bad(name, "offsets must start at 0");
        for (uint32_t j = 1; j <= count; j++) {
            memcpy(&cur, d + 4 * j, 4);
            if (cur < prev) return bad(name, "offsets decrease");
            prev = cur;
        }
        if ((uint32_t)prev != nvals) return bad(name, "offsets do not end at the value count");
        v = PyList_New(count);
        if (!v) return NULL;
        Py_ssize_t vals = off + 4 * ((Py_ssize_t)count + 1);
        for (uint32_t j = 0; j < count; j++) {
            int32_t a, b;
            memcpy(&a, d + 4 * j, 4);
            memcpy(&b, d + 4 * (j + 1), 4);
            PyObject *arr = int_view(buf, NPY_INT32, b - a, vals + 4 * (Py_ssize_t)a);
            if (!arr) { Py_DECREF(v); return NULL; }
            PyList_SET_ITEM(v, j, arr);
        }
        break;
    }
    default:
        return PyErr_Format(PyExc_AssertionError, "fastkv._codec: unknown field kind %d", f->kind);
    }
    *offp = off + nbytes + pad8(nbytes);
    return v;
}

/* One message (exact bytes) -> new instance; NULL with ValueError (the reason) when malformed. */
static PyObject *decode_one(PyObject *buf) {
    const char *base = PyBytes_AS_STRING(buf);
    Py_ssize_t n = PyBytes_GET_SIZE(buf);
    if (n < 8) return PyErr_Format(PyExc_ValueError, "shorter than the 8-byte header");
    uint16_t type_id, tag;
    uint32_t total;
    memcpy(&type_id, base, 2);
    memcpy(&tag, base + 2, 2);
    memcpy(&total, base + 4, 4);
    const spec_t *s = by_type[type_id];
    if (!s) return PyErr_Format(PyExc_ValueError, "unknown message type id %u", (unsigned)type_id);
    if (tag != s->tag)
        return PyErr_Format(PyExc_ValueError, "%s schema tag 0x%x != ours 0x%x (peer runs other code)", s->cls->tp_name,
                            (unsigned)tag, (unsigned)s->tag);
    if ((Py_ssize_t)total != n)
        return PyErr_Format(PyExc_ValueError, "%s header says %u bytes (truncated or trailing data)", s->cls->tp_name, total);
    if (s->body > n) return PyErr_Format(PyExc_ValueError, "%s truncated in its scalars", s->cls->tp_name);
    PyObject *vals[MAX_FIELDS];
    PyObject *res = NULL;
    Py_ssize_t nf = s->nfields, got = 0, off = s->body;
    for (; got < nf; got++) {
        const field_t *f = &s->f[got];
        vals[got] = f->kind >= S_I64 ? scalar(f->kind, base + f->off) : var_field(f, buf, &off);
        if (!vals[got]) goto done;
    }
    if (off != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes of trailing data", s->cls->tp_name, n - off);
        goto done;
    }
    if (!s->fast_new) {
        res = PyObject_Vectorcall((PyObject *)s->cls, vals, nf, NULL);
        goto done;
    }
    res = s->cls->tp_alloc(s->cls, 0);
    for (Py_ssize_t i = 0; res && i < nf; i++) {
        if (Py_TYPE(s->f[i].descr)->tp_descr_set(s->f[i].descr, res, vals[i]) < 0) Py_CLEAR(res);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) Py_DECREF(vals[i]);
    return res;
}

/* decode(buf: bytes) -> message; ValueError naming what is malformed */
static PyObject *c_decode(PyObject *self, PyObject *buf) {
    if (!PyBytes_CheckExact(buf)) return PyErr_Format(PyExc_TypeError, "decode takes bytes, got %s", Py_TYPE(buf)->tp_name);
    return decode_one(buf);
}

/* decode_many(bufs, accept) -> (messages, bad_index, why): decodes in order up to the
 * first malformed message (bad_index, why = the reason) or the first whose class is not
 * in `accept` (a tuple of classes, or None for any; why = None); bad_index is -1 when
 * every message decoded. Buffers that are not bytes are copied to bytes first. */
static PyObject *c_decode_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0]) || (args[1] != Py_None && !PyTuple_Check(args[1])))
        return PyErr_Format(PyExc_TypeError, "decode_many(bufs: list, accept: tuple | None)");
    PyObject *bufs = args[0], *accept = args[1];
    Py_ssize_t n = PyList_GET_SIZE(bufs), i = 0;
    PyObject *out = PyList_New(0), *why = NULL;
    if (!out) return NULL;
    for (; i < n; i++) {
        PyObject *buf = PyList_GET_ITEM(bufs, i), *msg;
        if (PyBytes_CheckExact(buf)) {
            msg = decode_one(buf);
        } else {
            PyObject *copy = PyBytes_FromObject(buf);
            msg = copy ? decode_one(copy) : NULL;
            Py_XDECREF(copy);
        }
        if (!msg) {
            if (!PyErr_ExceptionMatches(PyExc_ValueError)) goto fail;
            PyObject *type, *exc, *tb;
            PyErr_Fetch(&type, &exc, &tb);
            PyErr_NormalizeException(&type, &exc, &tb);
            why = exc ? PyObject_Str(exc) : NULL;
            Py_XDECREF(type);
            Py_XDECREF(exc);
            Py_XDECREF(tb);
            if (!why) goto fail;
            break;
        }
        int ok = accept == Py_None;
        for (Py_ssize_t j = 0; !ok && j < PyTuple_GET_SIZE(accept); j++) ok = PyTuple_GET_ITEM(accept, j) == (PyObject *)Py_TYPE(msg);
        if (!ok) {
            Py_DECREF(msg);
            why = Py_NewRef(Py_None);
            break;
        }
        int err = PyList_Append(out, msg);
        Py_DECREF(msg);
        if (err < 0) goto fail;
    }
    return Py_BuildValue("(NnN)", out, i < n ? i : (Py_ssize_t)-1, why ? why : Py_NewRef(Py_None));
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"register", (PyCFunction)(void (*)(void))c_register, METH_FASTCALL,
     "register(type_id, tag, cls, fields, scalar_block_size, fast_new)"},
    {"encode", (PyCFunction)c_encode, METH_O, "encode(msg) -> bytes, or None if unregistered or needs converting"},
    {"encode_many", (PyCFunction)(void (*)(void))c_encode_many, METH_FASTCALL,
     "encode_many(msgs, accept, fallback) -> list[bytes]"},
    {"decode", (PyCFunction)c_decode, METH_O, "decode(buf) -> message; ValueError when malformed"},
    {"decode_many", (PyCFunction)(void (*)(void))c_decode_many, METH_FASTCALL,
     "decode_many(bufs, accept) -> (messages, bad_index, why)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "fastkv._codec", "fastkv's message codec in C.", -1,
                                       methods};

PyMODINIT_FUNC PyInit__codec(void) {
    import_array();
    by_class = PyDict_New();
    if (!by_class) return NULL;
    return PyModule_Create(&moduledef);
}
