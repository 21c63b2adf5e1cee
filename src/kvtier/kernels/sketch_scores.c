/* Importance scores of key sketches straight from their codes, in one call per block.

   The storage scorer scores every cold token of every layer at every step.
   Dequantizing the sketches to float32 first (numpy) and then taking one dot
   product per token cost ~4x this, on the scorer's core, which the host's
   decode shares on small machines. Here each scale group's int8 (or unpacked
   int4) codes are dotted with the query and the result is scaled once:
   score = sum over groups of scale * (codes . q). The AVX2 path (chosen at
   import where the CPU has AVX2, FMA and F16C) does that with explicit vector
   instructions; the portable path keeps eight independent partial sums per
   group. The scorer process and the host's fallback run this same compiled
   code on the same machine, so they agree bit for bit. The GIL is released
   while it runs. Record layout: sketch.py. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 64
#define MAX_PER_HEAD 32  /* queries per KV head the vector path holds; more take the portable one */

static inline float half_to_float(uint16_t half) {
    uint32_t sign = (uint32_t)(half & 0x8000u) << 16;
    uint32_t exponent = (half >> 10) & 0x1Fu, mantissa = half & 0x3FFu, bits;
    float value;
    if (exponent == 0) {  /* zero or subnormal: mantissa * 2^-24 is exact in float32 */
        value = (float)mantissa * (1.0f / 16777216.0f);
        memcpy(&bits, &value, sizeof bits);
        bits |= sign;
    } else if (exponent == 31) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline float group_dot(const int8_t *codes, const float *query, int size) {
    float lane[8] = {0};
    int i = 0;
    for (; i + 8 <= size; i += 8)
        for (int j = 0; j < 8; j++)
            lane[j] += (float)codes[i + j] * query[i + j];
    float dot = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    for (; i < size; i++)
        dot += (float)codes[i] * query[i];
    return dot;
}

typedef struct {
    int bits, heads, head_dim, group, per_head, take_max;
    size_t record_bytes;
} Format;

/* The codes of scale group `g` of one record as int8 values (INT4: low nibble = even dim). */
static inline const int8_t *group_codes(const uint8_t *codes, const Format *fmt, int g, int8_t *unpacked) {
    if (fmt->bits == 8)
        return (const int8_t *)codes + (size_t)g * fmt->group;
    const uint8_t *packed = codes + (size_t)g * fmt->group / 2;
    for (int i = 0; i < fmt->group / 2; i++) {
        unpacked[2 * i] = (int8_t)(uint8_t)(packed[i] << 4) >> 4;
        unpacked[2 * i + 1] = (int8_t)packed[i] >> 4;
    }
    return unpacked;
}

static inline float token_score(const uint8_t *record, const float *query, const Format *fmt) {
    int groups_per_head = fmt->head_dim / fmt->group, groups = fmt->heads * groups_per_head;
    const uint8_t *codes = record + 2 * (size_t)groups;
    int8_t unpacked[MAX_GROUP];
    float total = 0.0f, best = -INFINITY;
    for (int h = 0; h < fmt->heads; h++) {
        for (int q = 0; q < fmt->per_head; q++) {
            const float *head_query = query + ((size_t)h * fmt->per_head + q) * fmt->head_dim;
            float dot = 0.0f;
            for (int g = 0; g < groups_per_head; g++) {
                int index = h * groups_per_head + g;
                uint16_t scale;
                memcpy(&scale, record + 2 * (size_t)index, sizeof scale);
                dot += half_to_float(scale) * group_dot(group_codes(codes, fmt, index, unpacked),
                                                        head_query + (size_t)g * fmt->group, fmt->group);
            }
            total += dot;
            best = dot > best ? dot : best;
        }
    }
    return fmt->take_max ? best : total;
}

static void score_block_portable(const uint8_t *records, size_t tokens, const float *query, const Format *fmt,
                                 float *out) {
    for (size_t t = 0; t < tokens; t++)
        out[t] = token_score(records + t * fmt->record_bytes, query, fmt);
}

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2,fma,f16c")))
static inline float horizontal_sum(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_shuffle_ps(half, half, 1)));
}

__attribute__((target("avx2,fma,f16c")))
static inline __m256 eight_codes(const int8_t *group, int k) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(group + k))));
}

__attribute__((target("avx2,fma,f16c")))
static inline __m256 scaled_codes(const int8_t *group, int k, __m256 scale) {
    return _mm256_mul_ps(eight_codes(group, k), scale);
}

__attribute__((target("avx2,fma,f16c")))
static inline __m256 group_scale(const uint8_t *record, int index) {
    uint16_t half;
    memcpy(&half, record + 2 * (size_t)index, sizeof half);
    return _mm256_set1_ps(_cvtsh_ss(half));
}

/* One query per KV head (the "sum" aggregation's summed query, or a model without GQA): each group's codes are
   dotted with the query unscaled, in two accumulators, and the group's scale applied once to the sum; the heads
   share one vector and one horizontal sum unless their maximum is wanted. */
