/* fastkv._synthetic: the synthetic runner's KV rows (fastkv/engine/runners/synthetic.py).
 *
 * Why C: the rows are splitmix64 of every element. In numpy that took ~500 us per token of a
 * 32 KiB-per-token layout (eight passes over uint64 temporaries), 15x what the cost model
 * charges a GPU for a prefill token, so the runner's own byte work swamped the modelled time
 * that bench_e2e compares modes by. One pass here, vectorized where the CPU allows it.
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

static int get_buffer(PyObject *o, Py_buffer *b, int writable, const char *name) {
    if (PyObject_GetBuffer(o, b, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Format(PyExc_TypeError, "fastkv._synthetic: %s must be a C-contiguous%s buffer", name,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* fill_rows(out, keys, salts, header_elems, kind, head_dim)
 *
 * out: [groups, n, head_dim] elements (groups = layers x 2 x kv_heads), written whole;
 * keys: uint64 [n] (synthetic._keys); salts: uint64 [groups, head_dim - 8];
 * header_elems: [n, 8] elements, the rows' headers (cheap in numpy: 8 per token). */
static PyObject *fill_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_out, *o_keys, *o_salts, *o_hdr;
    int kind;
    Py_ssize_t D;
    if (!PyArg_ParseTuple(args, "OOOOin", &o_out, &o_keys, &o_salts, &o_hdr, &kind, &D)) return NULL;
    static const Py_ssize_t esizes[] = {4, 2, 2, 1};
    if (kind < 0 || kind > KIND_BYTE || D <= HEADER) {
        PyErr_Format(PyExc_ValueError, "fastkv._synthetic: bad kind %d or head_dim %zd", kind, D);
        return NULL;
    }
    Py_ssize_t es = esizes[kind], m = D - HEADER;
    Py_buffer out, keys, salts, hdr;
    if (get_buffer(o_out, &out, 1, "out") < 0) return NULL;
    if (get_buffer(o_keys, &keys, 0, "keys") < 0) goto fail_out;
    if (get_buffer(o_salts, &salts, 0, "salts") < 0) goto fail_keys;
    if (get_buffer(o_hdr, &hdr, 0, "header_elems") < 0) goto fail_salts;
    Py_ssize_t n = keys.len / 8, groups = salts.len / (8 * m);
    if (keys.len % 8 || salts.len != groups * m * 8 || hdr.len != n * HEADER * es || out.len != groups * n * D * es) {
        PyErr_Format(PyExc_ValueError,
                     "fastkv._synthetic: sizes disagree: out %zd bytes, keys %zd, salts %zd, headers %zd "
                     "(head_dim %zd, %zd-byte elements)", out.len, keys.len, salts.len, hdr.len, D, es);
        goto fail_hdr;
    }
    {
        const uint64_t *k = keys.buf, *s = salts.buf;
        char *dst = out.buf;
        const char *h = hdr.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t g = 0; g < groups; g++) {
            const uint64_t *salt = s + g * m;
            for (Py_ssize_t i = 0; i < n; i++) {
                char *row = dst + (g * n + i) * D * es;
                memcpy(row, h + i * HEADER * es, HEADER * es);
                char *vals = row + HEADER * es;
                switch (kind) {
                case KIND_F32: values_f32((uint32_t *)vals, salt, k[i], m); break;
                case KIND_BF16: values_bf16((uint16_t *)vals, salt, k[i], m); break;
                case KIND_F16: values_f16((uint16_t *)vals, salt, k[i], m); break;
                default: values_byte((uint8_t *)vals, salt, k[i], m); break;
                }
            }
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&hdr);
    PyBuffer_Release(&salts);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
fail_hdr:
    PyBuffer_Release(&hdr);
fail_salts:
    PyBuffer_Release(&salts);
fail_keys:
    PyBuffer_Release(&keys);
fail_out:
    PyBuffer_Release(&out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"fill_rows", fill_rows, METH_VARARGS,
     "fill_rows(out, keys, salts, header_elems, kind, head_dim): the synthetic runner's KV rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastkv._synthetic", NULL, -1, methods};

PyMODINIT_FUNC PyInit__synthetic(void) { return PyModule_Create(&module); }
