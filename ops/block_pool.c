/* fastkv.native._pool: the block pool's loops that every block of every request passes through, in C:
 * evicting leaves for fresh blocks (BlockPool._evict_leaves), inserting computed keys
 * (insert_many), releasing a table (release_many), and the LRU queue's links for the last two
 * (LRUQueue.popleft_many, extend).
 *
 * Why C: in Python their bytecode cost about as much as the list and dict operations they do.
 * These are the same loops over the pool's own lists and dicts, with the rare cases (a key
 * cached on another block; a release that frees, unkeys or waits for a copy) handed back to
 * the pool's own methods. BlockPool._evict_leaves_reference, _insert_many_reference and
 * _release_many_reference are the definitions; property tests compare each pair.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* A pool's list at a block id, or NULL (IndexError) past its end. */
static PyObject *at(PyObject *list, PyObject *block, Py_ssize_t *index) {
    Py_ssize_t i = PyLong_AsSsize_t(block);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || i >= PyList_GET_SIZE(list)) {
        PyErr_Format(PyExc_IndexError, "block id %zd out of range [0, %zd)", i, PyList_GET_SIZE(list));
        return NULL;
    }
    *index = i;
    return PyList_GET_ITEM(list, i);
}

/* The pool's dicts must be plain: a subclass (fastkv.cache.residency's observed maps) reports each
 * change from the methods this code goes around; the pool takes its Python loops for those. */
static int plain(PyObject *lookup, PyObject *kids) {
    if (PyDict_CheckExact(lookup) && PyDict_CheckExact(kids)) return 1;
    PyErr_SetString(PyExc_TypeError, "fastkv.native._pool: the lookup and kids maps must be plain dicts");
    return 0;
}

static int set_at(PyObject *list, Py_ssize_t i, PyObject *value) {
    Py_INCREF(value);
    return PyList_SetItem(list, i, value); /* steals the reference, even on error */
}

/* kids[pk]: a parent key's children in the pool (blocks, and None for one a copy brings): the
 * child itself while it is the only one (nothing allocated: a chain's every parent), a list from
 * the second on (BlockPool._add_child, _unchild). add_child adds block b; drop_child removes it,
 * and the entry with the last child. */
static int add_child(PyObject *kids, PyObject *pk, PyObject *b) {
    PyObject *c = PyDict_GetItemWithError(kids, pk); /* borrowed */
    if (c == NULL) return PyErr_Occurred() ? -1 : PyDict_SetItem(kids, pk, b);
    if (PyList_CheckExact(c)) return PyList_Append(c, b);
    PyObject *two = PyList_New(2);
    if (two == NULL) return -1;
    Py_INCREF(c);
    PyList_SET_ITEM(two, 0, c);
    Py_INCREF(b);
    PyList_SET_ITEM(two, 1, b);
    int rc = PyDict_SetItem(kids, pk, two);
    Py_DECREF(two);
    return rc;
}

static int drop_child(PyObject *kids, PyObject *pk, PyObject *b) {
    PyObject *c = PyDict_GetItemWithError(kids, pk); /* borrowed */
    if (c == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, pk);
        return -1;
    }
    if (!PyList_CheckExact(c)) return PyDict_DelItem(kids, pk); /* its only child: gone first, as a rule */
    Py_ssize_t n = PyList_GET_SIZE(c);
    for (Py_ssize_t i = 0; i < n; i++) {
        int eq = PyObject_RichCompareBool(PyList_GET_ITEM(c, i), b, Py_EQ);
        if (eq < 0) return -1;
        if (!eq) continue;
        if (PyList_SetSlice(c, i, i + 1, NULL) < 0) return -1;
        return n == 2 ? PyDict_SetItem(kids, pk, PyList_GET_ITEM(c, 0)) : 0;
    }
    PyErr_SetObject(PyExc_ValueError, b);
    return -1;
}

