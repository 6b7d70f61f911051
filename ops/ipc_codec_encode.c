/* fastkv.native._codec, encode: message -> bytes (see ipc_codec.c and fastkv/ipc/codec.py). */
#include "ipc_codec.h"

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
    PyErr_Format(PyExc_ValueError, "fastkv.native._codec: unknown field kind %d", kind);
    return -2;
}

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
        PyErr_Format(PyExc_AssertionError, "fastkv.native._codec.encode %s: size pass and write pass disagree", s->cls->tp_name);
    }
    goto done;
fallback:
    res = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < got; i++) Py_DECREF(vals[i]);
    return res;
}

/* encode(msg) -> bytes, or None when msg is not registered or needs converting */
PyObject *c_encode(PyObject *self, PyObject *msg) {
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
PyObject *c_encode_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
