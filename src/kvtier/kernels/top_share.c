/* Each row's `count` largest scores, as ascending indices, in one call (top_share.py); and the host's split of them
   into hot pool and candidates.

   numpy had to partition the indices (argpartition) and then sort the chosen
   ones back into order, two passes that cost three times this. Here each row's count-th largest value is found by a
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
   as much. `*above`: how many keys are larger than the one returned. */
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
   mispredicted branch per score cost more than the selection). A row's scores are its `first` row's n1 continued by
   its `second` row's n2: the host ranks hot pool and candidates together without joining them first. */
static void top_rows(const float *first, Py_ssize_t n1, const float *second, Py_ssize_t n2, Py_ssize_t rows,
                     Py_ssize_t count, uint32_t *scratch, int64_t *out) {
    Py_ssize_t n = n1 + n2;
    uint32_t *keys = scratch, *work = scratch + n, *spare = scratch + 2 * n;
    for (Py_ssize_t row = 0; row < rows; row++) {
        for (Py_ssize_t i = 0; i < n1; i++)
            keys[i] = order_key(first[row * n1 + i]);
        for (Py_ssize_t i = 0; i < n2; i++)
            keys[n1 + i] = order_key(second[row * n2 + i]);
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
    Py_buffer first, second, out;
    Py_ssize_t rows, n1, n2, count;
    if (!PyArg_ParseTuple(args, "y*y*w*nnnn", &first, &second, &out, &rows, &n1, &n2, &count))
        return NULL;
    PyObject *result = NULL;
    uint32_t *scratch = NULL;
    if (rows < 0 || n1 < 0 || n2 < 0 || count < 1 || count > n1 + n2) {
        PyErr_SetString(PyExc_ValueError, "bad shape: need rows, n1, n2 >= 0 and 1 <= count <= n1 + n2");
    } else if ((size_t)first.len != (size_t)(rows * n1) * sizeof(float)
               || (size_t)second.len != (size_t)(rows * n2) * sizeof(float)
               || (size_t)out.len != (size_t)(rows * count) * sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "a buffer's size does not match the shape");
    } else if ((scratch = malloc(3 * (size_t)(n1 + n2) * sizeof(uint32_t))) == NULL) {
        PyErr_NoMemory();
    } else {
        Py_BEGIN_ALLOW_THREADS
        top_rows((const float *)first.buf, n1, (const float *)second.buf, n2, rows, count, scratch,
                 (int64_t *)out.buf);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    free(scratch);
    PyBuffer_Release(&first);
    PyBuffer_Release(&second);
    PyBuffer_Release(&out);
    return result;
}

/* The chosen indices of each row split at n1: their positions (out of first_positions, row stride `stride`, for
   those below n1, else out of second_positions), those below n1 again (then zeros: a padded index), how many lie
   below n1, and which of the second's were chosen. */
static void split_rows(const int64_t *chosen, Py_ssize_t rows, Py_ssize_t count, Py_ssize_t n1, Py_ssize_t n2,
                       const int64_t *first_positions, Py_ssize_t stride, const int64_t *second_positions,
                       int64_t *positions, int64_t *first_indices, int64_t *first_counts, uint8_t *second_chosen) {
    memset(second_chosen, 0, (size_t)(rows * n2));
    memset(first_indices, 0, (size_t)(rows * count) * sizeof(int64_t));
    for (Py_ssize_t row = 0; row < rows; row++) {
        const int64_t *indices = chosen + row * count;
        int64_t *row_positions = positions + row * count;
        Py_ssize_t j = 0;
        for (; j < count && indices[j] < n1; j++) {  /* ascending: the first's come first */
            row_positions[j] = first_positions[row * stride + indices[j]];
            first_indices[row * count + j] = indices[j];
        }
        first_counts[row] = j;
        for (; j < count; j++) {
            Py_ssize_t i = indices[j] - n1;
            row_positions[j] = second_positions[row * n2 + i];
            second_chosen[row * n2 + i] = 1;
        }
    }
}

/* Whether each row's indices ascend and lie within [0, n1 + n2). */
static int indices_valid(const int64_t *chosen, Py_ssize_t rows, Py_ssize_t count, Py_ssize_t n) {
    for (Py_ssize_t row = 0; row < rows; row++)
        for (Py_ssize_t j = 0; j < count; j++) {
            int64_t index = chosen[row * count + j];
            if (index < 0 || index >= n || (j && index <= chosen[row * count + j - 1]))
                return 0;
        }
    return 1;
}

static PyObject *split(PyObject *self, PyObject *args) {
    Py_buffer chosen, first_positions, second_positions, positions, first_indices, first_counts, second_chosen;
    Py_ssize_t rows, count, n1, n2, stride;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*w*w*nnnnn", &chosen, &first_positions, &second_positions, &positions,
                          &first_indices, &first_counts, &second_chosen, &rows, &count, &n1, &n2, &stride))
        return NULL;
    PyObject *result = NULL;
    if (rows < 0 || count < 0 || n1 < 0 || n2 < 0 || stride < n1) {
        PyErr_SetString(PyExc_ValueError, "bad shape: need rows, count, n1, n2 >= 0 and stride >= n1");
    } else if ((size_t)chosen.len != (size_t)(rows * count) * sizeof(int64_t)
               || (rows && (size_t)first_positions.len < (size_t)((rows - 1) * stride + n1) * sizeof(int64_t))
               || (size_t)second_positions.len != (size_t)(rows * n2) * sizeof(int64_t)
               || (size_t)positions.len != (size_t)(rows * count) * sizeof(int64_t)
               || (size_t)first_indices.len != (size_t)(rows * count) * sizeof(int64_t)
               || (size_t)first_counts.len != (size_t)rows * sizeof(int64_t)
               || (size_t)second_chosen.len != (size_t)(rows * n2)) {
        PyErr_SetString(PyExc_ValueError, "a buffer's size does not match the shape");
    } else if (!indices_valid((const int64_t *)chosen.buf, rows, count, n1 + n2)) {
        PyErr_SetString(PyExc_ValueError, "chosen indices must ascend within each row and lie below n1 + n2");
    } else {
        split_rows((const int64_t *)chosen.buf, rows, count, n1, n2, (const int64_t *)first_positions.buf, stride,
                   (const int64_t *)second_positions.buf, (int64_t *)positions.buf, (int64_t *)first_indices.buf,
                   (int64_t *)first_counts.buf, (uint8_t *)second_chosen.buf);
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&chosen);
    PyBuffer_Release(&first_positions);
    PyBuffer_Release(&second_positions);
    PyBuffer_Release(&positions);
    PyBuffer_Release(&first_indices);
    PyBuffer_Release(&first_counts);
    PyBuffer_Release(&second_chosen);
    return result;
}

static PyMethodDef methods[] = {
    {"top_share", top_share, METH_VARARGS,
     "top_share(first, second, out, rows, n1, n2, count): out (int64 [rows, count]) = the indices of each row's count "
     "largest scores, ascending, a row being first's (float32 [rows, n1]) continued by second's (float32 [rows, n2]); "
     "among equal scores the lowest indices; NaN ranks lowest."},
    {"split", split, METH_VARARGS,
     "split(chosen, first_positions, second_positions, positions, first_indices, first_counts, second_chosen, rows, "
     "count, n1, n2, stride): for top_share's chosen (int64 [rows, count]), positions (int64 [rows, count]) = "
     "first_positions[row, i] (int64, row stride `stride`) for i < n1, else second_positions[row, i - n1] (int64 "
     "[rows, n2]); first_indices (int64 [rows, count]) = the chosen below n1, then 0; first_counts (int64 [rows]) = "
     "how many are below n1; second_chosen (uint8 [rows, n2]) = 1 where chosen."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_top_share", NULL, -1, methods};

PyMODINIT_FUNC PyInit__top_share(void) {
    return PyModule_Create(&module);
}
