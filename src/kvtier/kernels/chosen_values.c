/* The attention's weighted sum over the chosen pooled tokens, read where they lie: in the hot pool, or among the
   cold candidates' records where their reads landed.

   Once a decode step has chosen its tokens and taken the softmax, each source's
   part of the output is sum_j w[g, j] x V[slot_j] per query head g. Copying the
   chosen values out first (index_select) and then multiplying wrote and read
   them again; at batch 8 the hot pool is out of cache and the copy cost more
   than the product, and for the few chosen candidates the copies' per-call
   overhead was the cost. The rows may lie at any strides
   (a token's K|V record holds every head). Here each chosen row is read
   once: rows go in blocks of BLOCK tokens, small enough to stay in L1 while
   every query head of the group and every stretch of the head dimension takes
   them, with one accumulator per (query head, 8 floats) in registers. Values are
   float32 or bfloat16 (a bfloat16 is the top half of a float32). x86-64 with
   AVX2 and FMA only (`vectorized`); elsewhere the layer copies the chosen values
   out as before. The GIL is released while it runs.

   `attend` does a decode step's whole attention over its sources (the device
   window, the chosen hot tokens, the chosen candidates) in the same pass: the
   peak and the exponentials of one softmax over all of them, each source's
   weighted sum, the division. In torch that was a dozen small ops per layer
   whose dispatch cost several times their arithmetic. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2_module.h"

#define BLOCK 32     /* chosen rows per block: 8 KiB of float32 values at head_dim 64, in L1 */
#define GROUP_STEP 3 /* query heads a pass serves: 3 x 4 accumulators, 4 value vectors and a weight fit 16 registers */
#define STRETCH 32   /* floats of the head dimension a pass covers: 4 AVX2 vectors */
#define MAX_ACC 8192 /* floats of one head's accumulators (query heads x head_dim), on the stack */

/* Chosen rows of a source of values: the row of (b, h, slot) starts at element first + b x strides[0] + h x strides[1]
   + slot x strides[2] of `values` (bfloat16 bits when value_bytes is 2, else float32); sequence b's chosen slots are
   slots[b x width ..] (slot j itself where `slots` is NULL), the first counts[b] of them (`width` where `counts` is
   NULL). */
typedef struct {
    const char *values;
    Py_ssize_t first, strides[3], pool_slots, width;
    int value_bytes;
    const int64_t *slots, *counts;
} Rows;

/* A source of an attention: its rows and raw logits [batch, heads, group, rows.width] (q.k before the scaling). */
typedef struct {
    Rows rows;
    const float *logits;
} Source;

static Py_ssize_t chosen_count(const Rows *rows, int b) {
    return rows->counts ? rows->counts[b] : rows->width;
}

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

/* One (sequence, KV head): acc[g] += sum_j weights[g][j] x the row of slots[j] (of slot j where `slots` is NULL)
   over `count` chosen slots; a slot's row starts slot x slot_bytes after `values`. */
__attribute__((target("avx2,fma")))
static void accumulate(const char *values, size_t slot_bytes, const int64_t *slots, Py_ssize_t count,
                       const float *weights, Py_ssize_t weight_stride, float *acc, int group, int head_dim, int bf16) {
    size_t row_bytes = (size_t)head_dim * (bf16 ? 2 : 4);
    const char *rows[BLOCK];
    int vectors = head_dim % STRETCH == 0 ? STRETCH / 8 : 1;
    for (Py_ssize_t start = 0; start < count; start += BLOCK) {
        int block = count - start < BLOCK ? (int)(count - start) : BLOCK;
        for (int j = 0; j < block; j++)
            rows[j] = values + (size_t)(slots ? slots[start + j] : start + j) * slot_bytes;
        for (Py_ssize_t j = start + BLOCK; slots && j < start + 2 * BLOCK && j < count; j++)
            prefetch_row(values + (size_t)slots[j] * slot_bytes, row_bytes);
        const float *w = weights + start;
        if (vectors == STRETCH / 8)
            block_passes(rows, block, w, weight_stride, acc, group, head_dim, STRETCH / 8, bf16);
        else
            block_passes(rows, block, w, weight_stride, acc, group, head_dim, 1, bf16);
    }
}

__attribute__((target("avx2,fma")))
static void accumulate_rows(const Rows *rows, int b, int h, const float *weights, Py_ssize_t weight_stride,
                            float *acc, int group, int head_dim) {
    size_t bytes = (size_t)rows->value_bytes;
    const char *first = rows->values + (size_t)(rows->first + b * rows->strides[0] + h * rows->strides[1]) * bytes;
    accumulate(first, (size_t)rows->strides[2] * bytes, rows->slots ? rows->slots + (size_t)b * rows->width : NULL,
               rows->counts ? rows->counts[b] : rows->width, weights, weight_stride, acc, group, head_dim,
               rows->value_bytes == 2);
}

