/* The cold candidates' exact q.k and importance, read where their records landed, in one call per layer.

   The lookahead's candidates (or the shortlist's reads) lie in one records
   block, a token's K|V record holding every head, so a head's key rows are
   strided. Each decode step ranks them by their full-precision keys
   (selection.py): torch needed the keys copied out contiguous, a product, a
   reduction over the query heads and a mask for the padding, four passes and
   their calls for a few dozen rows a sequence. Here each
   key row is read once, multiplied into every query head of its group, and the
   token's importance (summed or max over all query heads, hot_pool.importance)
   is reduced on the way. Rows past a sequence's count are padding whatever they
   hold: their dots and importance are -inf, so they are never chosen and never
   read. The device window's logits take the same pass (selection.window_segment).
   x86-64 with AVX2 and FMA only (`vectorized`); elsewhere the layer keeps
   torch's ops. The GIL is released while it runs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#include "avx2_module.h"

#define MAX_QUERIES 4 /* query heads a pass serves: their accumulators, the key vector and a query load fit 16 registers */

enum { SUM = 0, MAX = 1 }; /* how a token's dots reduce to its importance */

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2,fma"), always_inline))
static inline float lanes_summed(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

/* dots[g] = query[g] . row for `queries` query heads (a constant once inlined). */
__attribute__((target("avx2,fma"), always_inline))
static inline void row_dots(const void *row, const float *query, float *dots, int queries, int head_dim, int bf16) {
    __m256 acc[MAX_QUERIES];
    for (int g = 0; g < queries; g++)
        acc[g] = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; d += 8) {
        __m256 key = eight_floats(row, (size_t)d, bf16);
        for (int g = 0; g < queries; g++)
            acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(query + (size_t)g * head_dim + d), key, acc[g]);
    }
    for (int g = 0; g < queries; g++)
        dots[g] = lanes_summed(acc[g]);
}

/* One (sequence, KV head): out[g][j] = query[g] . row j for j < count (a row every slot_bytes from `rows`), -inf
   for the padding up to width; importance[j] reduced over these dots (started by this head when `first_head`). */
__attribute__((target("avx2,fma")))
static void head_dots(const char *rows, size_t slot_bytes, Py_ssize_t count, Py_ssize_t width, const float *query,
                      float *out, float *importance, int group, int head_dim, int bf16, int aggregation,
                      int first_head) {
    float dots[MAX_QUERIES];
    for (Py_ssize_t j = 0; j < count; j++) {
        const char *row = rows + (size_t)j * slot_bytes;
        float token = importance[j];
        for (int g = 0; g < group; g += MAX_QUERIES) {
            int queries = group - g < MAX_QUERIES ? group - g : MAX_QUERIES;
            const float *q = query + (size_t)g * head_dim;
            switch (queries) {
                case 1: row_dots(row, q, dots, 1, head_dim, bf16); break;
                case 2: row_dots(row, q, dots, 2, head_dim, bf16); break;
                case 3: row_dots(row, q, dots, 3, head_dim, bf16); break;
                default: row_dots(row, q, dots, 4, head_dim, bf16);
            }
            for (int i = 0; i < queries; i++) {
                out[(size_t)(g + i) * width + j] = dots[i];
                token = first_head && g + i == 0 ? dots[i]
                        : aggregation == MAX    ? (dots[i] > token ? dots[i] : token)
                                                : token + dots[i];
            }
        }
        importance[j] = token;
    }
    for (int g = 0; g < group; g++)
        for (Py_ssize_t j = count; j < width; j++)
            out[(size_t)g * width + j] = -INFINITY;
    for (Py_ssize_t j = count; j < width; j++)
        importance[j] = -INFINITY;
}

/* Every (sequence, KV head); the key row of (b, h, slot) starts at element first + b x strides[0] + h x strides[1] +
   slot x strides[2] of `keys`. */
