/* The exact index's per-block loops, compiled: router.kv._kvindex.
 *
 * Owns `chain_keys`, `store_blocks`, `remove_blocks`, `walk_keys` and `claim_keys`, the compiled twins of the functions of
 * the same names in router/kv/index_ops.py (the pure-Python fallback, which documents what each
 * does); router/kv/index_ops.py selects one or the other at import and checks this module's keys
 * against Python's own hash first. Called by router.kv.exact_index.ExactIndex (apply, expect, match) and
 * router.kv.prompt_keys.prompt_keys. Built by the package's own build (pyproject.toml,
 * [tool.setuptools] ext-modules, optional: without a compiler the pure-Python twins run).
 *
 * Keys are Python's hash of a (parent key, block token ids) tuple, computed here as CPython 3.11+
 * computes it (Objects/tupleobject.c `tuplehash`: xxHash's lanes over the items' hashes;
 * Objects/longobject.c `long_hash`: an int modulo 2**61 - 1, its sign kept, -1 made -2), without
 * building the tuples. Masks and keys stay Python ints in the caller's dicts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define XXROTATE(x) (((x) << 31) | ((x) >> 33))
#define HASH_MODULUS ((Py_uhash_t)2305843009213693951ULL) /* 2**61 - 1: sys.hash_info.modulus, checked at import */

static PyObject *str_pop, *str_move_to_end, *tail8, *from_bytes, *str_big, *zero;

/* hash(int(x)) of a value that is itself a hash (a chained key). */
static Py_hash_t int_hash(Py_hash_t x) {
    Py_uhash_t u = x < 0 ? (Py_uhash_t)0 - (Py_uhash_t)x : (Py_uhash_t)x;
    Py_hash_t h = (Py_hash_t)(u % HASH_MODULUS);
    if (x < 0) h = -h;
    return h == -1 ? -2 : h;
}

/* hash((parent, tuple(items[0:n]))) from the parent's own hash value. -1 with an error set. */
static Py_hash_t pair_hash(Py_hash_t parent_lane, PyObject **items, Py_ssize_t n) {
    Py_uhash_t inner = XXPRIME_5;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_uhash_t lane = (Py_uhash_t)PyObject_Hash(items[i]);
        if (lane == (Py_uhash_t)-1) return -1;
        inner += lane * XXPRIME_2;
        inner = XXROTATE(inner);
        inner *= XXPRIME_1;
    }
    inner += (Py_uhash_t)n ^ (XXPRIME_5 ^ 3527539UL);
    if (inner == (Py_uhash_t)-1) inner = 1546275796;
    Py_uhash_t acc = XXPRIME_5;
    Py_uhash_t lanes[2] = {(Py_uhash_t)parent_lane, inner};
    for (int i = 0; i < 2; i++) {
        acc += lanes[i] * XXPRIME_2;
        acc = XXROTATE(acc);
        acc *= XXPRIME_1;
    }
    acc += (Py_uhash_t)2 ^ (XXPRIME_5 ^ 3527539UL);
    if (acc == (Py_uhash_t)-1) return 1546275796;
    return (Py_hash_t)acc;
}

static PyObject *chain_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "chain_keys(key, token_ids, block_tokens, count) takes 4 arguments");
        return NULL;
    }
    Py_ssize_t size = PyLong_AsSsize_t(args[2]);
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    if ((size == -1 || count == -1) && PyErr_Occurred()) return NULL;
    if (size < 1 || count < 0) {
        PyErr_Format(PyExc_ValueError, "block_tokens must be >= 1 and count >= 0, got %zd and %zd", size, count);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "token_ids must be a sequence");
    if (seq == NULL) return NULL;
    PyObject *out = NULL;
    if (count > PySequence_Fast_GET_SIZE(seq) / size) {
        PyErr_Format(PyExc_ValueError, "token_ids hold %zd tokens, fewer than %zd blocks of %zd",
                     PySequence_Fast_GET_SIZE(seq), count, size);
        goto done;
    }
    Py_hash_t lane = PyObject_Hash(args[0]);
    if (lane == -1) goto done;
    out = PyList_New(count);
    if (out == NULL) goto done;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t b = 0; b < count; b++) {
        Py_hash_t key = pair_hash(lane, items + b * size, size);
        if (key == -1 && PyErr_Occurred()) { Py_CLEAR(out); goto done; }
        PyObject *k = PyLong_FromSsize_t(key);
        if (k == NULL) { Py_CLEAR(out); goto done; }
        PyList_SET_ITEM(out, b, k);
        lane = int_hash(key);
    }
done:
    Py_DECREF(seq);
    return out;
}

