/* The hot pool's raw q.k straight from its keys (bfloat16 or float32), in one call per layer.

   Every decode step the host takes the dot product of each query head with
   every hot key of its KV head (hot_pool.py): the hot tokens' importance and
   their attention logits. The pool is out of cache by then, so the product is
   bound by reading the keys. The pool keeps them in tiles of 16 tokens, each
   tile dimension-major ([tiles, head_dim, 16]), so a tile is one contiguous
   run the prefetchers follow, and the kernel asks for the next tile while it
   multiplies one (the prefetchers alone left it short of the memory's rate);
   it loads each tile once, widened from bfloat16 in registers where need be
   (a bfloat16 is the top half of a float32), and multiplies it into up to
   four query heads at once. The same
   pass reduces the tile's dots over the query heads of a sequence into each
   token's importance (summed or max, hot_pool.importance), while they are
   still in registers: torch's reduction over the written dots was a second
   pass over them. x86-64
   with AVX2 and FMA only (`vectorized` says whether this CPU has them);
   elsewhere the pool keeps torch's product. The GIL is released while it
   runs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "avx2_module.h"

#define TILE 16 /* tokens per key tile (hot_pool.TILE): two AVX2 vectors */

#if defined(__x86_64__)
#include <immintrin.h>

#define MAX_QUERIES 4 /* query heads a pass serves: 8 accumulators, 2 key vectors and a broadcast fit 16 registers */

enum { SUM = 0, MAX = 1 }; /* how a token's dots reduce to its importance */

static inline float one_key(const void *keys, size_t at, int bf16) {
    if (!bf16)
        return ((const float *)keys)[at];
    uint32_t bits = (uint32_t)((const uint16_t *)keys)[at] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

__attribute__((target("avx2,fma"), always_inline))
static inline __m256 reduced(__m256 a, __m256 b, int aggregation) {
    return aggregation == MAX ? _mm256_max_ps(a, b) : _mm256_add_ps(a, b);
}

static inline float reduced_one(float a, float b, int aggregation) {
    return aggregation == MAX ? (a > b ? a : b) : a + b;
}

/* out[g][0 .. 16) = query[g] . tile[:, 0 .. 16) for `queries` query heads, `out_stride` apart, reduced into
   importance[0 .. 16) (which they start when `first`); `queries` and `bf16` are constants once inlined, so each
   combination compiles to its own unrolled loop. */
__attribute__((target("avx2,fma"), always_inline))
static inline void tile_dots(const void *tile, const float *query, float *out, float *importance, int queries,
                             int bf16, int head_dim, Py_ssize_t out_stride, int aggregation, int first) {
    __m256 low[MAX_QUERIES], high[MAX_QUERIES];
    for (int g = 0; g < queries; g++)
        low[g] = high[g] = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        __m256 key_low = eight_floats(tile, (size_t)d * TILE, bf16);
        __m256 key_high = eight_floats(tile, (size_t)d * TILE + 8, bf16);
        for (int g = 0; g < queries; g++) {
            __m256 q = _mm256_broadcast_ss(query + (size_t)g * head_dim + d);
            low[g] = _mm256_fmadd_ps(q, key_low, low[g]);
            high[g] = _mm256_fmadd_ps(q, key_high, high[g]);
        }
    }
    for (int g = 0; g < queries; g++) {
        _mm256_storeu_ps(out + (size_t)g * out_stride, low[g]);
        _mm256_storeu_ps(out + (size_t)g * out_stride + 8, high[g]);
    }
    __m256 importance_low = low[0], importance_high = high[0];
    for (int g = 1; g < queries; g++) {
        importance_low = reduced(importance_low, low[g], aggregation);
        importance_high = reduced(importance_high, high[g], aggregation);
    }
    if (!first) {
        importance_low = reduced(_mm256_loadu_ps(importance), importance_low, aggregation);
        importance_high = reduced(_mm256_loadu_ps(importance + 8), importance_high, aggregation);
    }
    _mm256_storeu_ps(importance, importance_low);
    _mm256_storeu_ps(importance + 8, importance_high);
}

/* One KV head: keys [tiles, head_dim, TILE] (the first `used` tokens), query [group, head_dim], out [group, used],
   reduced into importance [used] (started by this head when `first_head`). */
