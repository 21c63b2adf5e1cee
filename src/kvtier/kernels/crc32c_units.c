/* CRC32C of every fixed-size unit of a buffer, in one call.

   A decode step verifies every page it reads back, thousands of them, and one
   Python call per page cost more than the crc itself. Here the loop runs in C
   with the GIL released, three units at a time on x86 so that the crc32
   instruction's three-cycle latency is hidden (the units are independent).
   Results equal crc32c.crc32c's: Castagnoli polynomial, reflected, initial
   value and final xor 0xFFFFFFFF. Machines without SSE4.2 take a table. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define POLY 0x82F63B78u

static uint32_t table[256];

static void build_table(void) {
    for (uint32_t byte = 0; byte < 256; byte++) {
        uint32_t crc = byte;
        for (int bit = 0; bit < 8; bit++)
            crc = (crc >> 1) ^ (POLY & (0u - (crc & 1u)));
        table[byte] = crc;
    }
}

static uint32_t crc_by_table(const uint8_t *data, size_t size) {
    uint32_t crc = 0xFFFFFFFFu;
    for (size_t i = 0; i < size; i++)
        crc = (crc >> 8) ^ table[(crc ^ data[i]) & 0xFFu];
    return ~crc;
}

static void units_by_table(const uint8_t *data, size_t unit, size_t count, uint32_t *out) {
    for (size_t i = 0; i < count; i++)
        out[i] = crc_by_table(data + i * unit, unit);
}

#if defined(__x86_64__)
#include <nmmintrin.h>

__attribute__((target("sse4.2")))
static uint32_t crc_by_instruction(const uint8_t *data, size_t size) {
    uint64_t crc = 0xFFFFFFFFu;
    size_t i = 0;
    for (; i + 8 <= size; i += 8) {
        uint64_t word;
        memcpy(&word, data + i, 8);
        crc = _mm_crc32_u64(crc, word);
    }
    for (; i < size; i++)
        crc = _mm_crc32_u8((uint32_t)crc, data[i]);
    return ~(uint32_t)crc;
}

__attribute__((target("sse4.2")))
static void units_by_instruction(const uint8_t *data, size_t unit, size_t count, uint32_t *out) {
    size_t i = 0;
    for (; i + 3 <= count && unit % 8 == 0; i += 3) {
        const uint8_t *a = data + i * unit, *b = a + unit, *c = b + unit;
        uint64_t crc_a = 0xFFFFFFFFu, crc_b = 0xFFFFFFFFu, crc_c = 0xFFFFFFFFu;
        for (size_t k = 0; k < unit; k += 8) {
            uint64_t word_a, word_b, word_c;
            memcpy(&word_a, a + k, 8);
            memcpy(&word_b, b + k, 8);
            memcpy(&word_c, c + k, 8);
            crc_a = _mm_crc32_u64(crc_a, word_a);
            crc_b = _mm_crc32_u64(crc_b, word_b);
            crc_c = _mm_crc32_u64(crc_c, word_c);
        }
        out[i] = ~(uint32_t)crc_a;
        out[i + 1] = ~(uint32_t)crc_b;
        out[i + 2] = ~(uint32_t)crc_c;
    }
    for (; i < count; i++)
        out[i] = crc_by_instruction(data + i * unit, unit);
}
#endif

static void (*units_impl)(const uint8_t *, size_t, size_t, uint32_t *) = units_by_table;

static PyObject *units(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t unit;
    if (!PyArg_ParseTuple(args, "y*n", &view, &unit))
        return NULL;
    if (unit <= 0 || view.len % unit != 0) {
        PyErr_Format(PyExc_ValueError, "a buffer of %zd bytes is not a whole number of %zd-byte units",
                     view.len, unit);
        PyBuffer_Release(&view);
        return NULL;
    }
    size_t count = (size_t)(view.len / unit);
    PyObject *result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(count * sizeof(uint32_t)));
    if (result != NULL) {
        uint32_t *out = (uint32_t *)PyBytes_AS_STRING(result);
        Py_BEGIN_ALLOW_THREADS
        units_impl((const uint8_t *)view.buf, (size_t)unit, count, out);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"units", units, METH_VARARGS,
     "units(buffer, unit_bytes) -> bytes: the crc32c of each unit, as native-endian uint32 values."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_crc32c_units", NULL, -1, methods};

PyMODINIT_FUNC PyInit__crc32c_units(void) {
    build_table();
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2"))
        units_impl = units_by_instruction;
#endif
    return PyModule_Create(&module);
}