/* The index's key of an engine hash (router.kv.exact_index.engine_hash): an int as it is, bytes
 * as their low 64 bits. New reference, or NULL with an error set. */
static PyObject *engine_hash(PyObject *h) {
    if (PyLong_CheckExact(h)) return Py_NewRef(h);
    if (PyBytes_CheckExact(h)) {
        Py_ssize_t n = PyBytes_GET_SIZE(h);
        const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(h);
        unsigned long long v = 0;
        for (Py_ssize_t i = n > 8 ? n - 8 : 0; i < n; i++) v = (v << 8) | p[i];
        return PyLong_FromUnsignedLongLong(v);
    }
    PyObject *tail = PyObject_GetItem(h, tail8);   /* anything else as Python reads it: int.from_bytes(h[-8:], "big") */
    if (tail == NULL) return NULL;
    PyObject *v = PyObject_CallFunctionObjArgs(from_bytes, tail, str_big, NULL);
    Py_DECREF(tail);
    return v;
}

/* holders[key] = holders.get(key, 0) | bit. 0 or -1. */
static int add_holder(PyObject *holders, PyObject *key, PyObject *bit) {
    PyObject *mask = PyDict_GetItemWithError(holders, key);
    if (mask == NULL) {
        if (PyErr_Occurred()) return -1;
        return PyDict_SetItem(holders, key, bit);
    }
    PyObject *both = PyNumber_Or(mask, bit);
    if (both == NULL) return -1;
    int rc = PyDict_SetItem(holders, key, both);
    Py_DECREF(both);
    return rc;
}

/* mask = holders.get(key, 0) & keep; holders[key] = mask if mask else dropped. 0 or -1. */
static int keep_holders(PyObject *holders, PyObject *key, PyObject *keep) {
    PyObject *mask = PyDict_GetItemWithError(holders, key);
    if (mask == NULL) return PyErr_Occurred() ? -1 : 0;
    PyObject *left = PyNumber_And(mask, keep);
    if (left == NULL) return -1;
    int truth = PyObject_IsTrue(left);
    int rc = truth < 0 ? -1 : truth ? PyDict_SetItem(holders, key, left) : PyDict_DelItem(holders, key);
    Py_DECREF(left);
    return rc;
}

static int check_dicts(PyObject *blocks, PyObject *holders) {
    if (!PyDict_Check(blocks) || !PyDict_CheckExact(holders)) {
        PyErr_SetString(PyExc_TypeError, "blocks must be an OrderedDict and holders a dict");
        return -1;
    }
    return 0;
}

static PyObject *store_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "store_blocks(blocks, holders, bit, hashes, keys) takes 5 arguments");
        return NULL;
    }
    PyObject *blocks = args[0], *holders = args[1], *bit = args[2];
    if (check_dicts(blocks, holders) < 0) return NULL;
    PyObject *hashes = PySequence_Fast(args[3], "hashes must be a sequence");
    if (hashes == NULL) return NULL;
    PyObject *keys = PySequence_Fast(args[4], "keys must be a sequence");
    PyObject *others = keys == NULL ? NULL : PyNumber_Invert(bit);
    PyObject *result = NULL;
    if (others == NULL) goto done;
    Py_ssize_t n = Py_MIN(PySequence_Fast_GET_SIZE(hashes), PySequence_Fast_GET_SIZE(keys));
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        PyObject *eh = engine_hash(PySequence_Fast_GET_ITEM(hashes, i));
        if (eh == NULL) goto done;
        PyObject *old = PyDict_GetItemWithError(blocks, eh);   /* a read: OrderedDict keeps its order itself */
        int rc;
        if (old == NULL) {
            rc = PyErr_Occurred() ? -1 : PyObject_SetItem(blocks, eh, key);
            if (rc == 0) rc = add_holder(holders, key, bit);
        } else {
            Py_INCREF(old);
            PyObject *moved = PyObject_CallMethodOneArg(blocks, str_move_to_end, eh);
            rc = moved == NULL ? -1 : 0;
            Py_XDECREF(moved);
            int differs = rc == 0 ? PyObject_RichCompareBool(old, key, Py_NE) : 0;
            if (differs < 0) rc = -1;
            else if (differs) {
                rc = keep_holders(holders, old, others);
                if (rc == 0) rc = PyObject_SetItem(blocks, eh, key);
                if (rc == 0) rc = add_holder(holders, key, bit);
            }
            Py_DECREF(old);
        }
        Py_DECREF(eh);
        if (rc < 0) goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(others);
    Py_XDECREF(keys);
    Py_DECREF(hashes);
    return result;
}

