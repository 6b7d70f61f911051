/* fastkv.native._codec, decode: bytes -> message (see ipc_codec.c and fastkv/ipc/codec.py). */
#include "ipc_codec.h"

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
    return PyErr_Format(PyExc_AssertionError, "fastkv.native._codec: scalar kind %d", kind);
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
        return PyErr_Format(PyExc_AssertionError, "fastkv.native._codec: unknown field kind %d", f->kind);
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
PyObject *c_decode(PyObject *self, PyObject *buf) {
    if (!PyBytes_CheckExact(buf)) return PyErr_Format(PyExc_TypeError, "decode takes bytes, got %s", Py_TYPE(buf)->tp_name);
    return decode_one(buf);
}

/* decode_many(bufs, accept) -> (messages, bad_index, why): decodes in order up to the
 * first malformed message (bad_index, why = the reason) or the first whose class is not
 * in `accept` (a tuple of classes, or None for any; why = None); bad_index is -1 when
 * every message decoded. Buffers that are not bytes are copied to bytes first. */
PyObject *c_decode_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
