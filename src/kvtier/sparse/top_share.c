/* Each row's `count` largest scores, as ascending indices, in one call (top_share.py).

   numpy had to partition the indices (argpartition) and then sort the chosen
   ones back into order, two passes that cost three times this
   (docs/decisions.md). Here each row's count-th largest value is found by a
   selection over a copy of the row's values, and one scan in index order then
   takes every score above it, and of those equal to it the first ones, so the
   indices come out ascending with no sort and ties go to the lowest index.
   NaN ranks below every number. The GIL is released while it runs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* The k-th largest (k from 0) of values[0..n), which it reorders: Hoare's selection with a middle pivot. */
static float kth_largest(float *values, Py_ssize_t n, Py_ssize_t k) {
    Py_ssize_t low = 0, high = n - 1;
    while (low < high) {
        float pivot = values[low + (high - low) / 2];
        Py_ssize_t i = low, j = high;
        while (i <= j) {
            while (values[i] > pivot)
                i++;
            while (values[j] < pivot)
                j--;
            if (i <= j) {
                float swap = values[i];
                values[i++] = values[j];
                values[j--] = swap;
            }
        }
        if (k <= j)
            high = j;
        else if (k >= i)
            low = i;
        else
            return values[k];  /* between the two runs: equal to the pivot */
    }
    return values[k];
}

static inline float ranked(float value) {
    return isnan(value) ? -INFINITY : value;  /* NaN would stall the selection's scans: rank it lowest */
}

/* The scans decide per score whether to take it; about half are taken, so they are written without branches (a
   mispredicted branch per score cost more than the selection). */
static void top_rows(const float *scores, Py_ssize_t rows, Py_ssize_t n, Py_ssize_t count, float *scratch,
                     int64_t *out) {
    for (Py_ssize_t row = 0; row < rows; row++) {
        const float *values = scores + row * n;
        for (Py_ssize_t i = 0; i < n; i++)
            scratch[i] = ranked(values[i]);
        float threshold = kth_largest(scratch, n, count - 1);
        Py_ssize_t above = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            above += ranked(values[i]) > threshold;
        Py_ssize_t ties = count - above, taken = 0;  /* how many scores equal to the threshold make the count */
        int64_t *chosen = out + row * count;
        for (Py_ssize_t i = 0; i < n && taken < count; i++) {
            float value = ranked(values[i]);
            Py_ssize_t tie = (value == threshold) & (ties > 0);
            chosen[taken] = i;  /* kept only if taken moves on; taken < count here, so the write stays in the row */
            taken += (value > threshold) | tie;
            ties -= tie;
        }
    }
}

static PyObject *top_share(PyObject *self, PyObject *args) {
    Py_buffer scores, out;
    Py_ssize_t rows, n, count;
    if (!PyArg_ParseTuple(args, "y*w*nnn", &scores, &out, &rows, &n, &count))
        return NULL;
    PyObject *result = NULL;
    float *scratch = NULL;
    if (rows < 0 || count < 1 || count > n) {
        PyErr_SetString(PyExc_ValueError, "bad shape: need rows >= 0 and 1 <= count <= n");
    } else if ((size_t)scores.len != (size_t)(rows * n) * sizeof(float)
               || (size_t)out.len != (size_t)(rows * count) * sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "a buffer's size does not match the shape");
    } else if ((scratch = malloc((size_t)n * sizeof(float))) == NULL) {
        PyErr_NoMemory();
    } else {
        Py_BEGIN_ALLOW_THREADS
        top_rows((const float *)scores.buf, rows, n, count, scratch, (int64_t *)out.buf);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    free(scratch);
    PyBuffer_Release(&scores);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"top_share", top_share, METH_VARARGS,
     "top_share(scores, out, rows, n, count): out (int64 [rows, count]) = the indices of each row's count largest "
     "scores (float32 [rows, n]), ascending; among equal scores the lowest indices; NaN ranks lowest."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_top_share", NULL, -1, methods};

PyMODINIT_FUNC PyInit__top_share(void) {
    return PyModule_Create(&module);
}
