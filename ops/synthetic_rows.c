/* fastkv.native._synthetic: the synthetic runner's KV rows (fastkv/engine/runners/synthetic.py).
 *
 * Why C: the rows are splitmix64 of every element. In numpy that took ~500 us per token of a
 * 32 KiB-per-token layout (eight passes over uint64 temporaries), 15x what the cost model
 * charges a GPU for a prefill token, so the runner's own byte work swamped the modelled time
 * that bench_e2e compares modes by. One pass here, vectorized where the CPU allows it, straight
 * into the device caches' slots (or an array's pages seen as caches of one block: kv_rows).
 *
 * The format is defined by the numpy reference (synthetic.kv_rows_reference); tests compare
 * the two byte for byte over every dtype.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HEADER 8

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_F16 = 2, KIND_BYTE = 3 };

static inline uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* One row's random part: D - HEADER values from (salt ^ key), as _bits_to_values maps them. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define CLONES
#endif

CLONES static void values_f32(uint32_t *out, const uint64_t *salt, uint64_t key, Py_ssize_t m) {
    for (Py_ssize_t e = 0; e < m; e++) {
        uint64_t b = mix(salt[e] ^ key);
        uint32_t exp = (uint32_t)(b >> 32) % 7u;
        out[e] = ((uint32_t)(b >> 63) << 31) | ((120 + exp) << 23) | ((uint32_t)b & 0x7FFFFF);
    }
}

CLONES static void values_bf16(uint16_t *out, const uint64_t *salt, uint64_t key, Py_ssize_t m) {
    for (Py_ssize_t e = 0; e < m; e++) {
        uint64_t b = mix(salt[e] ^ key);
        uint32_t exp = (uint32_t)(b >> 32) % 7u;
        out[e] = (uint16_t)(((uint32_t)(b >> 63) << 15) | ((120 + exp) << 7) | ((uint32_t)b & 0x7F));
    }
}

CLONES static void values_f16(uint16_t *out, const uint64_t *salt, uint64_t key, Py_ssize_t m) {
    for (Py_ssize_t e = 0; e < m; e++) {
        uint64_t b = mix(salt[e] ^ key);
        uint32_t exp = (uint32_t)(b >> 32) % 7u;
        out[e] = (uint16_t)(((uint32_t)(b >> 63) << 15) | ((8 + exp) << 10) | ((uint32_t)b & 0x3FF));
    }
}

CLONES static void values_byte(uint8_t *out, const uint64_t *salt, uint64_t key, Py_ssize_t m) {
    for (Py_ssize_t e = 0; e < m; e++) out[e] = (uint8_t)mix(salt[e] ^ key);
}

static void make_row(char *row, const char *header, const uint64_t *salt, uint64_t key, int kind, Py_ssize_t es,
                     Py_ssize_t m) {
    memcpy(row, header, HEADER * es);
    char *vals = row + HEADER * es;
    switch (kind) {
    case KIND_F32: values_f32((uint32_t *)vals, salt, key, m); break;
    case KIND_BF16: values_bf16((uint16_t *)vals, salt, key, m); break;
    case KIND_F16: values_f16((uint16_t *)vals, salt, key, m); break;
    default: values_byte((uint8_t *)vals, salt, key, m); break;
    }
}

static int get_buffer(PyObject *o, Py_buffer *b, int writable, const char *name) {
    if (PyObject_GetBuffer(o, b, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Format(PyExc_TypeError, "fastkv.native._synthetic: %s must be a C-contiguous%s buffer", name,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* scatter_rows(caches, blocks, slots, keys, salts, header_elems, kind, head_dim, block_size)
 *
 * The rows, written straight into device caches (numpy's fancy-indexed scatter of a rows array
 * cost more than making the rows): caches is a list of 2 x layers writable buffers
 * (K then V of layer 0, K then V of layer 1, ...), each [num_blocks, kv_heads, block_size,
 * head_dim] elements; blocks, slots: int64 [n], where token i goes; keys: uint64 [n]
 * (synthetic._keys); salts: uint64 [layers x 2 x kv_heads, head_dim - 8], rows in (layer, K|V,
 * head) order; header_elems: [n, 8] elements, the rows' headers (cheap in numpy: 8 per token).
 * Every id is checked before anything is written. */
