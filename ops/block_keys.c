/* fastkv.native._chain: a request's chained block keys in one call (fastkv/cache/keys.py).
 *
 * Why C: key(i) = BLAKE3(key(i-1) || block i's int32 token bytes) is one short hash per block,
 * and through the blake3 Python binding each costs a hasher object, a bytes concatenation and a
 * slice: about 0.85 us per 64-token block, more than all the rest of the cache core's
 * bookkeeping for it. Here the chain is one loop over the token buffer (upstream BLAKE3's C
 * implementation, ops/third_party/blake3), with the GIL released for long prompts.
 *
 * The keys are the ones keys.block_keys computes through the blake3 binding; a test compares
 * the two byte for byte.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "third_party/blake3/blake3.h"

#define KEY 32
#define RELEASE_GIL_BLOCKS 64 /* a long prompt: other threads may run meanwhile */

static void chain(const uint8_t *data, Py_ssize_t step, const uint8_t *parent, Py_ssize_t n, uint8_t *out) {
    const uint8_t *prev = parent;
    for (Py_ssize_t i = 0; i < n; i++) {
        blake3_hasher h;
        blake3_hasher_init(&h);
        blake3_hasher_update(&h, prev, KEY);
        blake3_hasher_update(&h, data + i * step, (size_t)step);
        blake3_hasher_finalize(&h, out + i * KEY, KEY);
        prev = out + i * KEY;
    }
}

/* chain_keys(data, parent, step, first, count) -> list of `count` 32-byte keys: key j hashes the
 * previous key (`parent` for the first) and data[(first + j) * step : (first + j + 1) * step]. */
static PyObject *chain_keys(PyObject *self, PyObject *args) {
    Py_buffer data, parent;
    Py_ssize_t step, first, count;
    if (!PyArg_ParseTuple(args, "y*y*nnn", &data, &parent, &step, &first, &count)) return NULL;
    PyObject *out = NULL;
    uint8_t *keys = NULL;
    if (parent.len != KEY) {
        PyErr_Format(PyExc_ValueError, "chain_keys: parent must be %d bytes, got %zd", KEY, parent.len);
        goto done;
    }
    if (step <= 0 || first < 0 || count < 0 || (count && (first + count) > data.len / step)) {
        PyErr_Format(PyExc_ValueError, "chain_keys: blocks [%zd, %zd) of %zd bytes past the %zd bytes of data",
                     first, first + count, step, data.len);
        goto done;
    }
    out = PyList_New(count);
    if (out == NULL || count == 0) goto done;
    keys = PyMem_RawMalloc((size_t)count * KEY);
    if (keys == NULL) {
        Py_CLEAR(out);
        PyErr_NoMemory();
        goto done;
    }
    const uint8_t *src = (const uint8_t *)data.buf + first * step;
    if (count >= RELEASE_GIL_BLOCKS) {
        Py_BEGIN_ALLOW_THREADS
        chain(src, step, parent.buf, count, keys);
        Py_END_ALLOW_THREADS
    } else {
        chain(src, step, parent.buf, count, keys);
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *k = PyBytes_FromStringAndSize((const char *)keys + i * KEY, KEY);
        if (k == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, k);
    }
done:
    PyMem_RawFree(keys);
    PyBuffer_Release(&data);
    PyBuffer_Release(&parent);
    return out;
}

static PyMethodDef methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS, "chain_keys(data, parent, step, first, count) -> list[bytes]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