static PyObject *remove_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "remove_blocks(blocks, holders, others, hashes) takes 4 arguments");
        return NULL;
    }
    PyObject *blocks = args[0], *holders = args[1], *others = args[2];
    if (check_dicts(blocks, holders) < 0) return NULL;
    PyObject *hashes = PySequence_Fast(args[3], "hashes must be a sequence");
    if (hashes == NULL) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *eh = engine_hash(PySequence_Fast_GET_ITEM(hashes, i));
        if (eh == NULL) goto done;
        int held = PyDict_Contains(blocks, eh);   /* a read first: most removals find their block, some do not */
        PyObject *key = held > 0 ? PyObject_CallMethodObjArgs(blocks, str_pop, eh, Py_None, NULL) : NULL;
        Py_DECREF(eh);
        if (held < 0 || (held > 0 && key == NULL)) goto done;
        int rc = key == NULL || key == Py_None ? 0 : keep_holders(holders, key, others);
        Py_XDECREF(key);
        if (rc < 0) goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(hashes);
    return result;
}

/* holders.get(key, 0) | the bits of expected.get(key, {}) claimed until now_s or later. New reference. */
static PyObject *holders_of(PyObject *holders, PyObject *expected, PyObject *now_s, PyObject *key) {
    PyObject *mask = PyDict_GetItemWithError(holders, key);
    if (mask == NULL) {
        if (PyErr_Occurred()) return NULL;
        mask = zero;
    }
    Py_INCREF(mask);
    PyObject *waiting = expected == NULL ? NULL : PyDict_GetItemWithError(expected, key);
    if (waiting == NULL) {
        if (PyErr_Occurred()) Py_CLEAR(mask);
        return mask;
    }
    if (!PyDict_Check(waiting)) {
        PyErr_SetString(PyExc_TypeError, "expected must map a key to a dict of {bit: until_s}");
        Py_DECREF(mask);
        return NULL;
    }
    Py_INCREF(waiting);   /* comparing floats runs no Python code, but hold it all the same */
    Py_ssize_t pos = 0;
    PyObject *bit, *until_s;
    while (mask != NULL && PyDict_Next(waiting, &pos, &bit, &until_s)) {
        int live = PyObject_RichCompareBool(until_s, now_s, Py_GE);
        PyObject *more = live > 0 ? PyNumber_Or(mask, bit) : NULL;
        Py_SETREF(mask, live < 0 ? NULL : live ? more : Py_NewRef(mask));
    }
    Py_DECREF(waiting);
    return mask;
}