__attribute__((target("avx2,fma,f16c")))
static float token_score_single(const uint8_t *record, const float *query, const Format *fmt, int8_t *unpacked) {
    int groups_per_head = fmt->head_dim / fmt->group, groups = fmt->heads * groups_per_head;
    const uint8_t *codes = record + 2 * (size_t)groups;
    __m256 total = _mm256_setzero_ps();
    float best = -INFINITY;
    for (int h = 0; h < fmt->heads; h++) {
        __m256 head = _mm256_setzero_ps();
        for (int g = 0; g < groups_per_head; g++) {
            int index = h * groups_per_head + g;
            const int8_t *group = group_codes(codes, fmt, index, unpacked);
            const float *at = query + (size_t)index * fmt->group;
            __m256 even = _mm256_mul_ps(eight_codes(group, 0), _mm256_loadu_ps(at));
            __m256 odd = _mm256_setzero_ps();
            for (int k = 8; k + 8 <= fmt->group; k += 16) {
                odd = _mm256_fmadd_ps(eight_codes(group, k), _mm256_loadu_ps(at + k), odd);
                if (k + 16 <= fmt->group)
                    even = _mm256_fmadd_ps(eight_codes(group, k + 8), _mm256_loadu_ps(at + k + 8), even);
            }
            head = _mm256_fmadd_ps(_mm256_add_ps(even, odd), group_scale(record, index), head);
        }
        if (fmt->take_max) {
            float dot = horizontal_sum(head);
            best = dot > best ? dot : best;
        } else {
            total = _mm256_add_ps(total, head);
        }
    }
    return fmt->take_max ? best : horizontal_sum(total);
}

/* Several queries per KV head ("max" under GQA): each group's codes are converted once for all of them. */
__attribute__((target("avx2,fma,f16c")))
static float token_score_grouped(const uint8_t *record, const float *query, const Format *fmt, int8_t *unpacked) {
    int groups_per_head = fmt->head_dim / fmt->group, groups = fmt->heads * groups_per_head;
    const uint8_t *codes = record + 2 * (size_t)groups;
    __m256 sums[MAX_PER_HEAD];
    float total = 0.0f, best = -INFINITY;
    for (int h = 0; h < fmt->heads; h++) {
        const float *head_query = query + (size_t)h * fmt->per_head * fmt->head_dim;
        for (int q = 0; q < fmt->per_head; q++)
            sums[q] = _mm256_setzero_ps();
        for (int g = 0; g < groups_per_head; g++) {
            int index = h * groups_per_head + g;
            __m256 scale = group_scale(record, index);
            const int8_t *group = group_codes(codes, fmt, index, unpacked);
            for (int k = 0; k < fmt->group; k += 8) {
                __m256 scaled = scaled_codes(group, k, scale);
                const float *at = head_query + (size_t)g * fmt->group + k;
                for (int q = 0; q < fmt->per_head; q++)
                    sums[q] = _mm256_fmadd_ps(scaled, _mm256_loadu_ps(at + (size_t)q * fmt->head_dim), sums[q]);
            }
        }
        for (int q = 0; q < fmt->per_head; q++) {
            float dot = horizontal_sum(sums[q]);
            total += dot;
            best = dot > best ? dot : best;
        }
    }
    return fmt->take_max ? best : total;
}

__attribute__((target("avx2,fma,f16c")))
static void score_block_avx2(const uint8_t *records, size_t tokens, const float *query, const Format *fmt,
                             float *out) {
    int8_t unpacked[MAX_GROUP];
    for (size_t t = 0; t < tokens; t++) {
        const uint8_t *record = records + t * fmt->record_bytes;
        out[t] = fmt->per_head == 1 ? token_score_single(record, query, fmt, unpacked)
                                    : token_score_grouped(record, query, fmt, unpacked);
    }
}
#endif

static void (*score_block)(const uint8_t *, size_t, const float *, const Format *, float *) = score_block_portable;

static PyObject *scores(PyObject *self, PyObject *args) {
    Py_buffer records, query, out;
    Format fmt;
    if (!PyArg_ParseTuple(args, "y*y*w*iiiip", &records, &query, &out, &fmt.bits, &fmt.heads, &fmt.head_dim,
                          &fmt.group, &fmt.take_max))
        return NULL;
    PyObject *result = NULL;
    int groups = fmt.group > 0 ? fmt.heads * (fmt.head_dim / fmt.group) : 0;
    fmt.record_bytes = (size_t)(2 * groups + fmt.heads * fmt.head_dim * fmt.bits / 8);
    size_t query_values = (size_t)query.len / sizeof(float), head_values = (size_t)fmt.heads * fmt.head_dim;
    if ((fmt.bits != 8 && fmt.bits != 4) || fmt.heads <= 0 || fmt.group <= 0 || fmt.group > MAX_GROUP
        || fmt.head_dim % fmt.group || fmt.group % 2) {
        PyErr_SetString(PyExc_ValueError, "unsupported sketch format");
    } else if (records.len % fmt.record_bytes) {
        PyErr_Format(PyExc_ValueError, "%zd bytes of records is not a whole number of %zu-byte records", records.len,
                     fmt.record_bytes);
    } else if (query_values == 0 || query_values % head_values) {
        PyErr_Format(PyExc_ValueError, "a query of %zu float32 values does not fit %d heads of %d dims", query_values,
                     fmt.heads, fmt.head_dim);
    } else if ((size_t)out.len < (size_t)records.len / fmt.record_bytes * sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "the output holds fewer float32 values than there are records");
    } else {
        size_t tokens = (size_t)records.len / fmt.record_bytes;
        fmt.per_head = (int)(query_values / head_values);
        const uint8_t *data = (const uint8_t *)records.buf;
        const float *q = (const float *)query.buf;
        float *scored = (float *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        if (fmt.group % 8 == 0 && fmt.per_head <= MAX_PER_HEAD)
            score_block(data, tokens, q, &fmt, scored);
        else
            score_block_portable(data, tokens, q, &fmt, scored);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&records);
    PyBuffer_Release(&query);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"scores", scores, METH_VARARGS,
     "scores(records, query, out, bits, heads, head_dim, group, take_max): each record's importance into out "
     "(float32); query float32 [heads, per_head, head_dim]; the sum over heads and queries, or the max."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sketch_scores", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sketch_scores(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        score_block = score_block_avx2;
#endif
    return PyModule_Create(&module);
}