static void all_heads(const char *keys, const Py_ssize_t *strides, Py_ssize_t first, const float *query,
                      const int64_t *counts, float *out, float *importance, int key_bytes, int batch, int heads,
                      int group, int head_dim, Py_ssize_t width, int aggregation) {
    for (int b = 0; b < batch; b++)
        for (int h = 0; h < heads; h++) {
            size_t head = (size_t)b * heads + h;
            const char *rows = keys + (size_t)(first + b * strides[0] + h * strides[1]) * key_bytes;
            head_dots(rows, (size_t)strides[2] * key_bytes, counts[b], width, query + head * group * head_dim,
                      out + head * group * width, importance + (size_t)b * width, group, head_dim, key_bytes == 2,
                      aggregation, h == 0);
        }
}
#endif

static int vectorized = 0;

static PyObject *dots(PyObject *self, PyObject *args) {
    Py_buffer keys, query, counts, out, importance;
    int key_bytes, batch, heads, group, head_dim, aggregation;
    Py_ssize_t first, strides[3], width;
    if (!PyArg_ParseTuple(args, "y*nnnny*y*w*w*iiiinii", &keys, &first, &strides[0], &strides[1], &strides[2], &query,
                          &counts, &out, &importance, &key_bytes, &batch, &heads, &group, &width, &head_dim,
                          &aggregation))
        return NULL;
    PyObject *result = NULL;
    if (!vectorized) {
        PyErr_SetString(PyExc_RuntimeError, "candidate_dots needs an x86-64 CPU with AVX2 and FMA");
    } else if (key_bytes != 2 && key_bytes != 4) {
        PyErr_SetString(PyExc_ValueError, "keys must be bfloat16 (2 bytes) or float32 (4 bytes)");
    } else if (aggregation != SUM && aggregation != MAX) {
        PyErr_SetString(PyExc_ValueError, "aggregation must be 0 (sum) or 1 (max)");
    } else if (batch <= 0 || heads <= 0 || group <= 0 || head_dim <= 0 || head_dim % 8 || width < 0) {
        PyErr_SetString(PyExc_ValueError, "bad shape: need batch, heads, group > 0 and head_dim a multiple of 8");
    } else if (first < 0 || strides[0] < 0 || strides[1] < 0 || strides[2] < 0
               || (width && (first + (batch - 1) * strides[0] + (heads - 1) * strides[1] + (width - 1) * strides[2]
                             + head_dim) * key_bytes > keys.len)) {
        PyErr_SetString(PyExc_ValueError, "the keys' rows do not lie within their buffer");
    } else if ((size_t)query.len != (size_t)batch * heads * group * head_dim * sizeof(float)
               || (size_t)counts.len != (size_t)batch * sizeof(int64_t)
               || (size_t)out.len != (size_t)batch * heads * group * width * sizeof(float)
               || (size_t)importance.len != (size_t)batch * width * sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "a buffer's size does not match the shape");
    } else if (!counts_fit((const int64_t *)counts.buf, batch, width)) {
        PyErr_SetString(PyExc_ValueError, "a count exceeds the width");
    } else {
#if defined(__x86_64__)
        Py_BEGIN_ALLOW_THREADS
        all_heads((const char *)keys.buf, strides, first, (const float *)query.buf, (const int64_t *)counts.buf,
                  (float *)out.buf, (float *)importance.buf, key_bytes, batch, heads, group, head_dim, width,
                  aggregation);
        Py_END_ALLOW_THREADS
#endif
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&query);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&out);
    PyBuffer_Release(&importance);
    return result;
}

static PyMethodDef methods[] = {
    {"dots", dots, METH_VARARGS,
     "dots(keys, first, seq_stride, head_stride, slot_stride, query, counts, out, importance, key_bytes, batch, heads, "
     "group, width, head_dim, aggregation): out[b, h, g, j] = query[b, h, g] . the key row of (b, h, j) for j < "
     "counts[b], -inf after; importance[b, j] their sum (aggregation 0) or max (1) over h and g, -inf after; keys a "
     "buffer of bfloat16 bits (key_bytes 2) or float32 (4) in which the head_dim elements of the row of (b, h, j) "
     "start at element first + b x seq_stride + h x head_stride + j x slot_stride, query float32 [batch, heads, "
     "group, head_dim], counts int64 [batch], out float32 [batch, heads, group, width], importance float32 [batch, "
     "width]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_candidate_dots", NULL, -1, methods};

PyMODINIT_FUNC PyInit__candidate_dots(void) {
    return create_avx2_module(&module, &vectorized);
}
