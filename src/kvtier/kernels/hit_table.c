/* The hit table's two per-layer passes of a decode step (hit_table.py), in one call each.

   `record` adds a hit to every chosen token and stamps it with the step; in
   numpy that was five passes over the chosen (their flat indices, a gather, a
   minimum, an add, two scatters). `any_idle` says per sequence whether some hot
   token has gone unchosen for at least a number of steps, and `any_hit` whether
   some chosen cold token has enough hits, which the migration check asks every
   layer and step (migration.py): numpy derived the idle count of every hot
   token first, where a scan stops at the first idle one, most often within a
   few tokens, and took each sequence's chosen cold tokens in calls of its own.
   The GIL is kept: the calls are short. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define SATURATED 255

/* Whether every row's positions lie in [0, capacity). */
static int positions_in_table(const int64_t *positions, Py_ssize_t rows, Py_ssize_t n, Py_ssize_t stride,
                              Py_ssize_t capacity) {
    for (Py_ssize_t row = 0; row < rows; row++)
        for (Py_ssize_t j = 0; j < n; j++)
            if (positions[row * stride + j] < 0 || positions[row * stride + j] >= capacity)
                return 0;
    return 1;
}

/* Checks the table arguments both calls share; 0 with the error set where a buffer or a position does not fit. */
static int table_fits(Py_buffer *table, Py_buffer *positions, Py_ssize_t rows, Py_ssize_t capacity, Py_ssize_t n,
                      Py_ssize_t stride) {
    if (rows < 0 || capacity < 0 || n < 0 || stride < n) {
        PyErr_SetString(PyExc_ValueError, "bad shape: need rows, capacity, n >= 0 and stride >= n");
        return 0;
    }
    if ((size_t)table->len != (size_t)(rows * capacity)
        || (rows && (size_t)positions->len < (size_t)((rows - 1) * stride + n) * sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "a buffer's size does not match the shape");
        return 0;
    }
    if (!positions_in_table((const int64_t *)positions->buf, rows, n, stride, capacity)) {
        PyErr_SetString(PyExc_ValueError, "a position lies outside the table");
        return 0;
    }
    return 1;
}

static PyObject *record(PyObject *self, PyObject *args) {
    Py_buffer hits, stamp, positions;
    Py_ssize_t rows, capacity, n, stride;
    int now;
    if (!PyArg_ParseTuple(args, "w*w*y*nnnni", &hits, &stamp, &positions, &rows, &capacity, &n, &stride, &now))
        return NULL;
    PyObject *result = NULL;
    if (stamp.len != hits.len) {
        PyErr_SetString(PyExc_ValueError, "hits and stamps differ in size");
    } else if (table_fits(&hits, &positions, rows, capacity, n, stride)) {
        uint8_t *row_hits = hits.buf, *row_stamps = stamp.buf;
        const int64_t *chosen = positions.buf;
        for (Py_ssize_t row = 0; row < rows; row++, row_hits += capacity, row_stamps += capacity, chosen += stride)
            for (Py_ssize_t j = 0; j < n; j++) {
                uint8_t *token = row_hits + chosen[j];
                *token += *token < SATURATED;
                row_stamps[chosen[j]] = (uint8_t)now;
            }
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&hits);
    PyBuffer_Release(&stamp);
    PyBuffer_Release(&positions);
    return result;
}

static PyObject *any_idle(PyObject *self, PyObject *args) {
    Py_buffer stamp, positions, out;
    Py_ssize_t rows, capacity, n, stride;
    int now, steps;
    if (!PyArg_ParseTuple(args, "y*y*w*nnnnii", &stamp, &positions, &out, &rows, &capacity, &n, &stride, &now,
                          &steps))
        return NULL;
    PyObject *result = NULL;
    if ((size_t)out.len != (size_t)rows) {
        PyErr_SetString(PyExc_ValueError, "a buffer's size does not match the shape");
    } else if (table_fits(&stamp, &positions, rows, capacity, n, stride)) {
        const uint8_t *row_stamps = stamp.buf;
        const int64_t *row_positions = positions.buf;
        uint8_t *idle = out.buf;
        for (Py_ssize_t row = 0; row < rows; row++, row_stamps += capacity, row_positions += stride) {
            Py_ssize_t j = 0;
            while (j < n && (uint8_t)(now - row_stamps[row_positions[j]]) < steps)  /* stamps wrap, as the steps do */
                j++;
            idle[row] = j < n;
        }
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&stamp);
    PyBuffer_Release(&positions);
    PyBuffer_Release(&out);
    return result;
}

/* Whether every row's first column lies in [0, n]. */
static int firsts_in_row(const int64_t *first, Py_ssize_t rows, Py_ssize_t n) {
    for (Py_ssize_t row = 0; row < rows; row++)
        if (first[row] < 0 || first[row] > n)
            return 0;
    return 1;
}

static PyObject *any_hit(PyObject *self, PyObject *args) {
    Py_buffer hits, positions, first, out;
    Py_ssize_t rows, capacity, n, stride;
    int needed;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnnni", &hits, &positions, &first, &out, &rows, &capacity, &n, &stride,
                          &needed))
        return NULL;
    PyObject *result = NULL;
    if ((size_t)out.len != (size_t)rows || (size_t)first.len != (size_t)rows * sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "a buffer's size does not match the shape");
    } else if (!firsts_in_row((const int64_t *)first.buf, rows, n)) {
        PyErr_SetString(PyExc_ValueError, "a row's first column lies outside the row");
    } else if (table_fits(&hits, &positions, rows, capacity, n, stride)) {
        const uint8_t *row_hits = hits.buf;
        const int64_t *row_positions = positions.buf, *firsts = first.buf;
        uint8_t *found = out.buf;
        for (Py_ssize_t row = 0; row < rows; row++, row_hits += capacity, row_positions += stride) {
            Py_ssize_t j = firsts[row];
            while (j < n && row_hits[row_positions[j]] < needed)
                j++;
            found[row] = j < n;
        }
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&hits);
    PyBuffer_Release(&positions);
    PyBuffer_Release(&first);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"record", record, METH_VARARGS,
     "record(hits, stamp, positions, rows, capacity, n, stride, now): for j < n of each row, hits[row, p] += 1 (up to "
     "255) and stamp[row, p] = now, p = positions[row x stride + j]; hits and stamp uint8 [rows, capacity], positions "
     "int64 (distinct within a row)."},
    {"any_idle", any_idle, METH_VARARGS,
     "any_idle(stamp, positions, out, rows, capacity, n, stride, now, steps): out[row] (uint8 [rows]) = 1 where some "
     "p = positions[row x stride + j], j < n, has (now - stamp[row, p]) mod 256 >= steps, else 0."},
    {"any_hit", any_hit, METH_VARARGS,
     "any_hit(hits, positions, first, out, rows, capacity, n, stride, needed): out[row] (uint8 [rows]) = 1 where some "
     "p = positions[row x stride + j], first[row] <= j < n (first int64 [rows]), has hits[row, p] >= needed, else 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hit_table", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hit_table(void) {
    return PyModule_Create(&module);
}
