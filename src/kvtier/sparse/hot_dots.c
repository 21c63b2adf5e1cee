/* The hot pool's raw q.k straight from its bfloat16 keys, in one call per layer.

   Every decode step the host takes the dot product of each query head with
   every hot key of its KV head (hot_pool.py): the hot tokens' importance and
   their attention logits. In torch that is a conversion of the whole pool's
   keys to float32 and then a batched product with only a few query rows,
   which reads and writes the pool twice over and runs far below the core's
   peak. Here each 16-token stretch of a key row is widened from bfloat16 to
   float32 in registers (a bfloat16 is the top half of a float32) and
   multiplied into up to four query heads at once, so the keys are read once.
   Keys are column-major per head ([head_dim, capacity], hot_pool.py), so a
   stretch is contiguous; rows are prefetched ahead. x86-64 with AVX2 and FMA only (`vectorized` says
   whether this CPU has them); elsewhere the pool keeps torch's product.
   The GIL is released while it runs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>

#define STRETCH 16    /* tokens per pass over a head's key rows: two AVX2 vectors */
#define MAX_QUERIES 4 /* query heads a pass serves: 8 accumulators, 2 key vectors and a broadcast fit 16 registers */
/* Tokens ahead of a stretch whose keys are prefetched. A pass reads 32 bytes from each of head_dim rows a pool's
   width apart, too many streams for the hardware prefetcher: without this the kernel was slower than torch once
   the pool was out of cache (docs/decisions.md). */
#define PREFETCH_AHEAD 128

__attribute__((target("avx2,fma"), always_inline))
static inline __m256 widened(const uint16_t *bf16) {
    __m128i raw = _mm_loadu_si128((const __m128i *)bf16);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

/* out[g][n .. n+16) = query[g] . keys[:, n .. n+16) for `queries` (a constant 1-4 once inlined) query heads. */
__attribute__((target("avx2,fma"), always_inline))
static inline void stretch_dots(const uint16_t *keys, const float *query, float *out, int queries, int head_dim,
                                Py_ssize_t capacity, Py_ssize_t used, Py_ssize_t n) {
    __m256 low[MAX_QUERIES], high[MAX_QUERIES];
    for (int g = 0; g < queries; g++)
        low[g] = high[g] = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        const uint16_t *row = keys + (size_t)d * capacity + n;
        _mm_prefetch((const char *)(row + PREFETCH_AHEAD), _MM_HINT_T0);
        __m256 key_low = widened(row), key_high = widened(row + 8);
        for (int g = 0; g < queries; g++) {
            __m256 q = _mm256_broadcast_ss(query + (size_t)g * head_dim + d);
            low[g] = _mm256_fmadd_ps(q, key_low, low[g]);
            high[g] = _mm256_fmadd_ps(q, key_high, high[g]);
        }
    }
    for (int g = 0; g < queries; g++) {
        _mm256_storeu_ps(out + (size_t)g * used + n, low[g]);
        _mm256_storeu_ps(out + (size_t)g * used + n + 8, high[g]);
    }
}

static inline float bf16_to_float(uint16_t bf16) {
    uint32_t bits = (uint32_t)bf16 << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* One KV head: keys [head_dim, capacity] (the first `used` columns), query [group, head_dim], out [group, used]. */
__attribute__((target("avx2,fma")))
static void head_dots(const uint16_t *keys, const float *query, float *out, int group, int head_dim,
                      Py_ssize_t capacity, Py_ssize_t used) {
    Py_ssize_t n = 0;
    for (; n + STRETCH <= used; n += STRETCH)
        for (int g = 0; g < group; g += MAX_QUERIES) {
            const float *q = query + (size_t)g * head_dim;
            float *o = out + (size_t)g * used;
            switch (group - g < MAX_QUERIES ? group - g : MAX_QUERIES) {  /* constants, so each case unrolls */
                case 1: stretch_dots(keys, q, o, 1, head_dim, capacity, used, n); break;
                case 2: stretch_dots(keys, q, o, 2, head_dim, capacity, used, n); break;
                case 3: stretch_dots(keys, q, o, 3, head_dim, capacity, used, n); break;
                default: stretch_dots(keys, q, o, 4, head_dim, capacity, used, n);
            }
        }
    for (; n < used; n++)  /* the last few tokens */
        for (int g = 0; g < group; g++) {
            float dot = 0.0f;
            for (int d = 0; d < head_dim; d++)
                dot += query[(size_t)g * head_dim + d] * bf16_to_float(keys[(size_t)d * capacity + n]);
            out[(size_t)g * used + n] = dot;
        }
}
#endif

static int vectorized = 0;

static PyObject *dots(PyObject *self, PyObject *args) {
    Py_buffer keys, query, out;
    int heads, group, head_dim;
    Py_ssize_t capacity, used;
    if (!PyArg_ParseTuple(args, "y*y*w*iiinn", &keys, &query, &out, &heads, &group, &head_dim, &capacity, &used))
        return NULL;
    PyObject *result = NULL;
    if (!vectorized) {
        PyErr_SetString(PyExc_RuntimeError, "hot_dots needs an x86-64 CPU with AVX2 and FMA");
    } else if (heads <= 0 || group <= 0 || head_dim <= 0 || used < 0 || used > capacity) {
        PyErr_SetString(PyExc_ValueError, "bad shape: need heads, group, head_dim > 0 and 0 <= used <= capacity");
    } else if ((size_t)keys.len < (size_t)heads * head_dim * capacity * sizeof(uint16_t)
               || (size_t)query.len != (size_t)heads * group * head_dim * sizeof(float)
               || (size_t)out.len < (size_t)heads * group * used * sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "a buffer's size does not match the shape");
    } else {
#if defined(__x86_64__)
        Py_BEGIN_ALLOW_THREADS
        for (int h = 0; h < heads; h++)
            head_dots((const uint16_t *)keys.buf + (size_t)h * head_dim * capacity,
                      (const float *)query.buf + (size_t)h * group * head_dim,
                      (float *)out.buf + (size_t)h * group * used, group, head_dim, capacity, used);
        Py_END_ALLOW_THREADS
#endif
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&query);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"dots", dots, METH_VARARGS,
     "dots(keys, query, out, heads, group, head_dim, capacity, used): raw q.k into out (float32 [heads, group, used]); "
     "keys bfloat16 bits [heads, head_dim, capacity], query float32 [heads, group, head_dim]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hot_dots", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hot_dots(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    vectorized = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    PyObject *created = PyModule_Create(&module);
    if (created != NULL && PyModule_AddIntConstant(created, "vectorized", vectorized) < 0) {
        Py_DECREF(created);
        return NULL;
    }
    return created;
}
