/* fastkv.native._codec: fastkv's message codec, in C.
 *
 * The wire format and the field kinds are specified in fastkv/ipc/codec.py; this
 * extension is its fast path (the pure-Python version there is the reference and the
 * fallback). This file holds the module and the message registry; ipc_codec_encode.c and
 * ipc_codec_decode.c the two directions; ipc_codec.h what they share.
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
#define CODEC_IMPORTS_ARRAY
#include "ipc_codec.h"

/* ---- registry ---------------------------------------------------------------------- */

spec_t *by_type[65536];
PyObject *by_class;

const spec_t *spec_of(PyTypeObject *t) {
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
PyObject *c_register(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "fastkv.native._codec", "fastkv's message codec in C.", -1,
                                       methods};

PyMODINIT_FUNC PyInit__codec(void) {
    import_array();
    by_class = PyDict_New();
    if (!by_class) return NULL;
    return PyModule_Create(&moduledef);
}
