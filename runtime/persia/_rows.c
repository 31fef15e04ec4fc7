/*
 * persia._rows: out[index[i], :] += src[i, :] for i in order, the backward of the NN worker's
 * one-ID slots' gather (the rows a batch looked up, gathered for its 26 slots at once). torch's
 * index_add_ on the CPU runs it through a generic scatter at about 33 ns a 16-float row (0.9 ms a
 * step at batch 1024, MLP 400); a plain loop over rows in L2 takes a few. The order of the
 * additions is index_add_'s with one thread (element i before element i + 1), so the sums are the
 * same floats. Wrapped by persia/nn_worker/row_sums.py, which falls back to index_add_.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int is_format(const Py_buffer *v, char kind, Py_ssize_t itemsize)
{
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (v->itemsize != itemsize || f[1] != '\0')
        return 0;
    if (kind == 'f')
        return *f == 'f';
    return *f == 'q' || *f == 'l'; /* int64 */
}

/* Returns -1 when every index is in [0, rows), else the position of the first that is not
 * (nothing is added then: the indices are checked before the first addition). */
static Py_ssize_t add_rows(float *out, Py_ssize_t rows, const int64_t *index, const float *src, Py_ssize_t n,
                           Py_ssize_t dim)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (index[i] < 0 || index[i] >= rows)
            return i;
    for (Py_ssize_t i = 0; i < n; i++) {
        float *o = out + (size_t)index[i] * (size_t)dim;
        const float *s = src + (size_t)i * (size_t)dim;
        for (Py_ssize_t d = 0; d < dim; d++)
            o[d] += s[d];
    }
    return -1;
}

PyDoc_STRVAR(index_add_rows_doc,
"index_add_rows(out, index, src)\n\n"
"out: writable float32 (rows, dim); index: int64 (n,); src: float32 (n, dim); all C-contiguous.\n"
"Adds src[i] to out[index[i]] for i = 0 .. n - 1 in order, without the GIL. A ValueError names\n"
"an index out of range (nothing is added then).");

static PyObject *index_add_rows(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "OOO", &objs[0], &objs[1], &objs[2]))
        return NULL;
    static const char *names[3] = {"out", "index", "src"};
    static const char kinds[3] = {'f', 'i', 'f'};
    static const int ndims[3] = {2, 1, 2};
    static const char *types[3] = {"2-D float32", "1-D int64", "2-D float32"};
    Py_buffer v[3];
    int held = 0;
    PyObject *result = NULL;
    for (; held < 3; held++) {
        const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (held == 0 ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[held], &v[held], flags) != 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s %s array, got %R", names[held],
                         held == 0 ? " writable" : "", types[held], Py_TYPE(objs[held]));
            goto done;
        }
        if (v[held].ndim != ndims[held] || !is_format(&v[held], kinds[held], kinds[held] == 'f' ? 4 : 8)) {
            PyErr_Format(PyExc_ValueError, "%s must be a %s array, got %zd-D of format '%s'", names[held],
                         types[held], (Py_ssize_t)v[held].ndim, v[held].format ? v[held].format : "B");
            held++;
            goto done;
        }
    }
    const Py_ssize_t rows = v[0].shape[0], dim = v[0].shape[1], n = v[1].shape[0];
    if (v[2].shape[0] != n || v[2].shape[1] != dim) {
        PyErr_Format(PyExc_ValueError, "src must be (%zd, %zd): a row per index, as wide as out; got (%zd, %zd)", n,
                     dim, v[2].shape[0], v[2].shape[1]);
        goto done;
    }
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = add_rows(v[0].buf, rows, v[1].buf, v[2].buf, n, dim);
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "index[%zd] = %lld is not a row of out (0 to %zd)", bad,
                     (long long)((const int64_t *)v[1].buf)[bad], rows - 1);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&v[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"index_add_rows", index_add_rows, METH_VARARGS, index_add_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rows(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "ABI", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