/* insert_keys(lookup, key, state, parent, kids, blocks, keys, parents, cached, drop_key) -> dups */
static PyObject *insert_keys(PyObject *self, PyObject *args) {
    PyObject *lookup, *key, *state, *parent, *kids, *blocks, *keys, *parents, *drop_key;
    long cached;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!lO", &PyDict_Type, &lookup, &PyList_Type, &key, &PyList_Type, &state,
                          &PyList_Type, &parent, &PyDict_Type, &kids, &PyList_Type, &blocks, &PyList_Type, &keys,
                          &PyList_Type, &parents, &cached, &drop_key))
        return NULL;
    if (!plain(lookup, kids)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    if (PyList_GET_SIZE(keys) != n || PyList_GET_SIZE(parents) != n) {
        PyErr_Format(PyExc_ValueError, "insert_keys: %zd blocks, %zd keys, %zd parents", n, PyList_GET_SIZE(keys),
                     PyList_GET_SIZE(parents));
        return NULL;
    }
    PyObject *dups = PyList_New(0);
    if (dups == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i), *k = PyList_GET_ITEM(keys, i), *pk = PyList_GET_ITEM(parents, i);
        Py_ssize_t bi;
        if (at(key, b, &bi) == NULL) goto fail;
        PyObject *holder = PyDict_SetDefault(lookup, k, b); /* borrowed: inserted, or another block has k */
        if (holder == NULL) goto fail;
        if (holder != b) {
            Py_ssize_t hi;
            PyObject *hs = at(state, holder, &hi);
            if (hs == NULL) goto fail;
            long st = PyLong_AsLong(hs);
            if (st == -1 && PyErr_Occurred()) goto fail;
            if (st != cached) {
                PyObject *pos = PyLong_FromSsize_t(i);
                if (pos == NULL || PyList_Append(dups, pos) < 0) {
                    Py_XDECREF(pos);
                    goto fail;
                }
                Py_DECREF(pos);
                continue;
            }
            Py_INCREF(holder); /* drop_key removes it from lookup */
            PyObject *r = PyObject_CallOneArg(drop_key, holder);
            Py_DECREF(holder);
            if (r == NULL) goto fail;
            Py_DECREF(r);
            if (PyDict_SetItem(lookup, k, b) < 0) goto fail;
        }
        if (set_at(key, bi, k) < 0) goto fail;
        if (pk != Py_None) {
            if (set_at(parent, bi, pk) < 0) goto fail;
            if (add_child(kids, pk, b) < 0) goto fail;
        }
    }
    return dups;
fail:
    Py_DECREF(dups);
    return NULL;
}

/* release_blocks(ref, state, key, blocks, keep, cached, allocated, cached_state, release): the
 * common case, the last holder of a keyed ALLOCATED block letting go (keep), turns it CACHED and
 * appends it to `cached` (the caller queues them, also after an error); the rest go to
 * release(block, keep), in order. */
static PyObject *release_blocks(PyObject *self, PyObject *args) {
    PyObject *ref, *state, *key, *blocks, *cached, *cached_state, *release;
    int keep;
    long allocated;
    if (!PyArg_ParseTuple(args, "O!O!O!O!pO!lOO", &PyList_Type, &ref, &PyList_Type, &state, &PyList_Type, &key,
                          &PyList_Type, &blocks, &keep, &PyList_Type, &cached, &allocated, &cached_state, &release))
        return NULL;
    PyObject *keep_obj = keep ? Py_True : Py_False;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        Py_ssize_t bi;
        PyObject *rc = at(ref, b, &bi);
        if (rc == NULL) return NULL;
        long r = PyLong_AsLong(rc);
        if (r == -1 && PyErr_Occurred()) return NULL;
        r -= 1;
        if (r > 0) {
            PyObject *nr = PyLong_FromLong(r);
            if (nr == NULL) return NULL;
            if (PyList_SetItem(ref, bi, nr) < 0) return NULL;
            continue;
        }
        if (r == 0 && keep && PyList_GET_ITEM(key, bi) != Py_None) {
            long st = PyLong_AsLong(PyList_GET_ITEM(state, bi));
            if (st == -1 && PyErr_Occurred()) return NULL;
            if (st == allocated) {
                PyObject *zero = PyLong_FromLong(0);
                if (zero == NULL) return NULL;
                if (PyList_SetItem(ref, bi, zero) < 0 || set_at(state, bi, cached_state) < 0) return NULL;
                if (PyList_Append(cached, b) < 0) return NULL;
                continue;
            }
        }
        PyObject *res = PyObject_CallFunctionObjArgs(release, b, keep_obj, NULL); /* never queues a block */
        if (res == NULL) return NULL;
        Py_DECREF(res);
    }
    Py_RETURN_NONE;
}

/* evict_batch(batch, key, lookup, parent, kids, out, evicted, queue, skips) -> (skips, passed, forced):
 * one batch the eviction queue dequeued. A block whose key has children listed goes back to the
 * queue (queue.requeue) while fewer than a whole turn of the queue were passed over (`skips`),
 * else it is evicted anyway (forced); the others are unkeyed, appended to `out`, and reported as
 * (block, key) to `evicted` (None: not reported). */
