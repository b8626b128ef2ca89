/* The correlator's three hottest loops in C, each one pass where NumPy takes dozens of whole-array operations
   (at the agent's nominal load they were a fifth of its time). intervals.py and reuse.py hold the NumPy
   versions, which run where this module was not built; tests hold the two alike.

   covered_and_subsets(group, start, end, masks, subsets, cover, subset_cover, first)
       intervals.covered_and_subsets: per group, the length covered by the union of its intervals, the same
       for each mask's rows (up to 32 masks, a byte a row each), and its earliest start. Rows are counted into
       their groups and each group's swept once: in start order, or backwards in end order (a worker's reads
       come so), else sorted by start.
   earlier_and_larger(values, weights, out)
       reuse.earlier_and_larger: per position, the summed weights of the earlier positions with a larger value,
       by a Fenwick tree over the values (over their ranks, where they lie far apart).
   equal_join_table(table, lows, spans, columns, left_of, right_of) -> pairs
       intervals.equal_join_columns's probe: each right row inside every column's range [low, low + span)
       looked up in the left rows' table of packed keys.

   Arrays come through the buffer protocol, C-contiguous, and are checked for their item type and length;
   the results go into arrays the caller made. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A one-dimensional C-contiguous buffer, and its items. */
typedef struct {
    Py_buffer view;
    Py_ssize_t n;
    char code;  /* the struct module's code of its items */
} Array;

static int
array_get(PyObject *object, Array *array, const char *name, char kind, int writable)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, &array->view, flags) < 0)
        return -1;
    const char *format = array->view.format ? array->view.format : "B";
    if (*format == '@' || *format == '=' || *format == '<')
        format++;
    int ok = array->view.ndim <= 1 && format[0] != '\0' && format[1] == '\0';
    if (ok && kind == 'i')  /* any integer */
        ok = strchr("bBhHiIlLqQ?", format[0]) != NULL;
    else if (ok && kind == 'q')  /* int64 */
        ok = (format[0] == 'q' || format[0] == 'l') && array->view.itemsize == 8;
    else if (ok && kind == 'd')
        ok = format[0] == 'd';
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s: expected a one-dimensional array of %s, got format '%s'", name,
                     kind == 'd' ? "float64" : kind == 'q' ? "int64" : "integers", format);
        PyBuffer_Release(&array->view);
        return -1;
    }
    array->n = array->view.len / array->view.itemsize;
    array->code = format[0];
    return 0;
}

static inline int64_t
load(const Array *array, Py_ssize_t i)
{
    const char *at = (const char *)array->view.buf + i * array->view.itemsize;
    int is_unsigned = array->code == '?' || (array->code >= 'A' && array->code <= 'Z');
    switch (array->view.itemsize) {
    case 1: return is_unsigned ? (int64_t)*(const uint8_t *)at : (int64_t)*(const int8_t *)at;
    case 2: return is_unsigned ? (int64_t)*(const uint16_t *)at : (int64_t)*(const int16_t *)at;
    case 4: return is_unsigned ? (int64_t)*(const uint32_t *)at : (int64_t)*(const int32_t *)at;
    default: return *(const int64_t *)at;  /* an unsigned one as its bits */
    }
}

static int
same_length(const Array *array, Py_ssize_t n, const char *name)
{
    if (array->n == n)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s: %zd items, expected %zd", name, array->n, n);
    return -1;
}

/* Sort `rows` (indices) by `key[row]`, stably: insertion sort within runs of 16, then merges, each skipped
   when its halves are in order already. A group's rows are in end order, mostly start order too: a pass over
   them, no more, in the usual case. */
