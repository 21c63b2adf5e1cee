/* The attention's weighted sum over the chosen pooled tokens, read where they lie: in the hot pool, or among the
   cold candidates' records where their reads landed.

   Once a decode step has chosen its tokens and taken the softmax, each source's
   part of the output is sum_j w[g, j] x V[slot_j] per query head g. Copying the
   chosen values out first (index_select) and then multiplying wrote and read
   them again; at batch 8 the hot pool is out of cache and the copy cost more
   than the product, and for the few chosen candidates the copies' per-call
   overhead was the cost (docs/decisions.md). The rows may lie at any strides
   (a token's K|V record holds every head). Here each chosen row is read
   once: rows go in blocks of BLOCK tokens, small enough to stay in L1 while
   every query head of the group and every stretch of the head dimension takes
   them, with one accumulator per (query head, 8 floats) in registers. Values are
   float32 or bfloat16 (a bfloat16 is the top half of a float32). x86-64 with
   AVX2 and FMA only (`vectorized`); elsewhere the layer copies the chosen values
   out as before. The GIL is released while it runs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "avx2_module.h"

#define BLOCK 32     /* chosen rows per block: 8 KiB of float32 values at head_dim 64, in L1 */
#define GROUP_STEP 3 /* query heads a pass serves: 3 x 4 accumulators, 4 value vectors and a weight fit 16 registers */
#define STRETCH 32   /* floats of the head dimension a pass covers: 4 AVX2 vectors */
#define MAX_ACC 8192 /* floats of one head's accumulators (query heads x head_dim), on the stack */

#if defined(__x86_64__)
#include <immintrin.h>

/* acc[g][d .. d + 8 x vectors) += sum over the block's rows of weights[g][j] x row_j[d ..], for `queries` query heads
   (`queries` and `vectors` are constants once inlined). */
__attribute__((target("avx2,fma"), always_inline))
static inline void block_pass(const char *const *rows, int count, const float *weights, Py_ssize_t weight_stride,
                              float *acc, int head_dim, int d, int queries, int vectors, int bf16) {
    __m256 sums[GROUP_STEP][STRETCH / 8];
    for (int g = 0; g < queries; g++)
        for (int v = 0; v < vectors; v++)
            sums[g][v] = _mm256_loadu_ps(acc + (size_t)g * head_dim + d + 8 * v);
    for (int j = 0; j < count; j++) {
        __m256 row[STRETCH / 8];
        for (int v = 0; v < vectors; v++)
            row[v] = eight_floats(rows[j], (size_t)(d + 8 * v), bf16);
        for (int g = 0; g < queries; g++) {
            __m256 w = _mm256_broadcast_ss(weights + (size_t)g * weight_stride + j);
            for (int v = 0; v < vectors; v++)
                sums[g][v] = _mm256_fmadd_ps(w, row[v], sums[g][v]);
        }
    }
    for (int g = 0; g < queries; g++)
        for (int v = 0; v < vectors; v++)
            _mm256_storeu_ps(acc + (size_t)g * head_dim + d + 8 * v, sums[g][v]);
}

/* The passes over one block, with `vectors` value vectors per pass. */
__attribute__((target("avx2,fma"), always_inline))
static inline void block_passes(const char *const *rows, int count, const float *weights, Py_ssize_t weight_stride,
                                float *acc, int group, int head_dim, int vectors, int bf16) {
    for (int d = 0; d < head_dim; d += 8 * vectors)
        for (int g = 0; g < group; g += GROUP_STEP) {
            const float *w = weights + (size_t)g * weight_stride;
            float *a = acc + (size_t)g * head_dim;
            switch (group - g < GROUP_STEP ? group - g : GROUP_STEP) {
                case 1: block_pass(rows, count, w, weight_stride, a, head_dim, d, 1, vectors, bf16); break;
                case 2: block_pass(rows, count, w, weight_stride, a, head_dim, d, 2, vectors, bf16); break;
                default: block_pass(rows, count, w, weight_stride, a, head_dim, d, 3, vectors, bf16);
            }
        }
}

