/* Shared by the three files of fastkv.native._codec: ipc_codec.c (module, message registry),
 * ipc_codec_encode.c and ipc_codec_decode.c. The wire format and the field kinds are
 * specified in fastkv/ipc/codec.py.
 *
 * numpy's C API is a table of pointers that import_array() fills in; with
 * PY_ARRAY_UNIQUE_SYMBOL all three files share one table, filled by ipc_codec.c (the only
 * file that defines CODEC_IMPORTS_ARRAY before including this header). */
#ifndef FASTKV_IPC_CODEC_H
#define FASTKV_IPC_CODEC_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#define PY_ARRAY_UNIQUE_SYMBOL fastkv_codec_ARRAY_API
#ifndef CODEC_IMPORTS_ARRAY
#define NO_IMPORT_ARRAY
#endif
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "fastkv's wire format is little-endian and this codec copies it as native memory"
#endif

/* Field kinds; the numbers are fastkv/ipc/codec.py's _KIND_CODES. */
enum { K_I32 = 1, K_I64 = 2, K_BYTES = 3, K_STR = 4, K_BYTES_LIST = 5, K_STR_LIST = 6, K_RAGGED = 7,
       S_I64 = 11, S_I32 = 12, S_F64 = 13, S_BOOL = 14 };

static inline Py_ssize_t pad8(Py_ssize_t n) { return (8 - (n & 7)) & 7; }

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

/* Shared across the files, never exported from the .so: no interposition, no PLT calls. */
#pragma GCC visibility push(hidden)
extern spec_t *by_type[65536];   /* type id -> spec, NULL when not registered */
extern PyObject *by_class;       /* dict: class -> type id */

const spec_t *spec_of(PyTypeObject *t);
PyObject *c_register(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *c_encode(PyObject *self, PyObject *msg);
PyObject *c_encode_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *c_decode(PyObject *self, PyObject *buf);
PyObject *c_decode_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
#pragma GCC visibility pop

#endif
