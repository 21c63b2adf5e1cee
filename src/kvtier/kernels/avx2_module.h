/* What the host's AVX2 + FMA kernels (hot_dots.c, chosen_values.c, candidate_dots.c, summed_query.c) share: their
   module, created with a `vectorized` constant that says whether this CPU runs them (x86-64 with AVX2 and FMA).
   Where it is 0 the kernels refuse to run and the Python side keeps torch's ops; and the load of eight float32 or
   bfloat16 numbers their loops share, and the check of their per-sequence counts. Include after Python.h. */

#ifndef KVTIER_AVX2_MODULE_H
#define KVTIER_AVX2_MODULE_H

#include <stdint.h>

#if defined(__x86_64__)
#include <immintrin.h>

/* Eight numbers from `data` (bfloat16 bits when `bf16`, else float32) at index `at`, as float32: a bfloat16 is the
   top half of a float32. */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 eight_floats(const void *data, size_t at, int bf16) {
    if (!bf16)
        return _mm256_loadu_ps((const float *)data + at);
    __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)data + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

/* Whether each of `batch` counts (the rows a kernel takes per sequence) lies in [0, width]. */
static inline int counts_fit(const int64_t *counts, int batch, Py_ssize_t width) {
    for (int b = 0; b < batch; b++)
        if (counts[b] < 0 || counts[b] > width)
            return 0;
    return 1;
}

/* `definition`'s module with its `vectorized` constant, which `*vectorized` also receives; NULL on error. */
static PyObject *create_avx2_module(struct PyModuleDef *definition, int *vectorized) {
    *vectorized = 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    *vectorized = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    PyObject *created = PyModule_Create(definition);
    if (created != NULL && PyModule_AddIntConstant(created, "vectorized", *vectorized) < 0) {
        Py_DECREF(created);
        return NULL;
    }
    return created;
}

#endif