/* Asks for a row of the next block: the rows are scattered over the pool, too sparse a pattern for the prefetchers. */
__attribute__((target("avx2,fma"), always_inline))
static inline void prefetch_row(const char *row, size_t row_bytes) {
    for (size_t line = 0; line < row_bytes; line += 64)
        _mm_prefetch(row + line, _MM_HINT_T0);
}

/* One (sequence, KV head): out[g] = sum_j weights[g][j] x the row of slots[j] over the `count` chosen slots; a slot's
   row starts slot x slot_bytes after `values`. */
__attribute__((target("avx2,fma")))
static void head_sum(const char *values, size_t slot_bytes, const int64_t *slots, Py_ssize_t count,
                     const float *weights, Py_ssize_t weight_stride, float *out, int group, int head_dim, int bf16) {
    size_t row_bytes = (size_t)head_dim * (bf16 ? 2 : 4);
    float acc[MAX_ACC];
    memset(acc, 0, (size_t)group * head_dim * sizeof(float));
    const char *rows[BLOCK];
    int vectors = head_dim % STRETCH == 0 ? STRETCH / 8 : 1;
    for (Py_ssize_t start = 0; start < count; start += BLOCK) {
        int block = count - start < BLOCK ? (int)(count - start) : BLOCK;
        for (int j = 0; j < block; j++)
            rows[j] = values + (size_t)slots[start + j] * slot_bytes;
        for (Py_ssize_t j = start + BLOCK; j < start + 2 * BLOCK && j < count; j++)
            prefetch_row(values + (size_t)slots[j] * slot_bytes, row_bytes);
        const float *w = weights + start;
        if (vectors == STRETCH / 8)
            block_passes(rows, block, w, weight_stride, acc, group, head_dim, STRETCH / 8, bf16);
        else
            block_passes(rows, block, w, weight_stride, acc, group, head_dim, 1, bf16);
    }
    memcpy(out, acc, (size_t)group * head_dim * sizeof(float));
}

/* Every (sequence, KV head); the row of (b, h, slot) starts at element first + b x strides[0] + h x strides[1] +
   slot x strides[2] of `values`. */
static void all_heads(const char *values, const Py_ssize_t *strides, Py_ssize_t first, const int64_t *slots,
                      const int64_t *counts, const float *weights, Py_ssize_t weight_stride, Py_ssize_t weight_start,
                      float *out, int value_bytes, int batch, int heads, int group, Py_ssize_t width, int head_dim) {
    for (int b = 0; b < batch; b++)
        for (int h = 0; h < heads; h++) {
            size_t head = (size_t)b * heads + h;
            const char *rows = values + (size_t)(first + b * strides[0] + h * strides[1]) * value_bytes;
            head_sum(rows, (size_t)strides[2] * value_bytes, slots + (size_t)b * width, counts[b],
                     weights + head * group * weight_stride + weight_start, weight_stride,
                     out + head * group * head_dim, group, head_dim, value_bytes == 2);
        }
}
#endif

static int vectorized = 0;

/* Whether every slot of every sequence lies in the pool and the counts fit the width. */
static int slots_in_pool(const int64_t *slots, const int64_t *counts, int batch, Py_ssize_t width,
                         Py_ssize_t pool_slots) {
    if (!counts_fit(counts, batch, width))
        return 0;
    for (int b = 0; b < batch; b++)
        for (Py_ssize_t j = 0; j < counts[b]; j++)
            if (slots[(size_t)b * width + j] < 0 || slots[(size_t)b * width + j] >= pool_slots)
                return 0;
    return 1;
}