static void
sort_rows(int64_t *rows, int64_t *spare, Py_ssize_t n, const int64_t *key)
{
    enum { RUN = 16 };
    for (Py_ssize_t low = 0; low < n; low += RUN) {
        Py_ssize_t high = low + RUN < n ? low + RUN : n;
        for (Py_ssize_t i = low + 1; i < high; i++) {
            int64_t row = rows[i];
            Py_ssize_t j = i;
            while (j > low && key[rows[j - 1]] > key[row]) {
                rows[j] = rows[j - 1];
                j--;
            }
            rows[j] = row;
        }
    }
    for (Py_ssize_t width = RUN; width < n; width *= 2) {
        for (Py_ssize_t low = 0; low + width < n; low += 2 * width) {
            Py_ssize_t middle = low + width, high = low + 2 * width < n ? low + 2 * width : n;
            if (key[rows[middle - 1]] <= key[rows[middle]])
                continue;
            memcpy(spare + low, rows + low, (size_t)(middle - low) * sizeof *rows);
            Py_ssize_t i = low, j = middle, k = low;
            while (i < middle && j < high)
                rows[k++] = key[rows[j]] < key[spare[i]] ? rows[j++] : spare[i++];
            while (i < middle)
                rows[k++] = spare[i++];
        }
    }
}

/* An interval's part past the furthest end so far (intervals in start order); the furthest end moves on.
   Without branches: whether an interval adds anything is as random as the reads, and a mispredicted branch
   costs more than the sweep. Lengths in unsigned arithmetic: forged times wrap around as NumPy's do. */
static inline void
sweep(int64_t start, int64_t end, int64_t *furthest, uint64_t *covered)
{
    int64_t from = start > *furthest ? start : *furthest;
    *covered += end > from ? (uint64_t)end - (uint64_t)from : 0;
    *furthest = end > *furthest ? end : *furthest;
}

/* The same on the mirrored timeline (intervals in end order, taken from the last): the part before the
   earliest start so far. */
static inline void
sweep_back(int64_t start, int64_t end, int64_t *earliest, uint64_t *covered)
{
    int64_t to = end < *earliest ? end : *earliest;
    *covered += to > start ? (uint64_t)to - (uint64_t)start : 0;
    *earliest = start < *earliest ? start : *earliest;
}

static int
in_order(const int64_t *values, Py_ssize_t n)
{
    for (Py_ssize_t i = 1; i < n; i++)
        if (values[i] < values[i - 1])
            return 0;
    return 1;
}

