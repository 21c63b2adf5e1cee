/* The lookahead's predicted summed query (lookahead.py, FoldedProjection) in one call per layer.

   Each decode step the lookahead predicts the next layer's query from this
   layer's input: RMS-normalize the hidden state, multiply it by the layer's
   folded projection (each KV head's group of query rows summed, the norm's
   gain folded in, float32) and rotate it. In torch that is five small ops
   whose dispatch, with everything out of cache mid-model, cost several times
   the product itself. Here the norm, the product (a row
   of the weight is read once for every sequence) and the rotation run in one
   pass. x86-64 with AVX2 and FMA only (`vectorized`); elsewhere the torch ops
   stay. The GIL is released while it runs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#include "avx2_module.h"

#define MAX_HEAD_DIM 1024 /* the rotation's scratch row lives on the stack */

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2,fma")))
static float dot(const float *a, const float *b, Py_ssize_t n) {
    __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
    Py_ssize_t k = 0;
    for (; k + 16 <= n; k += 16) {
        low = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), low);
        high = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), high);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(low, high));
    float sum = 0.0f;
    for (int lane = 0; lane < 8; lane++)
        sum += lanes[lane];
    for (; k < n; k++)
        sum += a[k] * b[k];
    return sum;
}

/* out[b] = rotate(rms_norm(hidden[b]) . weight^T + bias): hidden [batch, width], weight [rows, width], bias [rows]
   or NULL, rotation [rotations, 2, head_dim] (cos, then sin with its first half negated; one for every sequence or
   one shared), out [batch, rows]. */
__attribute__((target("avx2,fma")))
static void summed_queries(const float *hidden, const float *weight, const float *bias, const float *rotation,
                           Py_ssize_t rotations, float *out, Py_ssize_t batch, Py_ssize_t width, Py_ssize_t rows,
                           int head_dim, float epsilon) {
    for (Py_ssize_t r = 0; r < rows; r++)  /* rows outermost: a weight row stays in cache for every sequence */
        for (Py_ssize_t b = 0; b < batch; b++)
            out[b * rows + r] = dot(weight + r * width, hidden + b * width, width);
    int half = head_dim / 2;
    float raw[MAX_HEAD_DIM];
    for (Py_ssize_t b = 0; b < batch; b++) {
        const float *row = hidden + b * width;
        float scale = 1.0f / sqrtf(dot(row, row, width) / (float)width + epsilon);  /* the norm, applied after */
        const float *cosine = rotation + (size_t)(rotations == 1 ? 0 : b) * 2 * head_dim;
        const float *signed_sine = cosine + head_dim;
        for (Py_ssize_t head = 0; head * head_dim < rows; head++) {
            float *query = out + b * rows + head * head_dim;
            for (int d = 0; d < head_dim; d++)
                raw[d] = query[d] * scale + (bias ? bias[head * head_dim + d] : 0.0f);
            for (int d = 0; d < head_dim; d++)  /* q x cos + rotate_half(q) x sin; rotate_half is a roll by half */
                query[d] = raw[d] * cosine[d] + raw[(d + half) % head_dim] * signed_sine[d];
        }
    }
}
#endif

static int vectorized = 0;

static PyObject *summed_query(PyObject *self, PyObject *args) {
    Py_buffer hidden, weight, bias, rotation, out;
    Py_ssize_t batch, width, rows;
    int head_dim;
    float epsilon;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*nnnif", &hidden, &weight, &bias, &rotation, &out, &batch, &width, &rows,
                          &head_dim, &epsilon))
        return NULL;
    PyObject *result = NULL;
    size_t floats = sizeof(float);
    if (!vectorized) {
        PyErr_SetString(PyExc_RuntimeError, "summed_query needs an x86-64 CPU with AVX2 and FMA");
    } else if (batch <= 0 || width <= 0 || head_dim <= 0 || head_dim % 2 || head_dim > MAX_HEAD_DIM
               || rows <= 0 || rows % head_dim) {
        PyErr_SetString(PyExc_ValueError, "bad shape: need batch, width > 0, an even head_dim <= 1024 and rows a "
                                          "multiple of it");
    } else if ((size_t)hidden.len != batch * width * floats || (size_t)weight.len != rows * width * floats
               || (bias.len != 0 && (size_t)bias.len != rows * floats)
               || ((size_t)rotation.len != 2 * head_dim * floats
                   && (size_t)rotation.len != batch * 2 * head_dim * floats)
               || (size_t)out.len != batch * rows * floats) {
        PyErr_SetString(PyExc_ValueError, "a buffer's size does not match the shape");
    } else {
#if defined(__x86_64__)
        Py_BEGIN_ALLOW_THREADS
        summed_queries((const float *)hidden.buf, (const float *)weight.buf,
                       bias.len ? (const float *)bias.buf : NULL, (const float *)rotation.buf,
                       (Py_ssize_t)(rotation.len / (2 * head_dim * floats)), (float *)out.buf,
                       batch, width, rows, head_dim, epsilon);
        Py_END_ALLOW_THREADS
#endif
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&hidden);
    PyBuffer_Release(&weight);
    PyBuffer_Release(&bias);
    PyBuffer_Release(&rotation);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"summed_query", summed_query, METH_VARARGS,
     "summed_query(hidden, weight, bias, rotation, out, batch, width, rows, head_dim, epsilon): out (float32 "
     "[batch, rows]) = the rotated product of the RMS-normalized hidden [batch, width] with weight [rows, width] "
     "plus bias ([rows], or empty for none); rotation [batch or 1, 2, head_dim]: cos, then sin with its first "
     "half negated. All float32."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_summed_query", NULL, -1, methods};

PyMODINIT_FUNC PyInit__summed_query(void) {
    return create_avx2_module(&module, &vectorized);
}