static PyObject *walk_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "walk_keys(holders, expected, now_s, keys, alive) takes 5 arguments");
        return NULL;
    }
    PyObject *holders = args[0], *expected = args[1] == Py_None ? NULL : args[1], *now_s = args[2];
    if (!PyDict_CheckExact(holders) || (expected != NULL && !PyDict_CheckExact(expected))) {
        PyErr_SetString(PyExc_TypeError, "holders must be a dict and expected a dict or None");
        return NULL;
    }
    if (expected != NULL && PyDict_GET_SIZE(expected) == 0) expected = NULL;
    PyObject *keys = PySequence_Fast(args[3], "keys must be a sequence");
    if (keys == NULL) return NULL;
    PyObject *out = PyList_New(0);
    PyObject *alive = Py_NewRef(args[4]);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), depth = 0;
    int truth = out == NULL ? -1 : 1;
    for (Py_ssize_t i = 0; i < n && truth > 0; i++) {
        PyObject *held = holders_of(holders, expected, now_s, PySequence_Fast_GET_ITEM(keys, i));
        PyObject *still = held == NULL ? NULL : PyNumber_And(alive, held);
        Py_XDECREF(held);
        if (still == NULL) { truth = -1; break; }
        if (depth) {
            int same = PyObject_RichCompareBool(still, alive, Py_EQ);
            if (same == 0) {   /* some stop matching here: alive & ~still, which is alive ^ still (still is within alive) */
                PyObject *dropped = PyNumber_Xor(alive, still);
                PyObject *pair = dropped == NULL ? NULL : Py_BuildValue("(nN)", depth, dropped);
                same = pair == NULL || PyList_Append(out, pair) < 0 ? -1 : 1;
                Py_XDECREF(pair);
            }
            if (same < 0) { Py_DECREF(still); truth = -1; break; }
        }
        Py_SETREF(alive, still);
        truth = PyObject_IsTrue(alive);
        if (truth > 0) depth++;
    }
    if (truth > 0 && depth > 0) {   /* matched every key */
        PyObject *pair = Py_BuildValue("(nO)", depth, alive);
        if (pair == NULL || PyList_Append(out, pair) < 0) truth = -1;
        Py_XDECREF(pair);
    }
    Py_DECREF(alive);
    Py_DECREF(keys);
    if (truth < 0) {
        Py_XDECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *claim_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "claim_keys(holders, expected, bit, until_s, keys) takes 5 arguments");
        return NULL;
    }
    PyObject *holders = args[0], *expected = args[1], *bit = args[2], *until_s = args[3];
    if (!PyDict_CheckExact(holders) || !PyDict_CheckExact(expected)) {
        PyErr_SetString(PyExc_TypeError, "holders and expected must be dicts");
        return NULL;
    }
    PyObject *keys = PySequence_Fast(args[4], "keys must be a sequence");
    if (keys == NULL) return NULL;
    PyObject *claimed = PyList_New(0);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    int ok = claimed != NULL;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        PyObject *mask = PyDict_GetItemWithError(holders, key);
        if (mask == NULL && PyErr_Occurred()) { ok = 0; break; }
        if (mask != NULL) {
            PyObject *both = PyNumber_And(mask, bit);
            int held = both == NULL ? -1 : PyObject_IsTrue(both);
            Py_XDECREF(both);
            if (held < 0) { ok = 0; break; }
            if (held) continue;   /* the engine's account already holds it */
        }
        PyObject *waiting = PyDict_GetItemWithError(expected, key);
        if (waiting == NULL) {
            if (PyErr_Occurred()) { ok = 0; break; }
            PyObject *fresh = PyDict_New();
            ok = fresh != NULL && PyDict_SetItem(fresh, bit, until_s) == 0 && PyDict_SetItem(expected, key, fresh) == 0;
            Py_XDECREF(fresh);
        } else {
            if (!PyDict_Check(waiting)) {
                PyErr_SetString(PyExc_TypeError, "expected must map a key to a dict of {bit: until_s}");
                ok = 0;
                break;
            }
            PyObject *before = PyDict_GetItemWithError(waiting, bit);
            if (before == NULL && PyErr_Occurred()) { ok = 0; break; }
            if (before != NULL) {   /* claimed there already: it lasts longer, and is not news */
                int longer = PyObject_RichCompareBool(before, until_s, Py_LT);
                ok = longer >= 0 && (!longer || PyDict_SetItem(waiting, bit, until_s) == 0);
                continue;
            }
            ok = PyDict_SetItem(waiting, bit, until_s) == 0;
        }
        ok = ok && PyList_Append(claimed, key) == 0;
    }
    Py_DECREF(keys);
    if (!ok) {
        Py_XDECREF(claimed);
        return NULL;
    }
    return claimed;
}

static PyMethodDef methods[] = {
    {"chain_keys", (PyCFunction)(void (*)(void))chain_keys, METH_FASTCALL,
     "chain_keys(key, token_ids, block_tokens, count) -> list[int]: router.kv.index_ops.chain_keys, compiled."},
    {"store_blocks", (PyCFunction)(void (*)(void))store_blocks, METH_FASTCALL,
     "store_blocks(blocks, holders, bit, hashes, keys) -> None: router.kv.index_ops.store_blocks, compiled."},
    {"walk_keys", (PyCFunction)(void (*)(void))walk_keys, METH_FASTCALL,
     "walk_keys(holders, expected, now_s, keys, alive) -> list[tuple[int, int]]: router.kv.index_ops.walk_keys, compiled."},
    {"remove_blocks", (PyCFunction)(void (*)(void))remove_blocks, METH_FASTCALL,
     "remove_blocks(blocks, holders, others, hashes) -> None: router.kv.index_ops.remove_blocks, compiled."},
    {"claim_keys", (PyCFunction)(void (*)(void))claim_keys, METH_FASTCALL,
     "claim_keys(holders, expected, bit, until_s, keys) -> list[int]: router.kv.index_ops.claim_keys, compiled."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvindex",
                                    "The exact index's per-block loops, compiled (router/kv/_kvindex.c).", -1, methods};

PyMODINIT_FUNC PyInit__kvindex(void) {
    str_pop = PyUnicode_InternFromString("pop");
    str_move_to_end = PyUnicode_InternFromString("move_to_end");
    str_big = PyUnicode_InternFromString("big");
    zero = PyLong_FromLong(0);
    PyObject *minus8 = PyLong_FromLong(-8);
    tail8 = minus8 == NULL ? NULL : PySlice_New(minus8, Py_None, Py_None);
    Py_XDECREF(minus8);
    from_bytes = PyObject_GetAttrString((PyObject *)&PyLong_Type, "from_bytes");
    if (str_pop == NULL || str_move_to_end == NULL || str_big == NULL || tail8 == NULL || from_bytes == NULL || zero == NULL)
        return NULL;
    return PyModule_Create(&module);
}
