/* rankmeter._treader: a plain TREC file read in C (rankmeter/trec.py, `_plain`), built by
   scripts/build_native.py; trec.py reads without it too, the same, slower.

   read(data: bytes, width, doc_field, value_field, whole) -> ([(qid, {doc: value})], tag) | None

   A plain file is ASCII; its fields are separated by spaces or tabs, its lines by \n; every
   non-blank line has exactly `width` fields and none starts with `#`; a query's documents
   are not repeated within a run of its lines; every value is what Python's float() reads, without `_`
   (float() itself reads it: PyFloat_FromString), and with `whole` (qrels for trec_eval's
   names) a whole number [+-]digits{1,18}, which float() and trec_eval's atol read alike.
   Anything else is None: the line-by-line Python reader then reads the file and words its
   problems. One (qid, {doc: value}) per run of consecutive lines of one query; `tag` is the
   last line's field `width - 1`. NaN and infinities are trec.py's to judge.

   lines(qids: [str], columns: [(prefix: str, kind: str, values: list)]) -> str

   trec_eval's per-query lines (trec_eval/report.py, `_per_query_lines`): for each query in
   order, one line per column, `prefix qid \t value \n`; a value prints as `%6.4f` (kind
   "f", a float: C's printf, as trec_eval prints it; NaN as Python prints it), `%ld` (kind
   "d", a float truncated as int() does) or as the str given (kind "s").

   cells(scores: [dict], grades: [dict], order_of: dict, score, doc, grade) -> bool

   engine/batch.py `stack_scored`'s per-document pass: for each query's {doc: score} in
   order, each document's score, order_of[doc] and grades[query].get(doc, NaN) into the
   writable float64, int64 and float64 buffers score, doc and grade (one slot per document).
   False, nothing promised written, when a mapping is not exactly a dict: the Python pass. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define MAX_WIDTH 16

static int is_whole(const char *p, Py_ssize_t size) {
    if (size > 0 && (*p == '+' || *p == '-')) p++, size--;
    if (size < 1 || size > 18) return 0;
    for (Py_ssize_t i = 0; i < size; i++)
        if (p[i] < '0' || p[i] > '9') return 0;
    return 1;
}

/* 1: added; 0: not plain (a repeated document, a value float() refuses); -1: an error. */
static int add(PyObject *table, const char *doc, Py_ssize_t doc_size, const char *value, Py_ssize_t value_size,
               int whole) {
    if (whole && !is_whole(value, value_size)) return 0;
    if (memchr(value, '_', value_size)) return 0;  /* float() reads 1_0 as 10, atof as 1: trec.py refuses it */
    PyObject *key = PyUnicode_DecodeASCII(doc, doc_size, NULL);
    if (key == NULL) return -1;
    PyObject *text = PyUnicode_DecodeASCII(value, value_size, NULL);
    if (text == NULL) { Py_DECREF(key); return -1; }
    PyObject *number = PyFloat_FromString(text);
    Py_DECREF(text);
    if (number == NULL) {
        Py_DECREF(key);
        if (!PyErr_ExceptionMatches(PyExc_ValueError)) return -1;
        PyErr_Clear();
        return 0;
    }
    Py_ssize_t before = PyDict_GET_SIZE(table);
    int failed = PyDict_SetItem(table, key, number);
    Py_DECREF(key);
    Py_DECREF(number);
    if (failed) return -1;
    return PyDict_GET_SIZE(table) > before;
}

static int append_run(PyObject *runs, const char *qid, Py_ssize_t size, PyObject *table) {
    PyObject *run = Py_BuildValue("(s#O)", qid, size, table);
    if (run == NULL) return -1;
    int failed = PyList_Append(runs, run);
    Py_DECREF(run);
    return failed;
}

static PyObject *read_plain(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t width, doc_field, value_field;
    int whole;
    if (!PyArg_ParseTuple(args, "y*nnnp", &buf, &width, &doc_field, &value_field, &whole)) return NULL;
    PyObject *runs = PyList_New(0), *table = NULL, *result = NULL;
    const char *p = buf.buf, *end = p + buf.len;
    const char *start[MAX_WIDTH], *stop[MAX_WIDTH];
    const char *qid = NULL, *tag = NULL;
    Py_ssize_t qid_size = 0, tag_size = 0;
    int plain = width > 0 && width <= MAX_WIDTH && doc_field >= 0 && doc_field < width && value_field >= 0
                && value_field < width;
    if (runs == NULL) goto done;
    while (plain && p < end) {
        Py_ssize_t n = 0;
        while (p < end && *p != '\n') {
            unsigned char c = (unsigned char)*p;
            if (c == ' ' || c == '\t') { p++; continue; }
            if (c < 32 || c > 127 || n == width) { plain = 0; break; }
            start[n] = p;
            while (p < end && (unsigned char)*p > 32 && (unsigned char)*p <= 127) p++;
            stop[n++] = p;
        }
        if (!plain) break;
        p++;  /* the newline, or past the end */
        if (n == 0) continue;  /* a blank line */
        if (n != width || *start[0] == '#') { plain = 0; break; }
        Py_ssize_t size = stop[0] - start[0];
        if (qid == NULL || size != qid_size || memcmp(qid, start[0], size) != 0) {
            if (qid != NULL && append_run(runs, qid, qid_size, table) < 0) goto done;
            Py_XDECREF(table);
            if ((table = PyDict_New()) == NULL) goto done;
            qid = start[0], qid_size = size;
        }
        int added = add(table, start[doc_field], stop[doc_field] - start[doc_field], start[value_field],
                        stop[value_field] - start[value_field], whole);
        if (added < 0) goto done;
        plain = added;
        tag = start[width - 1], tag_size = stop[width - 1] - start[width - 1];
    }
    if (!plain || qid == NULL) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (append_run(runs, qid, qid_size, table) < 0) goto done;
    result = Py_BuildValue("(Os#)", runs, tag, tag_size);
done:
    Py_XDECREF(runs);
    Py_XDECREF(table);
    PyBuffer_Release(&buf);
    return result;
}

