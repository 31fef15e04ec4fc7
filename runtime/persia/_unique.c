/*
 * persia._unique: the distinct values of a uint64 array, sorted, and where each element is among
 * them: what np.unique(values, return_inverse=True) returns, computed by hashing instead of by
 * sorting every element. The embedding worker dedups each batch's IDs this way (a batch of 256
 * samples x 26 slots holds 6,656 IDs and about 2,500 distinct ones): only the distinct values are
 * sorted. Wrapped by persia/unique.py, which keeps numpy as the fallback and the reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EMPTY (-1)

static inline uint64_t mix(uint64_t x)
{ /* splitmix64's finaliser: every input bit reaches the low bits the table indexes by */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* LSD radix sort of (key, tag) pairs by key, 8 bits a pass; a pass whose byte is the same in
 * every key is skipped. Stable; tmp_* hold n pairs of scratch. */
static void radix_sort(uint64_t *key, int32_t *tag, uint64_t *tmp_key, int32_t *tmp_tag, Py_ssize_t n)
{
    for (int shift = 0; shift < 64; shift += 8) {
        Py_ssize_t count[257];
        memset(count, 0, sizeof count);
        for (Py_ssize_t i = 0; i < n; i++)
            count[((key[i] >> shift) & 0xff) + 1]++;
        if (count[((key[0] >> shift) & 0xff) + 1] == n)
            continue;
        for (int b = 0; b < 256; b++)
            count[b + 1] += count[b];
        for (Py_ssize_t i = 0; i < n; i++) {
            const Py_ssize_t at = count[(key[i] >> shift) & 0xff]++;
            tmp_key[at] = key[i];
            tmp_tag[at] = tag[i];
        }
        uint64_t *k = key;
        int32_t *t = tag;
        memcpy(k, tmp_key, (size_t)n * sizeof *k);
        memcpy(t, tmp_tag, (size_t)n * sizeof *t);
    }
}

/* Returns the number of distinct values, or -1 when memory ran out. */
static Py_ssize_t unique_loop(const uint64_t *values, Py_ssize_t n, uint64_t *uniq, int32_t *inverse)
{
    if (n == 0)
        return 0;
    size_t cap = 16;
    while (cap < 2 * (size_t)n)
        cap <<= 1;
    const size_t mask = cap - 1;
    /* one block per call: the roles' allocator keeps it in the heap between batches
     * (persia/allocator.py), so it is not mapped and faulted in again each time */
    char *block = malloc(cap * (sizeof(uint64_t) + sizeof(int32_t))
                         + (size_t)n * (2 * sizeof(uint64_t) + 4 * sizeof(int32_t)));
    if (block == NULL)
        return -1;
    uint64_t *slot_key = (uint64_t *)block;       /* cap */
    uint64_t *dk = slot_key + cap;                /* 2n: distinct keys, then radix scratch */
    int32_t *slot_id = (int32_t *)(dk + 2 * n);   /* cap */
    int32_t *first_id = slot_id + cap;            /* n */
    int32_t *dt = first_id + n;                   /* 2n */
    int32_t *rank = dt + 2 * n;                   /* n */
    memset(slot_id, 0xff, cap * sizeof *slot_id); /* EMPTY */
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint64_t v = values[i];
        size_t h = (size_t)mix(v) & mask;
        while (slot_id[h] != EMPTY && slot_key[h] != v)
            h = (h + 1) & mask;
        if (slot_id[h] == EMPTY) {
            slot_key[h] = v;
            slot_id[h] = (int32_t)k;
            dk[k] = v;
            dt[k] = (int32_t)k;
            k++;
        }
        first_id[i] = slot_id[h];
    }
    radix_sort(dk, dt, dk + n, dt + n, k);
    for (Py_ssize_t p = 0; p < k; p++) {
        uniq[p] = dk[p];
        rank[dt[p]] = (int32_t)p;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        inverse[i] = rank[first_id[i]];
    free(block);
    return k;
}

static int is_format(const Py_buffer *v, char kind, Py_ssize_t itemsize)
{ /* numpy writes uint64 as 'L' or 'Q' and int32 as 'i' or 'l' depending on the platform */
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (v->itemsize != itemsize || f[1] != '\0')
        return 0;
    if (kind == 'u')
        return *f == 'Q' || *f == 'L';
    return *f == 'i' || *f == 'l';
}

PyDoc_STRVAR(unique_inverse_doc,
"unique_inverse(values, uniq, inverse) -> k\n\n"
"values: uint64 (n,); uniq: writable uint64 (n,); inverse: writable int32 (n,), all C-contiguous.\n"
"Writes the k distinct values, ascending, to uniq[:k] and each element's position among them to\n"
"inverse (uniq[inverse] == values), without the GIL.");

static PyObject *unique_inverse(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "OOO", &objs[0], &objs[1], &objs[2]))
        return NULL;
    static const char *names[3] = {"values", "uniq", "inverse"};
    static const char kinds[3] = {'u', 'u', 'i'};
    static const Py_ssize_t sizes[3] = {8, 8, 4};
    Py_buffer v[3];
    int held = 0;
    PyObject *result = NULL;
    for (; held < 3; held++) {
        const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (held ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[held], &v[held], flags) != 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s 1-D array of %s, got %R", names[held],
                         held ? " writable" : "", kinds[held] == 'u' ? "uint64" : "int32", Py_TYPE(objs[held]));
            goto done;
        }
        if (v[held].ndim != 1 || !is_format(&v[held], kinds[held], sizes[held])) {
            PyErr_Format(PyExc_ValueError, "%s must be a 1-D array of %s, got %zd-D of format '%s'", names[held],
                         kinds[held] == 'u' ? "uint64" : "int32", (Py_ssize_t)v[held].ndim,
                         v[held].format ? v[held].format : "B");
            held++;
            goto done;
        }
    }
    const Py_ssize_t n = v[0].shape[0];
    if (v[1].shape[0] != n || v[2].shape[0] != n) {
        PyErr_Format(PyExc_ValueError, "uniq and inverse must have as many elements as values (%zd), got %zd and %zd",
                     n, v[1].shape[0], v[2].shape[0]);
        goto done;
    }
    if (n > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "values has %zd elements, more than int32 inverse positions can name", n);
        goto done;
    }
    Py_ssize_t k;
    Py_BEGIN_ALLOW_THREADS
    k = unique_loop(v[0].buf, n, v[1].buf, v[2].buf);
    Py_END_ALLOW_THREADS
    result = k < 0 ? PyErr_NoMemory() : PyLong_FromSsize_t(k);
done:
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&v[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"unique_inverse", unique_inverse, METH_VARARGS, unique_inverse_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_unique", NULL, -1, methods};

PyMODINIT_FUNC PyInit__unique(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "ABI", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
