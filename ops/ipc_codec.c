/* fastkv._codec: the variable-length part of fastkv's message codec, in C.
 *
 * The wire format and the field kinds are specified in fastkv/ipc/codec.py; this file
 * is its fast path (the pure-Python version there is the reference and the fallback).
 * encode() returns None when a value is not already in its canonical type (an int32
 * numpy array, bytes, str, a list/tuple of those) so Python can convert it, or raise a
 * clear error, and try again. decode() raises ValueError naming the field that is bad.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { K_I32 = 1, K_I64 = 2, K_BYTES = 3, K_STR = 4, K_BYTES_LIST = 5, K_STR_LIST = 6, K_RAGGED = 7 };

static inline Py_ssize_t pad8(Py_ssize_t n) { return (8 - (n & 7)) & 7; }

/* Is this buffer format a little-endian integer of the given size? (x86/arm: native) */
static int int_format(const char *fmt, Py_ssize_t itemsize, Py_ssize_t want) {
    if (itemsize != want || fmt == NULL) return 0;
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    if (fmt[1] != '\0') return 0;
    if (want == 4) return *fmt == 'i' || (sizeof(long) == 4 && *fmt == 'l');
    return *fmt == 'q' || (sizeof(long) == 8 && *fmt == 'l');
}

/* Acquire a 1-D C-contiguous int buffer of itemsize `want`; 0 = not canonical (no error set). */
static int get_ints(PyObject *o, Py_buffer *v, Py_ssize_t want) {
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

/* encode(type_id, tag, scalars: bytes, kinds: bytes, values: tuple) -> bytes | None */
static PyObject *c_encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyBytes_Check(args[2]) || !PyBytes_Check(args[3]) || !PyTuple_Check(args[4]))
        return PyErr_Format(PyExc_TypeError, "encode(type_id, tag, scalars, kinds, values)");
    unsigned long type_id = PyLong_AsUnsignedLong(args[0]), tag = PyLong_AsUnsignedLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    const char *kinds = PyBytes_AS_STRING(args[3]);
    Py_ssize_t nk = PyBytes_GET_SIZE(args[3]), ns = PyBytes_GET_SIZE(args[2]);
    if (PyTuple_GET_SIZE(args[4]) != nk) return PyErr_Format(PyExc_ValueError, "encode: %zd kinds, %zd values", nk, PyTuple_GET_SIZE(args[4]));
    Py_ssize_t total = 8 + ns;
    for (Py_ssize_t i = 0; i < nk; i++) {
        Py_ssize_t n = field(kinds[i], PyTuple_GET_ITEM(args[4], i), NULL);
        if (n == -2) return NULL;
        if (n < 0) Py_RETURN_NONE;
        total += n;
    }
    if (total > (Py_ssize_t)UINT32_MAX) Py_RETURN_NONE; /* Python raises the size error */
    PyObject *res = PyBytes_FromStringAndSize(NULL, total);
    if (!res) return NULL;
    out_t o = {PyBytes_AS_STRING(res)};
    uint16_t t16 = (uint16_t)type_id, g16 = (uint16_t)tag;
    uint32_t tot = (uint32_t)total;
    memcpy(o.p, &t16, 2);
    memcpy(o.p + 2, &g16, 2);
    memcpy(o.p + 4, &tot, 4);
    memcpy(o.p + 8, PyBytes_AS_STRING(args[2]), ns);
    o.p += 8 + ns;
    for (Py_ssize_t i = 0; i < nk; i++) {
        if (field(kinds[i], PyTuple_GET_ITEM(args[4], i), &o) < 0) { /* values changed between passes */
            Py_DECREF(res);
            Py_RETURN_NONE;
        }
    }
    if (o.p != PyBytes_AS_STRING(res) + total) {
        Py_DECREF(res);
        return PyErr_Format(PyExc_AssertionError, "fastkv._codec.encode: size pass and write pass disagree");
    }
    return res;
}

static PyObject *bad(const char *field_name, const char *why) {
    return PyErr_Format(PyExc_ValueError, "%s: %s", field_name, why);
}

static PyObject *frombuffer(PyObject *fb, PyObject *buf, PyObject *dtype, Py_ssize_t count, Py_ssize_t off) {
    PyObject *c = PyLong_FromSsize_t(count), *o = PyLong_FromSsize_t(off);
    PyObject *res = NULL;
    if (c && o) {
        PyObject *argv[4] = {buf, dtype, c, o};
        res = PyObject_Vectorcall(fb, argv, 4, NULL);
    }
    Py_XDECREF(c);
    Py_XDECREF(o);
    return res;
}