/* Every (sequence, KV head): out[b, h, g] = the weighted sum of its chosen rows. */
static void all_heads(const Rows *rows, const float *weights, Py_ssize_t weight_stride, Py_ssize_t weight_start,
                      float *out, int batch, int heads, int group, int head_dim) {
    float acc[MAX_ACC];
    for (int b = 0; b < batch; b++)
        for (int h = 0; h < heads; h++) {
            size_t head = (size_t)b * heads + h;
            memset(acc, 0, (size_t)group * head_dim * sizeof(float));
            accumulate_rows(rows, b, h, weights + head * group * weight_stride + weight_start, weight_stride, acc,
                            group, head_dim);
            memcpy(out + head * group * head_dim, acc, (size_t)group * head_dim * sizeof(float));
        }
}

/* exp(x) of eight floats x <= 0 (a softmax's logits less their peak), within a few ulp of expf: x = n ln 2 + r with
   |r| <= ln 2 / 2, e^r by its Taylor series to r^7 (the next term is under 1e-8 there), 2^n put into the exponent's
   bits. Below the float's range (-inf included) 0; a NaN stays NaN. */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 exp_nonpositive(__m256 x) {
    __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x); /* max_ps returns its second operand for a NaN */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* ln 2 in two parts: n x the first is exact */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

/* weights[j] = exp((logits[j] - peak) x scaling) for j < count; returns their sum. */
__attribute__((target("avx2,fma")))
static float exponentials(const float *logits, Py_ssize_t count, float peak, float scaling, float *weights) {
    __m256 sum = _mm256_setzero_ps(), top = _mm256_set1_ps(peak), scale = _mm256_set1_ps(scaling);
    Py_ssize_t j = 0;
    for (; j + 8 <= count; j += 8) {
        __m256 w = exp_nonpositive(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(logits + j), top), scale));
        _mm256_storeu_ps(weights + j, w);
        sum = _mm256_add_ps(sum, w);
    }
    float lanes[8], tail[8] = {0};
    if (j < count) {
        memcpy(tail, logits + j, (size_t)(count - j) * sizeof(float));
        for (Py_ssize_t k = count - j; k < 8; k++)
            tail[k] = -INFINITY;
        __m256 w = exp_nonpositive(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(tail), top), scale));
        _mm256_storeu_ps(lanes, w);
        memcpy(weights + j, lanes, (size_t)(count - j) * sizeof(float));
        sum = _mm256_add_ps(sum, w);
    }
    _mm256_storeu_ps(lanes, sum);
    float total = 0.0f;
    for (int lane = 0; lane < 8; lane++)
        total += lanes[lane];
    return total;
}

/* One (sequence, KV head) of `attend`: out[g] = softmax over every source's chosen logits of row g, times their
   values. `scratch` holds group x the sources' widths together. */
__attribute__((target("avx2,fma")))
static void attend_head(const Source *sources, int count, int b, int h, int heads, int group, int head_dim,
                        float scaling, float *scratch, float *out) {
    float peaks[MAX_ACC / 8], totals[MAX_ACC / 8], acc[MAX_ACC];
    for (int g = 0; g < group; g++) {
        peaks[g] = -INFINITY;
        totals[g] = 0.0f;
    }
    for (int s = 0; s < count; s++) {
        const Rows *rows = &sources[s].rows;
        const float *logits = sources[s].logits + ((size_t)b * heads + h) * group * rows->width;
        for (int g = 0; g < group; g++)
            for (Py_ssize_t j = 0; j < chosen_count(rows, b); j++)
                peaks[g] = fmaxf(peaks[g], logits[(size_t)g * rows->width + j]);
    }
    memset(acc, 0, (size_t)group * head_dim * sizeof(float));
    float *weights = scratch;
    for (int s = 0; s < count; s++) {
        const Rows *rows = &sources[s].rows;
        const float *logits = sources[s].logits + ((size_t)b * heads + h) * group * rows->width;
        Py_ssize_t chosen = chosen_count(rows, b);
        for (int g = 0; g < group; g++)
            totals[g] += exponentials(logits + (size_t)g * rows->width, chosen, peaks[g], scaling,
                                      weights + (size_t)g * rows->width);
        accumulate_rows(rows, b, h, weights, rows->width, acc, group, head_dim);
        weights += (size_t)group * rows->width;
    }
    for (int g = 0; g < group; g++)
        for (int d = 0; d < head_dim; d++)
            out[(size_t)g * head_dim + d] = acc[(size_t)g * head_dim + d] / totals[g];
}
#endif