static PyObject *scatter_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_caches, *objs[5];
    int kind;
    Py_ssize_t D, bs;
    if (!PyArg_ParseTuple(args, "O!OOOOOinn", &PyList_Type, &o_caches, &objs[0], &objs[1], &objs[2], &objs[3],
                          &objs[4], &kind, &D, &bs))
        return NULL;
    static const Py_ssize_t esizes[] = {4, 2, 2, 1};
    if (kind < 0 || kind > KIND_BYTE || D <= HEADER || bs < 1) {
        PyErr_Format(PyExc_ValueError, "fastkv.native._synthetic: bad kind %d, head_dim %zd or block_size %zd", kind, D, bs);
        return NULL;
    }
    static const char *names[5] = {"blocks", "slots", "keys", "salts", "header_elems"};
    Py_ssize_t es = esizes[kind], m = D - HEADER, nc = PyList_GET_SIZE(o_caches), got = 0, ncache = 0;
    Py_buffer bufs[5], *caches = NULL;
    PyObject *result = NULL;
    for (; got < 5; got++)
        if (get_buffer(objs[got], &bufs[got], 0, names[got]) < 0) goto done;
    Py_ssize_t n = bufs[2].len / 8, groups = bufs[3].len / (8 * m);
    if (nc == 0 || nc % 2 || bufs[2].len % 8 || bufs[0].len != n * 8 || bufs[1].len != n * 8 ||
        bufs[3].len != groups * m * 8 || groups % nc || bufs[4].len != n * HEADER * es) {
        PyErr_Format(PyExc_ValueError,
                     "fastkv.native._synthetic: sizes disagree: %zd caches, blocks %zd bytes, slots %zd, keys %zd, "
                     "salts %zd, headers %zd (head_dim %zd, %zd-byte elements)", nc, bufs[0].len, bufs[1].len,
                     bufs[2].len, bufs[3].len, bufs[4].len, D, es);
        goto done;
    }
    caches = PyMem_Calloc((size_t)nc, sizeof(Py_buffer));
    if (caches == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; ncache < nc; ncache++)
        if (get_buffer(PyList_GET_ITEM(o_caches, ncache), &caches[ncache], 1, "every cache") < 0) goto done;
    Py_ssize_t H = groups / nc, row = D * es, per_block = H * bs * row;
    Py_ssize_t num_blocks = caches[0].len / per_block;
    for (Py_ssize_t c = 0; c < nc; c++) {
        if (caches[c].len != num_blocks * per_block || num_blocks == 0) {
            PyErr_Format(PyExc_ValueError, "fastkv.native._synthetic: cache %zd holds %zd bytes, not whole blocks of "
                         "%zd heads x %zd slots x %zd bytes (as cache 0)", c, caches[c].len, H, bs, row);
            goto done;
        }
    }
    const int64_t *blk = bufs[0].buf, *slot = bufs[1].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (blk[i] < 0 || blk[i] >= num_blocks || slot[i] < 0 || slot[i] >= bs) {
            PyErr_Format(PyExc_ValueError, "fastkv.native._synthetic: token %zd goes to block %lld slot %lld, outside "
                         "%zd blocks of %zd slots", i, (long long)blk[i], (long long)slot[i], num_blocks, bs);
            goto done;
        }
    }
    {
        const uint64_t *k = bufs[2].buf, *s = bufs[3].buf;
        const char *h = bufs[4].buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t c = 0; c < nc; c++) {
            char *base = caches[c].buf;
            for (Py_ssize_t head = 0; head < H; head++) {
                const uint64_t *salt = s + (c * H + head) * m;
                for (Py_ssize_t i = 0; i < n; i++)
                    make_row(base + ((blk[i] * H + head) * bs + slot[i]) * row, h + i * HEADER * es, salt, k[i],
                             kind, es, m);
            }
        }
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t c = 0; c < ncache; c++) PyBuffer_Release(&caches[c]);
    PyMem_Free(caches);
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"scatter_rows", scatter_rows, METH_VARARGS,
     "scatter_rows(caches, blocks, slots, keys, salts, header_elems, kind, head_dim, block_size): the rows, "
     "written into the device caches"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastkv.native._synthetic", NULL, -1, methods};

PyMODINIT_FUNC PyInit__synthetic(void) { return PyModule_Create(&module); }