typedef struct { char *data; Py_ssize_t size, capacity; } Out;

/* Room for `more` bytes; 0 when out of memory (the exception is set). */
static int reserve(Out *out, Py_ssize_t more) {
    if (out->size + more <= out->capacity) return 1;
    Py_ssize_t capacity = (out->capacity + more) * 2;
    char *data = PyMem_Realloc(out->data, capacity);
    if (data == NULL) { PyErr_NoMemory(); return 0; }
    out->data = data, out->capacity = capacity;
    return 1;
}

static int put(Out *out, const char *text, Py_ssize_t size) {
    if (!reserve(out, size)) return 0;
    memcpy(out->data + out->size, text, size);
    out->size += size;
    return 1;
}

/* `%ld` of n into text; its length (printf's is slow too). */
static Py_ssize_t whole_text(long n, char *text) {
    char digits[24];
    int size = 0;
    unsigned long u = n < 0 ? 0UL - (unsigned long)n : (unsigned long)n;
    do { digits[size++] = (char)('0' + u % 10); u /= 10; } while (u);
    Py_ssize_t k = 0;
    if (n < 0) text[k++] = '-';
    while (size) text[k++] = digits[--size];
    return k;
}

/* `%6.4f` of x into text (400 bytes). printf is slow (~0.4 us a value; a million values
   per run): a value in [0, 1e5) whose x·10^4 is not within 10^-6 of a half is rounded here
   instead. Below 1e5, x·10^4 < 1e9 is computed within 6e-8 of the exact product, so away
   from a half it rounds as printf rounds the exact decimal expansion; the rest, and
   every other value, go to printf. */
static Py_ssize_t fixed4(double x, char *text) {
    if (!(x >= 0.0 && x < 1e5) || signbit(x)) return snprintf(text, 400, "%6.4f", x);
    double y = x * 10000.0, whole = floor(y), frac = y - whole;
    if (fabs(frac - 0.5) < 1e-6) return snprintf(text, 400, "%6.4f", x);
    unsigned long n = (unsigned long)whole + (frac > 0.5);
    unsigned long decimals = n % 10000;
    Py_ssize_t k = whole_text((long)(n / 10000), text);
    text[k++] = '.';
    text[k++] = (char)('0' + decimals / 1000);
    text[k++] = (char)('0' + decimals / 100 % 10);
    text[k++] = (char)('0' + decimals / 10 % 10);
    text[k++] = (char)('0' + decimals % 10);
    return k;  /* at least "0.0000": 6 characters, %6's width */
}

/* One value as text into `text` (at least 400 bytes: %6.4f of the largest double is 316);
   its length, or -1 with an exception set. */
static Py_ssize_t value_text(char kind, PyObject *value, char *text, const char **str) {
    *str = text;
    if (kind == 's') {
        Py_ssize_t size;
        if ((*str = PyUnicode_AsUTF8AndSize(value, &size)) == NULL) return -1;
        return size;
    }
    double x = PyFloat_AsDouble(value);
    if (x == -1.0 && PyErr_Occurred()) return -1;
    if (kind == 'd') {
        if (!(x > -9223372036854775808.0 && x < 9223372036854775808.0)) {  /* (long)x defined: |x| < 2^63 */
            PyErr_SetString(PyExc_ValueError, "a count out of range");
            return -1;
        }
        return whole_text((long)x, text);
    }
    if (isnan(x)) return snprintf(text, 400, "%6s", "nan");  /* C may print -nan; Python nan */
    return fixed4(x, text);
}