static int vectorized = 0;

/* Why `rows` (over buffers of the given byte lengths; slots and counts may be absent) cannot be read for `batch`
   sequences of `heads` heads, or NULL when they can. */
static const char *rows_problem(const Rows *rows, Py_ssize_t values_len, Py_ssize_t slots_len, Py_ssize_t counts_len,
                                int batch, int heads, int head_dim) {
    if (rows->value_bytes != 2 && rows->value_bytes != 4)
        return "values must be bfloat16 (2 bytes) or float32 (4 bytes)";
    if (rows->pool_slots < 0 || rows->width < 0)
        return "bad shape: a negative pool or width";
    if (rows->first < 0 || rows->strides[0] < 0 || rows->strides[1] < 0 || rows->strides[2] < 0
        || (rows->pool_slots && (rows->first + (batch - 1) * rows->strides[0] + (heads - 1) * rows->strides[1]
                                 + (rows->pool_slots - 1) * rows->strides[2] + head_dim) * rows->value_bytes
                                    > values_len))
        return "the values' rows do not lie within their buffer";
    if ((rows->slots && (size_t)slots_len != (size_t)batch * rows->width * sizeof(int64_t))
        || (rows->counts && (size_t)counts_len != (size_t)batch * sizeof(int64_t)))
        return "a buffer's size does not match the shape";
    if (rows->counts && !counts_fit(rows->counts, batch, rows->width))
        return "a count exceeds the width";
    if (!rows->slots && rows->width > rows->pool_slots)
        return "more rows than the pool holds";
    for (int b = 0; rows->slots && b < batch; b++)
        for (Py_ssize_t j = 0; j < chosen_count(rows, b); j++)
            if (rows->slots[(size_t)b * rows->width + j] < 0 || rows->slots[(size_t)b * rows->width + j] >= rows->pool_slots)
                return "a chosen slot lies outside the pool";
    return NULL;
}

static const char *shape_problem(int batch, int heads, int group, int head_dim) {
    if (batch <= 0 || heads <= 0 || group <= 0 || head_dim <= 0 || head_dim % 8 || (size_t)group * head_dim > MAX_ACC)
        return "bad shape: need batch, heads, group > 0, head_dim a multiple of 8 and group x head_dim <= 8192";
    return NULL;
}

static PyObject *weighted(PyObject *self, PyObject *args) {
    Py_buffer values, slots, counts, weights, out;
    Rows rows;
    int batch, heads, group, head_dim;
    Py_ssize_t weight_stride, weight_start;
    if (!PyArg_ParseTuple(args, "y*nnnny*y*y*w*iiiinnnni", &values, &rows.first, &rows.strides[0], &rows.strides[1],
                          &rows.strides[2], &slots, &counts, &weights, &out, &rows.value_bytes, &batch, &heads, &group,
                          &rows.pool_slots, &rows.width, &weight_stride, &weight_start, &head_dim))
        return NULL;
    rows.values = values.buf;
    rows.slots = slots.buf;
    rows.counts = counts.buf;
    const char *problem = vectorized ? shape_problem(batch, heads, group, head_dim)
                                     : "chosen_values needs an x86-64 CPU with AVX2 and FMA";
    if (!problem && (weight_start < 0 || weight_start + rows.width > weight_stride))
        problem = "bad shape: the chosen columns must lie within each weight row";
    if (!problem && ((size_t)slots.len != (size_t)batch * rows.width * sizeof(int64_t)
                     || (size_t)counts.len != (size_t)batch * sizeof(int64_t)
                     || (size_t)weights.len < (size_t)batch * heads * group * weight_stride * sizeof(float)
                     || (size_t)out.len != (size_t)batch * heads * group * head_dim * sizeof(float)))
        problem = "a buffer's size does not match the shape";
    if (!problem)
        problem = rows_problem(&rows, values.len, slots.len, counts.len, batch, heads, head_dim);
    if (problem) {
        PyErr_SetString(PyExc_ValueError, problem);
    } else {
#if defined(__x86_64__)
        Py_BEGIN_ALLOW_THREADS
        all_heads(&rows, (const float *)weights.buf, weight_stride, weight_start, (float *)out.buf, batch, heads, group,
                  head_dim);
        Py_END_ALLOW_THREADS
#endif
    }
    PyBuffer_Release(&values);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&weights);
    PyBuffer_Release(&out);
    return problem ? NULL : Py_NewRef(Py_None);
}

