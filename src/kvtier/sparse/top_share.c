/* Each row's `count` largest scores, as ascending indices, in one call (top_share.py).

   numpy had to partition the indices (argpartition) and then sort the chosen
   ones back into order, two passes that cost three times this
   (docs/decisions.md). Here each row's count-th largest value is found by a
   radix selection over the scores' order-preserving integer keys, and one scan
   in index order then takes every score above it, and of those equal to it the
   first ones, so the indices come out ascending with no sort and ties go to the
   lowest index. NaN ranks below every number, -0 equals +0. The GIL is released
   while it runs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DIGIT_BITS 11  /* three passes of 11, 11 and 10 bits cover a key; 2,048 counters stay in L1 */

/* A key whose unsigned order is the scores' order: NaN as -inf (ranked lowest), -0 as +0 (equal, as floats are). */
static inline uint32_t order_key(float value) {
    float ranked = isnan(value) ? -INFINITY : value + 0.0f;  /* -0 + 0 is +0 */
    uint32_t bits;
    memcpy(&bits, &ranked, sizeof bits);
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

/* The key of the rank-th largest (from 0) of keys[0..n), digit by digit from the top: each pass counts the digits,
   finds the digit holding that rank and keeps only the keys that share it, in `work` and `spare` by turns. Branch-free
   passes: a comparison-based selection, whose partition branches go either way on these scores, cost several times
   as much (docs/decisions.md). `*above`: how many keys are larger than the one returned. */
static uint32_t kth_largest_key(const uint32_t *keys, uint32_t *work, uint32_t *spare, Py_ssize_t n, Py_ssize_t rank,
                                Py_ssize_t *above) {
    uint32_t counts[1 << DIGIT_BITS];
    const uint32_t *source = keys;
    Py_ssize_t skipped = 0;
    for (int shift = 32 - DIGIT_BITS; n > 1; shift -= DIGIT_BITS) {
        int low = shift > 0 ? shift : 0, bits = shift > 0 ? DIGIT_BITS : DIGIT_BITS + shift;
        uint32_t mask = (1u << bits) - 1;
        memset(counts, 0, sizeof(uint32_t) << bits);
        for (Py_ssize_t i = 0; i < n; i++)
            counts[(source[i] >> low) & mask]++;
        uint32_t digit = mask;
        for (; (Py_ssize_t)counts[digit] <= rank; digit--) {  /* the digits above: every key in them is larger */
            rank -= counts[digit];
            skipped += counts[digit];
        }
        Py_ssize_t kept = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            work[kept] = source[i];
            kept += ((source[i] >> low) & mask) == digit;
        }
        uint32_t *filled = work;
        work = spare;
        spare = filled;
        source = filled;
        n = kept;
        if (low == 0)
            break;  /* every key left equals the answer */
    }
    *above = skipped;
    return source[0];
}

/* The take scan decides per score whether to take it; about half are taken, so it is written without branches (a
   mispredicted branch per score cost more than the selection). */
static void top_rows(const float *scores, Py_ssize_t rows, Py_ssize_t n, Py_ssize_t count, uint32_t *scratch,
                     int64_t *out) {
    uint32_t *keys = scratch, *work = scratch + n, *spare = scratch + 2 * n;
    for (Py_ssize_t row = 0; row < rows; row++) {
        const float *values = scores + row * n;
        for (Py_ssize_t i = 0; i < n; i++)
            keys[i] = order_key(values[i]);
        Py_ssize_t above;
        uint32_t threshold = kth_largest_key(keys, work, spare, n, count - 1, &above);
        Py_ssize_t ties = count - above, taken = 0;  /* how many scores equal to the threshold make the count */
        int64_t *chosen = out + row * count;
        for (Py_ssize_t i = 0; i < n && taken < count; i++) {
            Py_ssize_t tie = (keys[i] == threshold) & (ties > 0);
            chosen[taken] = i;  /* kept only if taken moves on; taken < count here, so the write stays in the row */
            taken += (keys[i] > threshold) | tie;
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
    uint32_t *scratch = NULL;
    if (rows < 0 || count < 1 || count > n) {
        PyErr_SetString(PyExc_ValueError, "bad shape: need rows >= 0 and 1 <= count <= n");
    } else if ((size_t)scores.len != (size_t)(rows * n) * sizeof(float)
               || (size_t)out.len != (size_t)(rows * count) * sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "a buffer's size does not match the shape");
    } else if ((scratch = malloc(3 * (size_t)n * sizeof(uint32_t))) == NULL) {
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
