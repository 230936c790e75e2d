/* rankmeter._treader: a plain TREC file read in C (rankmeter/trec.py, `_plain`), built by
   scripts/build_native.py; trec.py reads without it too, the same, slower.

   read(data: bytes, width, doc_field, value_field, whole) -> ([(qid, {doc: value})], tag) | None

   A plain file is ASCII; its fields are separated by spaces or tabs, its lines by \n; every
   non-blank line has exactly `width` fields and none starts with `#`; a query's documents
   are not repeated within a run of its lines; every value is what Python's float() reads
   (float() itself reads it: PyFloat_FromString), and with `whole` (qrels for trec_eval's
   names) a whole number [+-]digits{1,18}, which float() and trec_eval's atol read alike.
   Anything else is None: the line-by-line Python reader then reads the file and words its
   problems. One (qid, {doc: value}) per run of consecutive lines of one query; `tag` is the
   last line's field `width - 1`. NaN and infinities are trec.py's to judge. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

static PyMethodDef methods[] = {
    {"read", read_plain, METH_VARARGS, "A plain TREC file's queries, or None (see _treader.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_treader", NULL, -1, methods};

PyMODINIT_FUNC PyInit__treader(void) { return PyModule_Create(&module); }