#define MAX_SOURCES 8

/* A source's buffers, held while the kernel reads them. */
typedef struct {
    Py_buffer logits, values, slots, counts;
    int held;
} SourceBuffers;

static void release_sources(SourceBuffers *buffers, int count) {
    for (int s = 0; s < count; s++)
        if (buffers[s].held) {
            PyBuffer_Release(&buffers[s].logits);
            PyBuffer_Release(&buffers[s].values);
            PyBuffer_Release(&buffers[s].slots);
            PyBuffer_Release(&buffers[s].counts);
        }
}

/* Parses one source tuple into `source` (holding its buffers in `buffers`); an error message, or NULL. */
static const char *parse_source(PyObject *item, Source *source, SourceBuffers *buffers, int batch, int heads,
                                int group, int head_dim) {
    Rows *rows = &source->rows;
    if (!PyArg_ParseTuple(item, "y*ny*nnnniny*y*;a source is (logits, width, values, first, seq_stride, head_stride, "
                          "slot_stride, value_bytes, pool_slots, slots, counts)", &buffers->logits, &rows->width,
                          &buffers->values, &rows->first, &rows->strides[0], &rows->strides[1], &rows->strides[2],
                          &rows->value_bytes, &rows->pool_slots, &buffers->slots, &buffers->counts))
        return "";
    buffers->held = 1;
    rows->values = buffers->values.buf;
    rows->slots = buffers->slots.len ? buffers->slots.buf : NULL;
    rows->counts = buffers->counts.len ? buffers->counts.buf : NULL;
    source->logits = buffers->logits.buf;
    if ((size_t)buffers->logits.len != (size_t)batch * heads * group * rows->width * sizeof(float))
        return "a source's logits do not match the shape";
    return rows_problem(rows, buffers->values.len, buffers->slots.len, buffers->counts.len, batch, heads, head_dim);
}

static PyObject *attend(PyObject *self, PyObject *args) {
    PyObject *items;
    Py_buffer out;
    int batch, heads, group, head_dim;
    float scaling;
    if (!PyArg_ParseTuple(args, "O!w*iiiif", &PyTuple_Type, &items, &out, &batch, &heads, &group, &head_dim, &scaling))
        return NULL;
    Source sources[MAX_SOURCES];
    SourceBuffers buffers[MAX_SOURCES] = {0};
    int count = (int)PyTuple_GET_SIZE(items);
    const char *problem = vectorized ? shape_problem(batch, heads, group, head_dim)
                                     : "chosen_values needs an x86-64 CPU with AVX2 and FMA";
    if (!problem && (count < 1 || count > MAX_SOURCES))
        problem = "attend takes 1 to 8 sources";
    if (!problem && (size_t)out.len != (size_t)batch * heads * group * head_dim * sizeof(float))
        problem = "a buffer's size does not match the shape";
    size_t columns = 0;
    for (int s = 0; !problem && s < count; s++) {
        problem = parse_source(PyTuple_GET_ITEM(items, s), &sources[s], &buffers[s], batch, heads, group, head_dim);
        columns += problem ? 0 : (size_t)sources[s].rows.width;
    }
    float *scratch = problem ? NULL : malloc((columns ? columns : 1) * group * sizeof(float));
    if (!problem && !scratch)
        problem = "out of memory";
    if (problem && *problem)
        PyErr_SetString(PyExc_ValueError, problem);
    if (!problem) {
#if defined(__x86_64__)
        Py_BEGIN_ALLOW_THREADS
        for (int b = 0; b < batch; b++)
            for (int h = 0; h < heads; h++)
                attend_head(sources, count, b, h, heads, group, head_dim, scaling, scratch,
                            (float *)out.buf + ((size_t)b * heads + h) * group * head_dim);
        Py_END_ALLOW_THREADS
#endif
    }
    free(scratch);
    release_sources(buffers, count < MAX_SOURCES ? count : MAX_SOURCES);
    PyBuffer_Release(&out);
    return problem ? NULL : Py_NewRef(Py_None);
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
    {"attend", attend, METH_VARARGS,
     "attend(sources, out, batch, heads, group, head_dim, scaling): out float32 [batch, heads, group, head_dim] = the "
     "attention of each query head over every source's chosen rows together: softmax of their logits x scaling, "
     "times their values. A source is a tuple (logits, width, values, first, seq_stride, head_stride, slot_stride, "
     "value_bytes, pool_slots, slots, counts): its raw logits float32 [batch, heads, group, width], its values and "
     "chosen slots as `weighted` takes them (slots empty: slot j is row j; counts empty: every sequence has width)."},
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