static PyObject *
covered_and_subsets(PyObject *module, PyObject *args)
{
    PyObject *objects[7];
    Py_ssize_t subsets;
    if (!PyArg_ParseTuple(args, "OOOOnOOO:covered_and_subsets", &objects[0], &objects[1], &objects[2],
                          &objects[3], &subsets, &objects[4], &objects[5], &objects[6]))
        return NULL;
    static const char *names[7] = {"group", "start", "end", "masks", "cover", "subset_cover", "first"};
    static const char kinds[7] = {'q', 'q', 'q', 'i', 'q', 'q', 'q'};
    Array arrays[7];
    int got = 0;
    PyObject *result = NULL;
    int64_t *place = NULL, *starts = NULL, *ends = NULL, *rows = NULL, *spare = NULL;
    uint32_t *bits = NULL;
    for (; got < 7; got++)
        if (array_get(objects[got], &arrays[got], names[got], kinds[got], got >= 4) < 0)
            goto done;
    const Array *group = &arrays[0], *start = &arrays[1], *end = &arrays[2], *masks = &arrays[3];
    Py_ssize_t n = group->n, groups = arrays[4].n;
    if (same_length(start, n, "start") < 0 || same_length(end, n, "end") < 0 ||
        same_length(&arrays[6], groups, "first") < 0)
        goto done;
    if (subsets < 0 || subsets > 32 || masks->view.itemsize != 1 || masks->n != subsets * n) {
        PyErr_SetString(PyExc_ValueError, "masks: up to 32, each a byte a row");
        goto done;
    }
    if (arrays[5].n != subsets * groups) {
        PyErr_SetString(PyExc_ValueError, "subset_cover: one row of groups per mask");
        goto done;
    }
    const int64_t *g = group->view.buf, *s = start->view.buf, *e = end->view.buf;
    const uint8_t *mask = masks->view.buf;
    int64_t *cover = arrays[4].view.buf, *subset_cover = arrays[5].view.buf, *first = arrays[6].view.buf;
    place = PyMem_Calloc((size_t)groups + 1, sizeof *place);
    starts = PyMem_Malloc((size_t)(n + 1) * sizeof *starts);
    ends = PyMem_Malloc((size_t)(n + 1) * sizeof *ends);
    bits = PyMem_Malloc((size_t)(n + 1) * sizeof *bits);
    if (!place || !starts || !ends || !bits) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (g[i] < 0 || g[i] >= groups) {
            PyErr_Format(PyExc_IndexError, "group %lld of row %zd is outside [0, %zd)", (long long)g[i], i, groups);
            goto done;
        }
        place[g[i] + 1]++;
    }
    for (Py_ssize_t k = 0; k < groups; k++)
        place[k + 1] += place[k];
    /* Each row's interval and masks laid out by group, in row order within each: the sweeps below read them
       in order. */
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t at = place[g[i]]++;
        starts[at] = s[i];
        ends[at] = e[i];
        uint32_t in = 0;
        for (Py_ssize_t j = 0; j < subsets; j++)
            in |= (uint32_t)(mask[j * n + i] != 0) << j;
        bits[at] = in;
    }
    int64_t furthest[33];
    uint64_t covered[33];  /* [0] for all the group's rows, [j + 1] for the j-th mask's */
    Py_ssize_t low = 0;
    for (Py_ssize_t k = 0; k < groups; k++) {
        Py_ssize_t high = place[k], count = high - low;
        const int64_t *gs = starts + low, *ge = ends + low;
        const uint32_t *gb = bits + low;
        memset(covered, 0, sizeof covered);
        int by_start = count < 2 || in_order(gs, count);
        if (!by_start && in_order(ge, count)) {
            for (Py_ssize_t j = 0; j <= subsets; j++)
                furthest[j] = INT64_MAX;
            for (Py_ssize_t i = count - 1; i >= 0; i--) {
                sweep_back(gs[i], ge[i], &furthest[0], &covered[0]);
                for (uint32_t in = gb[i]; in; in &= in - 1)
                    sweep_back(gs[i], ge[i], &furthest[__builtin_ctz(in) + 1], &covered[__builtin_ctz(in) + 1]);
            }
            first[k] = furthest[0];
        }
        else {
            const int64_t *order = NULL;  /* the rows by start, where they are not in that order already */
            if (!by_start) {
                if (!rows) {
                    rows = PyMem_Malloc((size_t)n * sizeof *rows);
                    spare = PyMem_Malloc((size_t)n * sizeof *spare);
                    if (!rows || !spare) {
                        PyErr_NoMemory();
                        goto done;
                    }
                }
                for (Py_ssize_t i = 0; i < count; i++)
                    rows[i] = i;
                sort_rows(rows, spare, count, gs);
                order = rows;
            }
            for (Py_ssize_t j = 0; j <= subsets; j++)
                furthest[j] = INT64_MIN;
            for (Py_ssize_t r = 0; r < count; r++) {
                Py_ssize_t i = order ? order[r] : r;
                sweep(gs[i], ge[i], &furthest[0], &covered[0]);
                for (uint32_t in = gb[i]; in; in &= in - 1)
                    sweep(gs[i], ge[i], &furthest[__builtin_ctz(in) + 1], &covered[__builtin_ctz(in) + 1]);
            }
            first[k] = count ? gs[order ? order[0] : 0] : INT64_MAX;
        }
        cover[k] = (int64_t)covered[0];
        for (Py_ssize_t j = 0; j < subsets; j++)
            subset_cover[j * groups + k] = (int64_t)covered[j + 1];
        low = high;
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(place);
    PyMem_Free(starts);
    PyMem_Free(ends);
    PyMem_Free(bits);
    PyMem_Free(rows);
    PyMem_Free(spare);
    while (got-- > 0)
        PyBuffer_Release(&arrays[got].view);
    return result;
}