static PyObject *weighted(PyObject *self, PyObject *args) {
    Py_buffer values, slots, counts, weights, out;
    int value_bytes, batch, heads, group, head_dim;
    Py_ssize_t first, strides[3], pool_slots, width, weight_stride, weight_start;
    if (!PyArg_ParseTuple(args, "y*nnnny*y*y*w*iiiinnnni", &values, &first, &strides[0], &strides[1], &strides[2],
                          &slots, &counts, &weights, &out, &value_bytes, &batch, &heads, &group, &pool_slots, &width,
                          &weight_stride, &weight_start, &head_dim))
        return NULL;
    PyObject *result = NULL;
    if (!vectorized) {
        PyErr_SetString(PyExc_RuntimeError, "chosen_values needs an x86-64 CPU with AVX2 and FMA");
    } else if (value_bytes != 2 && value_bytes != 4) {
        PyErr_SetString(PyExc_ValueError, "values must be bfloat16 (2 bytes) or float32 (4 bytes)");
    } else if (batch <= 0 || heads <= 0 || group <= 0 || head_dim <= 0 || head_dim % 8 || pool_slots < 0 || width < 0
               || weight_start < 0 || weight_start + width > weight_stride || (size_t)group * head_dim > MAX_ACC) {
        PyErr_SetString(PyExc_ValueError, "bad shape: need batch, heads, group > 0, head_dim a multiple of 8, "
                        "group x head_dim <= 8192 and the chosen columns within each weight row");
    } else if (first < 0 || strides[0] < 0 || strides[1] < 0 || strides[2] < 0
               || (pool_slots && (first + (batch - 1) * strides[0] + (heads - 1) * strides[1]
                                  + (pool_slots - 1) * strides[2] + head_dim) * value_bytes > values.len)) {
        PyErr_SetString(PyExc_ValueError, "the values' rows do not lie within their buffer");
    } else if ((size_t)slots.len != (size_t)batch * width * sizeof(int64_t)
               || (size_t)counts.len != (size_t)batch * sizeof(int64_t)
               || (size_t)weights.len < (size_t)batch * heads * group * weight_stride * sizeof(float)
               || (size_t)out.len != (size_t)batch * heads * group * head_dim * sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "a buffer's size does not match the shape");
    } else if (!slots_in_pool((const int64_t *)slots.buf, (const int64_t *)counts.buf, batch, width, pool_slots)) {
        PyErr_SetString(PyExc_ValueError, "a chosen slot lies outside the pool, or a count exceeds the width");
    } else {
#if defined(__x86_64__)
        Py_BEGIN_ALLOW_THREADS
        all_heads((const char *)values.buf, strides, first, (const int64_t *)slots.buf, (const int64_t *)counts.buf,
                  (const float *)weights.buf, weight_stride, weight_start, (float *)out.buf, value_bytes, batch, heads,
                  group, width, head_dim);
        Py_END_ALLOW_THREADS
#endif
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&values);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&weights);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"weighted", weighted, METH_VARARGS,
     "weighted(values, first, seq_stride, head_stride, slot_stride, slots, counts, weights, out, value_bytes, batch, "
     "heads, group, pool_slots, width, weight_stride, weight_start, head_dim): out[b, h, g] = sum over j < counts[b] "
     "of weights[b, h, g, weight_start + j] x the row of (b, h, slots[b, j]); values a buffer of bfloat16 bits "
     "(value_bytes 2) or float32 (4) in which the head_dim elements of the row of (b, h, slot) start at element "
     "first + b x seq_stride + h x head_stride + slot x slot_stride, slots int64 [batch, width] (each < pool_slots), "
     "counts int64 [batch], weights float32 [batch, heads, group, weight_stride], out float32 [batch, heads, group, "
     "head_dim]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chosen_values", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chosen_values(void) {
    PyObject *created = create_avx2_module(&module, &vectorized);
    if (created != NULL && PyModule_AddIntConstant(created, "max_accumulators", MAX_ACC) < 0) {
        Py_DECREF(created);
        return NULL;
    }
    return created;
}