/* decode(buf, kinds, start, names, frombuffer, i32, i64) -> list of the variable fields */
static PyObject *c_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyBytes_CheckExact(args[0]) || !PyBytes_Check(args[1]) || !PyTuple_Check(args[3]))
        return PyErr_Format(PyExc_TypeError, "decode(buf, kinds, start, names, frombuffer, i32, i64)");
    PyObject *buf = args[0], *fb = args[4], *i32 = args[5], *i64 = args[6];
    const char *base = PyBytes_AS_STRING(buf);
    Py_ssize_t n = PyBytes_GET_SIZE(buf), off = PyLong_AsSsize_t(args[2]);
    if (off == -1 && PyErr_Occurred()) return NULL;
    const char *kinds = PyBytes_AS_STRING(args[1]);
    Py_ssize_t nk = PyBytes_GET_SIZE(args[1]);
    PyObject *out = PyList_New(nk);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < nk; i++) {
        const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(args[3], i));
        PyObject *v = NULL;
        uint32_t count, nbytes;
        if (!name) goto fail;
        if (off + 8 > n) { bad(name, "truncated field header"); goto fail; }
        memcpy(&count, base + off, 4);
        memcpy(&nbytes, base + off + 4, 4);
        off += 8;
        if ((Py_ssize_t)nbytes > n - off) { bad(name, "field runs past the end of the message"); goto fail; }
        const char *d = base + off;
        switch (kinds[i]) {
        case K_I32:
        case K_I64: {
            Py_ssize_t item = kinds[i] == K_I32 ? 4 : 8;
            if ((uint64_t)count * item != nbytes) { bad(name, "element count and byte size disagree"); goto fail; }
            v = frombuffer(fb, buf, kinds[i] == K_I32 ? i32 : i64, count, off);
            break;
        }
        case K_BYTES:
            if (count != nbytes) { bad(name, "count and byte size disagree"); goto fail; }
            v = PyBytes_FromStringAndSize(d, nbytes);
            break;
        case K_STR:
            if (count != nbytes) { bad(name, "count and byte size disagree"); goto fail; }
            v = PyUnicode_DecodeUTF8(d, nbytes, "strict");
            if (!v) { PyErr_Clear(); bad(name, "invalid UTF-8"); goto fail; }
            break;
        case K_BYTES_LIST:
        case K_STR_LIST: {
            if ((uint64_t)count * 4 > nbytes) { bad(name, "item lengths do not fit"); goto fail; }
            uint64_t sum = 4 * (uint64_t)count;
            for (uint32_t j = 0; j < count; j++) {
                uint32_t l;
                memcpy(&l, d + 4 * j, 4);
                sum += l;
            }
            if (sum != nbytes) { bad(name, "item lengths do not add up to the field size"); goto fail; }
            v = kinds[i] == K_BYTES_LIST ? PyTuple_New(count) : PyList_New(count);
            if (!v) goto fail;
            const char *p = d + 4 * (Py_ssize_t)count;
            for (uint32_t j = 0; j < count; j++) {
                uint32_t l;
                memcpy(&l, d + 4 * j, 4);
                PyObject *it = kinds[i] == K_BYTES_LIST ? PyBytes_FromStringAndSize(p, l) : PyUnicode_DecodeUTF8(p, l, "strict");
                if (!it) {
                    Py_DECREF(v);
                    v = NULL;
                    if (kinds[i] == K_STR_LIST) { PyErr_Clear(); bad(name, "invalid UTF-8"); }
                    goto fail;
                }
                if (kinds[i] == K_BYTES_LIST) PyTuple_SET_ITEM(v, j, it);
                else PyList_SET_ITEM(v, j, it);
                p += l;
            }
            break;
        }
        case K_RAGGED: {
            if (nbytes % 4 || (uint64_t)(count + 1) * 4 > nbytes) { bad(name, "offsets do not fit"); goto fail; }
            uint32_t nvals = nbytes / 4 - count - 1;
            int32_t prev = 0, cur;
            memcpy(&cur, d, 4);
            if (cur != 0) { bad(name, "offsets must start at 0"); goto fail; }
            for (uint32_t j = 1; j <= count; j++) {
                memcpy(&cur, d + 4 * j, 4);
                if (cur < prev) { bad(name, "offsets decrease"); goto fail; }
                prev = cur;
            }
            if ((uint32_t)prev != nvals) { bad(name, "offsets do not end at the value count"); goto fail; }
            v = PyList_New(count);
            if (!v) goto fail;
            Py_ssize_t vals = off + 4 * ((Py_ssize_t)count + 1);
            for (uint32_t j = 0; j < count; j++) {
                int32_t a, b;
                memcpy(&a, d + 4 * j, 4);
                memcpy(&b, d + 4 * (j + 1), 4);
                PyObject *arr = frombuffer(fb, buf, i32, b - a, vals + 4 * (Py_ssize_t)a);
                if (!arr) { Py_DECREF(v); v = NULL; goto fail; }
                PyList_SET_ITEM(v, j, arr);
            }
            break;
        }
        default:
            PyErr_Format(PyExc_ValueError, "fastkv._codec: unknown field kind %d", kinds[i]);
            goto fail;
        }
        if (!v) goto fail;
        PyList_SET_ITEM(out, i, v);
        off += nbytes + pad8(nbytes);
    }
    if (off != n) {
        Py_DECREF(out);
        return PyErr_Format(PyExc_ValueError, "%zd bytes of trailing data", n - off);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)(void (*)(void))c_encode, METH_FASTCALL,
     "encode(type_id, tag, scalars, kinds, values) -> bytes, or None if a value needs converting"},
    {"decode", (PyCFunction)(void (*)(void))c_decode, METH_FASTCALL,
     "decode(buf, kinds, start, names, frombuffer, i32, i64) -> list of variable fields"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "fastkv._codec",
                                       "C fast path of fastkv.ipc.codec.", -1, methods};

PyMODINIT_FUNC PyInit__codec(void) { return PyModule_Create(&moduledef); }