static PyObject *evict_batch(PyObject *self, PyObject *args) {
    PyObject *batch, *key, *lookup, *parent, *kids, *out, *evicted, *queue;
    Py_ssize_t skips, passed = 0, forced = 0;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!OOn", &PyList_Type, &batch, &PyList_Type, &key, &PyDict_Type, &lookup,
                          &PyList_Type, &parent, &PyDict_Type, &kids, &PyList_Type, &out, &evicted, &queue, &skips))
        return NULL;
    if (evicted != Py_None && !PyList_Check(evicted)) {
        PyErr_SetString(PyExc_TypeError, "evict_batch: evicted must be a list or None");
        return NULL;
    }
    if (!plain(lookup, kids)) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(batch); i++) {
        PyObject *b = PyList_GET_ITEM(batch, i);
        Py_ssize_t bi;
        PyObject *k = at(key, b, &bi);
        if (k == NULL) return NULL;
        int has_kids = PyDict_Contains(kids, k);
        if (has_kids < 0) return NULL;
        if (has_kids) {
            Py_ssize_t queued = PyObject_Length(queue);
            if (queued < 0) return NULL;
            if (skips <= queued) { /* behind its children: they go first */
                PyObject *r = PyObject_CallMethod(queue, "requeue", "O", b);
                if (r == NULL) return NULL;
                Py_DECREF(r);
                skips++;
                passed++;
                continue;
            }
            forced++;
        }
        skips = 0;
        Py_INCREF(k);
        if (PyDict_DelItem(lookup, k) < 0 || set_at(key, bi, Py_None) < 0) goto fail_k;
        PyObject *pk = PyList_GET_ITEM(parent, bi);
        if (pk != Py_None) {
            Py_INCREF(pk);
            int rc = set_at(parent, bi, Py_None);
            if (rc == 0) rc = drop_child(kids, pk, b);
            Py_DECREF(pk);
            if (rc < 0) goto fail_k;
        }
        if (PyList_Append(out, b) < 0) goto fail_k;
        if (evicted != Py_None) {
            PyObject *pair = PyTuple_Pack(2, b, k);
            if (pair == NULL || PyList_Append(evicted, pair) < 0) {
                Py_XDECREF(pair);
                goto fail_k;
            }
            Py_DECREF(pair);
        }
        Py_DECREF(k);
        continue;
    fail_k:
        Py_DECREF(k);
        return NULL;
    }
    return Py_BuildValue("nnn", skips, passed, forced);
}

/* LRU queue links (fastkv/cache/eviction/lru.py: a doubly linked list over the lists `nxt` and
 * `prv`, indexed by block id, with `sentinel` at index capacity; -1 marks a block not queued).
 * lru_popleft(nxt, prv, sentinel, n) unlinks the n oldest blocks and returns them, oldest first;
 * lru_extend(nxt, prv, sentinel, blocks) links `blocks` in order as the newest. */
static PyObject *lru_popleft(PyObject *self, PyObject *args) {
    PyObject *nxt, *prv, *s;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "O!O!On", &PyList_Type, &nxt, &PyList_Type, &prv, &s, &n)) return NULL;
    PyObject *none = PyLong_FromLong(-1), *out = PyList_New(n < 0 ? 0 : n), *block = NULL;
    Py_ssize_t si, bi;
    if (none == NULL || out == NULL || (block = at(nxt, s, &si)) == NULL) goto fail;
    Py_INCREF(block); /* owned from here on: unlinking drops the lists' references */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *after = at(nxt, block, &bi);
        if (after == NULL) goto fail;
        Py_INCREF(after);
        PyList_SET_ITEM(out, i, block); /* takes our reference */
        block = after;
        if (set_at(nxt, bi, none) < 0 || set_at(prv, bi, none) < 0) goto fail;
    }
    if (set_at(nxt, si, block) < 0 || at(prv, block, &bi) == NULL || set_at(prv, bi, s) < 0) goto fail;
    Py_DECREF(block);
    Py_DECREF(none);
    return out;
fail:
    Py_XDECREF(block);
    Py_XDECREF(none);
    Py_XDECREF(out);
    return NULL;
}

static PyObject *lru_extend(PyObject *self, PyObject *args) {
    PyObject *nxt, *prv, *s, *blocks;
    if (!PyArg_ParseTuple(args, "O!O!OO!", &PyList_Type, &nxt, &PyList_Type, &prv, &s, &PyList_Type, &blocks))
        return NULL;
    Py_ssize_t si, li, bi;
    if (at(prv, s, &si) == NULL) return NULL;
    PyObject *last = PyList_GET_ITEM(prv, si);
    Py_INCREF(last);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        if (at(nxt, last, &li) == NULL || at(prv, b, &bi) == NULL || set_at(nxt, li, b) < 0 || set_at(prv, bi, last) < 0) {
            Py_DECREF(last);
            return NULL;
        }
        Py_INCREF(b);
        Py_SETREF(last, b);
    }
    int rc = at(nxt, last, &li) == NULL || set_at(nxt, li, s) < 0 || set_at(prv, si, last) < 0;
    Py_DECREF(last);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"lru_popleft", lru_popleft, METH_VARARGS, "lru_popleft(nxt, prv, sentinel, n) -> list[int]"},
    {"lru_extend", lru_extend, METH_VARARGS, "lru_extend(nxt, prv, sentinel, blocks) -> None"},
    {"evict_batch", evict_batch, METH_VARARGS,
     "evict_batch(batch, key, lookup, parent, kids, out, evicted, queue, skips) -> (skips, passed, forced)"},
    {"insert_keys", insert_keys, METH_VARARGS,
     "insert_keys(lookup, key, state, parent, kids, blocks, keys, parents, cached, drop_key) -> list[int]"},
    {"release_blocks", release_blocks, METH_VARARGS,
     "release_blocks(ref, state, key, blocks, keep, cached, allocated, cached_state, release) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pool", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pool(void) { return PyModule_Create(&module); }