__attribute__((target("avx2,fma"), always_inline))
static inline void head_dots(const char *keys, const float *query, float *out, float *importance, int bf16, int group,
                             int head_dim, Py_ssize_t used, int aggregation, int first_head) {
    size_t tile_bytes = (size_t)head_dim * TILE * (bf16 ? 2 : 4);
    Py_ssize_t n = 0;
    for (; n + TILE <= used; n += TILE, keys += tile_bytes) {
        if (n + 2 * TILE <= used)  /* the next tile, asked for while this one is multiplied */
            for (size_t line = 0; line < tile_bytes; line += 64)
                _mm_prefetch(keys + tile_bytes + line, _MM_HINT_T0);
        for (int g = 0; g < group; g += MAX_QUERIES) {
            const float *q = query + (size_t)g * head_dim;
            float *o = out + (size_t)g * used + n, *i = importance + n;
            int first = first_head && g == 0;
            switch (group - g < MAX_QUERIES ? group - g : MAX_QUERIES) {
                case 1: tile_dots(keys, q, o, i, 1, bf16, head_dim, used, aggregation, first); break;
                case 2: tile_dots(keys, q, o, i, 2, bf16, head_dim, used, aggregation, first); break;
                case 3: tile_dots(keys, q, o, i, 3, bf16, head_dim, used, aggregation, first); break;
                default: tile_dots(keys, q, o, i, 4, bf16, head_dim, used, aggregation, first);
            }
        }
    }
    for (Py_ssize_t lane = 0; n + lane < used; lane++)  /* the last, partly filled tile */
        for (int g = 0; g < group; g++) {
            float dot = 0.0f;
            for (int d = 0; d < head_dim; d++)
                dot += query[(size_t)g * head_dim + d] * one_key(keys, (size_t)d * TILE + lane, bf16);
            out[(size_t)g * used + n + lane] = dot;
            float *token = importance + n + lane;
            *token = first_head && g == 0 ? dot : reduced_one(*token, dot, aggregation);
        }
}

__attribute__((target("avx2,fma")))
static void all_heads(const void *keys, const float *query, float *out, float *importance, int aggregation,
                      int key_bytes, int heads, int seq_heads, int group, int head_dim, Py_ssize_t tiles,
                      Py_ssize_t used) {
    for (int h = 0; h < heads; h++) {
        const char *head_keys = (const char *)keys + (size_t)h * tiles * head_dim * TILE * key_bytes;
        const float *head_query = query + (size_t)h * group * head_dim;
        float *head_out = out + (size_t)h * group * used, *seq_importance = importance + (size_t)(h / seq_heads) * used;
        int first = h % seq_heads == 0;
        if (key_bytes == 2)
            head_dots(head_keys, head_query, head_out, seq_importance, 1, group, head_dim, used, aggregation, first);
        else
            head_dots(head_keys, head_query, head_out, seq_importance, 0, group, head_dim, used, aggregation, first);
    }
}
#endif

static int vectorized = 0;

static PyObject *dots(PyObject *self, PyObject *args) {
    Py_buffer keys, query, out, importance;
    int aggregation, key_bytes, heads, seq_heads, group, head_dim;
    Py_ssize_t tiles, used;
    if (!PyArg_ParseTuple(args, "y*y*w*w*iiiiiinn", &keys, &query, &out, &importance, &aggregation, &key_bytes, &heads,
                          &seq_heads, &group, &head_dim, &tiles, &used))
        return NULL;
    PyObject *result = NULL;
    if (!vectorized) {
        PyErr_SetString(PyExc_RuntimeError, "hot_dots needs an x86-64 CPU with AVX2 and FMA");
    } else if (key_bytes != 2 && key_bytes != 4) {
        PyErr_SetString(PyExc_ValueError, "keys must be bfloat16 (2 bytes) or float32 (4 bytes)");
    } else if (aggregation != SUM && aggregation != MAX) {
        PyErr_SetString(PyExc_ValueError, "aggregation must be 0 (sum) or 1 (max)");
    } else if (heads <= 0 || seq_heads <= 0 || heads % seq_heads || group <= 0 || head_dim <= 0 || used < 0
               || used > tiles * TILE) {
        PyErr_SetString(PyExc_ValueError, "bad shape: need heads a multiple of seq_heads, group, head_dim > 0 and "
                        "0 <= used <= tiles x 16");
    } else if ((size_t)keys.len < (size_t)heads * tiles * head_dim * TILE * key_bytes
               || (size_t)query.len != (size_t)heads * group * head_dim * sizeof(float)
               || (size_t)out.len < (size_t)heads * group * used * sizeof(float)
               || (size_t)importance.len < (size_t)(heads / seq_heads) * used * sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "a buffer's size does not match the shape");
    } else {
#if defined(__x86_64__)
        Py_BEGIN_ALLOW_THREADS
        all_heads(keys.buf, (const float *)query.buf, (float *)out.buf, (float *)importance.buf, aggregation, key_bytes,
                  heads, seq_heads, group, head_dim, tiles, used);
        Py_END_ALLOW_THREADS
#endif
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&query);
    PyBuffer_Release(&out);
    PyBuffer_Release(&importance);
    return result;
}

static PyMethodDef methods[] = {
    {"dots", dots, METH_VARARGS,
     "dots(keys, query, out, importance, aggregation, key_bytes, heads, seq_heads, group, head_dim, tiles, used): raw "
     "q.k into out (float32 [heads, group, used]) and their sum (aggregation 0) or max (1) over each run of seq_heads "
     "heads into importance (float32 [heads / seq_heads, used]); keys [heads, tiles, head_dim, 16] of bfloat16 bits "
     "(key_bytes 2) or float32 (4), query float32 [heads, group, head_dim]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hot_dots", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hot_dots(void) {
    return create_avx2_module(&module, &vectorized);
}