typedef struct {
    int64_t value;
    Py_ssize_t index;
} Ranked;

static int
by_value(const void *a, const void *b)
{
    int64_t x = ((const Ranked *)a)->value, y = ((const Ranked *)b)->value;
    return (x > y) - (x < y);
}

static PyObject *
earlier_and_larger(PyObject *module, PyObject *args)
{
    PyObject *objects[3];
    if (!PyArg_ParseTuple(args, "OOO:earlier_and_larger", &objects[0], &objects[1], &objects[2]))
        return NULL;
    static const char *names[3] = {"values", "weights", "out"};
    static const char kinds[3] = {'q', 'd', 'd'};
    Array arrays[3];
    int got = 0;
    PyObject *result = NULL;
    double *tree = NULL;
    Ranked *ranked = NULL;
    int64_t *ranks = NULL;
    for (; got < 3; got++)
        if (array_get(objects[got], &arrays[got], names[got], kinds[got], got == 2) < 0)
            goto done;
    Py_ssize_t m = arrays[0].n;
    if (same_length(&arrays[1], m, "weights") < 0 || same_length(&arrays[2], m, "out") < 0)
        goto done;
    const int64_t *values = arrays[0].view.buf;
    const double *weights = arrays[1].view.buf;
    double *out = arrays[2].view.buf;
    int64_t top = -1;
    for (Py_ssize_t q = 0; q < m; q++) {
        if (values[q] < 0) {
            PyErr_Format(PyExc_ValueError, "values: %lld is negative", (long long)values[q]);
            goto done;
        }
        if (values[q] > top)
            top = values[q];
    }
    const int64_t *place = values;  /* each value's node in the tree, less one */
    if (top >= 4 * (int64_t)m + 1024) {  /* values far apart (not the what-if's positions): their ranks instead */
        ranked = PyMem_Malloc((size_t)m * sizeof *ranked);
        ranks = PyMem_Malloc((size_t)m * sizeof *ranks);
        if (!ranked || !ranks) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t q = 0; q < m; q++)
            ranked[q] = (Ranked){values[q], q};
        qsort(ranked, (size_t)m, sizeof *ranked, by_value);
        int64_t rank = -1;
        for (Py_ssize_t r = 0; r < m; r++) {
            rank += r == 0 || ranked[r].value != ranked[r - 1].value;  /* equal values, equal ranks */
            ranks[ranked[r].index] = rank;
        }
        place = ranks;
        top = rank;
    }
    Py_ssize_t size = (Py_ssize_t)top + 1;  /* the tree's nodes 1..size: value v at node v + 1 */
    tree = PyMem_Calloc((size_t)size + 1, sizeof *tree);
    if (!tree) {
        PyErr_NoMemory();
        goto done;
    }
    double seen = 0.0;
    for (Py_ssize_t q = 0; q < m; q++) {
        double at_most = 0.0;  /* the weight of the values up to this one */
        for (Py_ssize_t node = (Py_ssize_t)place[q] + 1; node > 0; node &= node - 1)
            at_most += tree[node];
        out[q] = seen - at_most;
        for (Py_ssize_t node = (Py_ssize_t)place[q] + 1; node <= size; node += node & -node)
            tree[node] += weights[q];
        seen += weights[q];
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(tree);
    PyMem_Free(ranked);
    PyMem_Free(ranks);
    while (got-- > 0)
        PyBuffer_Release(&arrays[got].view);
    return result;
}