static PyObject *format_lines(PyObject *self, PyObject *args) {
    PyObject *qids, *columns;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &qids, &PyList_Type, &columns)) return NULL;
    Py_ssize_t nq = PyList_GET_SIZE(qids), nc = PyList_GET_SIZE(columns);
    const char **prefix = PyMem_Calloc(nc + 1, sizeof(char *));
    Py_ssize_t *prefix_size = PyMem_Calloc(nc + 1, sizeof(Py_ssize_t));
    char *kind = PyMem_Calloc(nc + 1, 1);
    PyObject **values = PyMem_Calloc(nc + 1, sizeof(PyObject *));
    Out out = {NULL, 0, 0};
    PyObject *result = NULL;
    char text[400];
    if (prefix == NULL || prefix_size == NULL || kind == NULL || values == NULL) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t c = 0; c < nc; c++) {
        PyObject *column = PyList_GET_ITEM(columns, c);
        const char *k;
        if (!PyArg_ParseTuple(column, "s#sO!", &prefix[c], &prefix_size[c], &k, &PyList_Type, &values[c])) goto done;
        kind[c] = k[0];
        if ((kind[c] != 'f' && kind[c] != 'd' && kind[c] != 's') || k[1] != '\0'
            || PyList_GET_SIZE(values[c]) != nq) {
            PyErr_SetString(PyExc_ValueError, "a column is not (prefix, 'f'|'d'|'s', one value per query)");
            goto done;
        }
    }
    Py_ssize_t line_size = 0;  /* a guess of the output's size: one allocation, mostly */
    for (Py_ssize_t c = 0; c < nc; c++) line_size += prefix_size[c] + 16;
    if (!reserve(&out, (line_size + nc * 8) * nq + 1)) goto done;
    for (Py_ssize_t q = 0; q < nq; q++) {
        Py_ssize_t qid_size;
        const char *qid = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(qids, q), &qid_size);
        if (qid == NULL) goto done;
        for (Py_ssize_t c = 0; c < nc; c++) {
            const char *str;
            Py_ssize_t size = value_text(kind[c], PyList_GET_ITEM(values[c], q), text, &str);
            if (size < 0 || !reserve(&out, prefix_size[c] + qid_size + size + 2)) goto done;
            put(&out, prefix[c], prefix_size[c]);
            put(&out, qid, qid_size);
            put(&out, "\t", 1);
            put(&out, str, size);
            put(&out, "\n", 1);
        }
    }
    result = PyUnicode_DecodeUTF8(out.data, out.size, NULL);
done:
    PyMem_Free(prefix);
    PyMem_Free(prefix_size);
    PyMem_Free(kind);
    PyMem_Free(values);
    PyMem_Free(out.data);
    return result;
}

static int as_long_long(PyObject *value, long long *out) {
    *out = PyLong_AsLongLong(value);
    return !(*out == -1 && PyErr_Occurred());
}

static PyObject *fill_cells(PyObject *self, PyObject *args) {
    PyObject *scores, *grades, *order_of, *result = NULL;
    Py_buffer score, doc, grade;
    if (!PyArg_ParseTuple(args, "O!O!O!w*w*w*", &PyList_Type, &scores, &PyList_Type, &grades, &PyDict_Type,
                          &order_of, &score, &doc, &grade)) return NULL;
    Py_ssize_t nq = PyList_GET_SIZE(scores), slots = score.len / 8, at = 0;
    double *score_at = score.buf, *grade_at = grade.buf;
    long long *doc_at = doc.buf;
    if (PyList_GET_SIZE(grades) != nq || doc.len / 8 != slots || grade.len / 8 != slots) {
        PyErr_SetString(PyExc_ValueError, "cells: lists or buffers of different sizes");
        goto done;
    }
    for (Py_ssize_t q = 0; q < nq; q++) {
        PyObject *s = PyList_GET_ITEM(scores, q), *g = PyList_GET_ITEM(grades, q), *key, *value;
        if (!PyDict_CheckExact(s) || !PyDict_CheckExact(g)) { result = Py_NewRef(Py_False); goto done; }
        Py_ssize_t pos = 0;
        while (PyDict_Next(s, &pos, &key, &value)) {
            if (at == slots) { PyErr_SetString(PyExc_ValueError, "cells: more documents than slots"); goto done; }
            PyObject *rank = PyDict_GetItemWithError(order_of, key), *known;
            if (rank == NULL) { if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key); goto done; }
            if (!as_long_long(rank, &doc_at[at])) goto done;
            if ((score_at[at] = PyFloat_AsDouble(value)) == -1.0 && PyErr_Occurred()) goto done;
            if ((known = PyDict_GetItemWithError(g, key)) == NULL) {
                if (PyErr_Occurred()) goto done;
                grade_at[at] = Py_NAN;
            } else if ((grade_at[at] = PyFloat_AsDouble(known)) == -1.0 && PyErr_Occurred()) goto done;
            at++;
        }
    }
    if (at != slots) { PyErr_SetString(PyExc_ValueError, "cells: fewer documents than slots"); goto done; }
    result = Py_NewRef(Py_True);
done:
    PyBuffer_Release(&score);
    PyBuffer_Release(&doc);
    PyBuffer_Release(&grade);
    return result;
}

static PyMethodDef methods[] = {
    {"cells", fill_cells, METH_VARARGS, "stack_scored's per-document pass (see _treader.c)."},
    {"read", read_plain, METH_VARARGS, "A plain TREC file's queries, or None (see _treader.c)."},
    {"lines", format_lines, METH_VARARGS, "trec_eval's per-query lines (see _treader.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_treader", NULL, -1, methods};

PyMODINIT_FUNC PyInit__treader(void) { return PyModule_Create(&module); }
