/* What the host's AVX2 + FMA kernels (hot_dots.c, chosen_values.c, summed_query.c) share: their module, created with a
   `vectorized` constant that says whether this CPU runs them (x86-64 with AVX2 and FMA). Where it is 0 the
   kernels refuse to run and the Python side keeps torch's ops. Include after Python.h. */

#ifndef KVTIER_AVX2_MODULE_H
#define KVTIER_AVX2_MODULE_H

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