static PyObject *
equal_join_table(PyObject *module, PyObject *args)
{
    PyObject *table_object, *lows_object, *spans_object, *columns, *left_object, *right_object;
    if (!PyArg_ParseTuple(args, "OOOO!OO:equal_join_table", &table_object, &lows_object, &spans_object,
                          &PyTuple_Type, &columns, &left_object, &right_object))
        return NULL;
    Py_ssize_t c = PyTuple_GET_SIZE(columns);
    if (c == 0) {
        PyErr_SetString(PyExc_ValueError, "columns: none");
        return NULL;
    }
    Array fixed[5], *column = PyMem_Calloc((size_t)c, sizeof *column);
    if (!column)
        return PyErr_NoMemory();
    static const char *names[5] = {"table", "lows", "spans", "left_of", "right_of"};
    static const char kinds[5] = {'q', 'q', 'q', 'q', 'q'};
    PyObject *objects[5] = {table_object, lows_object, spans_object, left_object, right_object};
    int got = 0, got_columns = 0;
    PyObject *result = NULL;
    for (; got < 5; got++)
        if (array_get(objects[got], &fixed[got], names[got], kinds[got], got >= 3) < 0)
            goto done;
    for (; got_columns < c; got_columns++)
        if (array_get(PyTuple_GET_ITEM(columns, got_columns), &column[got_columns], "columns", 'i', 0) < 0)
            goto done;
    if (same_length(&fixed[1], c, "lows") < 0 || same_length(&fixed[2], c, "spans") < 0)
        goto done;
    Py_ssize_t n = column[0].n;
    for (Py_ssize_t j = 1; j < c; j++)
        if (same_length(&column[j], n, "columns") < 0)
            goto done;
    if (same_length(&fixed[3], n, "left_of") < 0 || same_length(&fixed[4], n, "right_of") < 0)
        goto done;
    const int64_t *table = fixed[0].view.buf, *lows = fixed[1].view.buf, *spans = fixed[2].view.buf;
    int64_t *left_of = fixed[3].view.buf, *right_of = fixed[4].view.buf;
    int64_t product = 1;
    for (Py_ssize_t j = 0; j < c; j++) {
        if (spans[j] <= 0 || product > fixed[0].n / spans[j]) {
            PyErr_SetString(PyExc_ValueError, "spans: the table holds fewer keys than their product");
            goto done;
        }
        product *= spans[j];
    }
    if (product != fixed[0].n) {
        PyErr_SetString(PyExc_ValueError, "spans: the table holds fewer keys than their product");
        goto done;
    }
    Py_ssize_t pairs = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t key = 0;
        Py_ssize_t j = 0;
        for (; j < c; j++) {
            /* the difference in unsigned arithmetic: a value far outside the range cannot overflow */
            uint64_t offset = (uint64_t)load(&column[j], i) - (uint64_t)lows[j];
            if (offset >= (uint64_t)spans[j])
                break;
            key = key * spans[j] + (int64_t)offset;
        }
        if (j < c || table[key] < 0)
            continue;
        left_of[pairs] = table[key];
        right_of[pairs++] = i;
    }
    result = PyLong_FromSsize_t(pairs);
done:
    while (got_columns-- > 0)
        PyBuffer_Release(&column[got_columns].view);
    while (got-- > 0)
        PyBuffer_Release(&fixed[got].view);
    PyMem_Free(column);
    return result;
}

static PyMethodDef methods[] = {
    {"covered_and_subsets", covered_and_subsets, METH_VARARGS,
     "covered_and_subsets(group, start, end, masks, subsets, cover, subset_cover, first): intervals.covered_and_subsets "
     "into the given arrays."},
    {"earlier_and_larger", earlier_and_larger, METH_VARARGS,
     "earlier_and_larger(values, weights, out): reuse.earlier_and_larger into out."},
    {"equal_join_table", equal_join_table, METH_VARARGS,
     "equal_join_table(table, lows, spans, columns, left_of, right_of) -> pairs: the rows of columns found in "
     "the table, their pairs at the front of left_of and right_of."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "stallwatch.correlator._kernels",
    .m_doc = "The correlator's hottest loops in C (intervals.py and reuse.py hold their NumPy versions).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__kernels(void)
{
    return PyModule_Create(&module);
}
