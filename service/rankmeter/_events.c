/* rankmeter._events: the common native message decoded and checked in C (events/decoder.py),
   built by scripts/build_native.py; the decoder works without it too, the same, slower.

   Decoder(feedback_type, impression_type, grades, long_dwell_ms, long_dwell_grade,
           max_past_ms, max_future_ms, max_results, max_grade, by_user, query_hash,
           user_hash, bucket_of)
     .feedback(value: bytes, now_ms: int) -> Feedback | None
     .impression(value: bytes, now_ms: int) -> Impression | None

   The plain case only, taken exactly as events/rules.py takes it: one JSON object whose
   keys are the native message's own fields, each once; its strings printable ASCII without
   escapes; its numbers integers of at most 18 digits; `timestamp` epoch milliseconds; a
   feedback event with an event_id, a known action and no label; an impression without
   interleaving. Anything else, and any message rules.py would refuse, is None: the
   Python decoder then decodes it, and words why it is refused. So this module never
   refuses a message, and what it returns is what the Python decoder returns
   (tests/test_events_native.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_QUERY_ID 256   /* events/rules.py check_query_id */
#define MAX_NAME 128       /* rules.MAX_NAME */
#define MAX_ID 512         /* rules.MAX_ID */

typedef struct {
    PyObject_HEAD
    PyObject *feedback_type, *impression_type, *grades, *long_dwell_grade;
    PyObject *query_hash, *user_hash, *bucket_of;
    PyObject *judgment, *impression, *click;  /* the action names it compares with */
    long long long_dwell_ms, max_past_ms, max_future_ms;
    Py_ssize_t max_results;
    double max_grade;
    int by_user;
} Decoder;

/* One JSON value as read: a string's bytes (printable ASCII, no escapes), an integer, null,
   or (results only) an array of such strings. */
enum kind { ABSENT = 0, NUL, STR, INT, ARRAY };
typedef struct {
    enum kind kind;
    const char *s;   /* a string's first byte, or an array's '[' ... */
    const char *end; /* ... and the byte after its ']' */
    Py_ssize_t n;    /* a string's length, or an array's count */
    long long i;
} Value;

typedef struct { const char *p, *end; } Cursor;

static void skip_space(Cursor *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) c->p++;
}

/* A string at c->p ('"'): 1 read, 0 not plain. */
static int read_string(Cursor *c, const char **s, Py_ssize_t *n) {
    if (c->p >= c->end || *c->p != '"') return 0;
    const char *start = ++c->p;
    while (c->p < c->end) {
        unsigned char ch = (unsigned char)*c->p;
        if (ch == '"') {
            *s = start;
            *n = c->p - start;
            c->p++;
            return 1;
        }
        if (ch < 0x20 || ch > 0x7e || ch == '\\') return 0;  /* escapes, controls, non-ASCII: Python */
        c->p++;
    }
    return 0;
}

/* An integer -?(0|[1-9][0-9]*) of at most 18 digits, not followed by a fraction or an
   exponent: 1 read, 0 not plain. */
static int read_int(Cursor *c, long long *out) {
    int negative = 0, digits = 0;
    long long v = 0;
    if (c->p < c->end && *c->p == '-') negative = 1, c->p++;
    if (c->p < c->end && *c->p == '0' && c->p + 1 < c->end && c->p[1] >= '0' && c->p[1] <= '9') return 0;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
        if (++digits > 18) return 0;
        v = v * 10 + (*c->p++ - '0');
    }
    if (digits == 0) return 0;
    if (c->p < c->end && (*c->p == '.' || *c->p == 'e' || *c->p == 'E')) return 0;
    *out = negative ? -v : v;
    return 1;
}

static int read_value(Cursor *c, Value *v, int array_allowed) {
    skip_space(c);
    if (c->p >= c->end) return 0;
    if (*c->p == '"') {
        v->kind = STR;
        return read_string(c, &v->s, &v->n);
    }
    if (*c->p == '-' || (*c->p >= '0' && *c->p <= '9')) {
        v->kind = INT;
        return read_int(c, &v->i);
    }
    if (c->end - c->p >= 4 && memcmp(c->p, "null", 4) == 0) {
        v->kind = NUL;
        c->p += 4;
        return 1;
    }
    if (*c->p == '[' && array_allowed) {
        /* Checked here, made into strings later: [] or ["…", …]. */
        v->kind = ARRAY;
        v->s = c->p;
        c->p++;
        skip_space(c);
        if (c->p < c->end && *c->p == ']') {
            c->p++;
            v->n = 0;
            v->end = c->p;
            return 1;
        }
        Py_ssize_t count = 0;
        for (;;) {
            const char *s;
            Py_ssize_t n;
            skip_space(c);
            if (!read_string(c, &s, &n)) return 0;
            count++;
            skip_space(c);
            if (c->p < c->end && *c->p == ',') { c->p++; continue; }
            if (c->p < c->end && *c->p == ']') { c->p++; break; }
            return 0;
        }
        v->n = count;
        v->end = c->p;
        return 1;
    }
    return 0;
}

/* The object's fields into `values` (by their index in `names`): 1, or 0 when the message
   is not one plain object of those fields, each at most once. */
static int read_object(const char *data, Py_ssize_t size, const char *const *names, int count, Value *values,
                       int array_field) {
    Cursor c = {data, data + size};
    memset(values, 0, sizeof(Value) * count);
    skip_space(&c);
    if (c.p >= c.end || *c.p != '{') return 0;
    c.p++;
    skip_space(&c);
    if (c.p < c.end && *c.p == '}') {
        c.p++;
    } else {
        for (;;) {
            const char *key;
            Py_ssize_t n;
            skip_space(&c);
            if (!read_string(&c, &key, &n)) return 0;
            int field = -1;
            for (int i = 0; i < count; i++)
                if ((Py_ssize_t)strlen(names[i]) == n && memcmp(names[i], key, n) == 0) { field = i; break; }
            if (field < 0 || values[field].kind != ABSENT) return 0;  /* another key, or one repeated */
            skip_space(&c);
            if (c.p >= c.end || *c.p != ':') return 0;
            c.p++;
            if (!read_value(&c, &values[field], field == array_field)) return 0;
            skip_space(&c);
            if (c.p < c.end && *c.p == ',') { c.p++; continue; }
            if (c.p < c.end && *c.p == '}') { c.p++; break; }
            return 0;
        }
    }
    skip_space(&c);
    return c.p == c.end;
}

static int is_str(const Value *v) { return v->kind == STR; }
static int is_str_or_null(const Value *v) { return v->kind == ABSENT || v->kind == NUL || v->kind == STR; }
static int is_int_or_null(const Value *v) { return v->kind == ABSENT || v->kind == NUL || v->kind == INT; }
static PyObject *text(const Value *v) { return PyUnicode_DecodeASCII(v->s, v->n, NULL); }

/* rules.timestamp's range, for epoch milliseconds. */
static int in_time(const Decoder *d, long long ms, long long now_ms) {
    return ms >= now_ms - d->max_past_ms && ms <= now_ms + d->max_future_ms;
}

enum { F_QUERY_ID, F_TIMESTAMP, F_ACTION, F_DOC_ID, F_EVENT_ID, F_POSITION, F_DWELL_MS, F_GRADE, F_LABEL, F_COUNT };
static const char *const FEEDBACK_FIELDS[F_COUNT] = {
    "query_id", "timestamp", "action", "doc_id", "event_id", "position", "dwell_ms", "grade", "label"};

/* The message's key, when given, must be its query_id (pipeline/intake.py says why). */
static int keyed_by(PyObject *key, const Value *query_id) {
    return key == NULL || (PyBytes_Check(key) && PyBytes_GET_SIZE(key) == query_id->n
                           && memcmp(PyBytes_AS_STRING(key), query_id->s, query_id->n) == 0);
}

/* `seen`: the event's time and whether it is an impression event, for `run`. */
typedef struct { long long timestamp_ms; int shown; } Seen;

static PyObject *decode_feedback(Decoder *d, const char *data, Py_ssize_t size, long long now_ms, PyObject *key,
                                 Seen *seen) {
    Value f[F_COUNT];
    if (!read_object(data, size, FEEDBACK_FIELDS, F_COUNT, f, -1)) Py_RETURN_NONE;
    /* rules.feedback's checks, each refusal left to it */
    if (!is_str(&f[F_QUERY_ID]) || f[F_QUERY_ID].n < 1 || f[F_QUERY_ID].n > MAX_QUERY_ID) Py_RETURN_NONE;
    if (!keyed_by(key, &f[F_QUERY_ID])) Py_RETURN_NONE;
    if (f[F_TIMESTAMP].kind != INT || !in_time(d, f[F_TIMESTAMP].i, now_ms)) Py_RETURN_NONE;
    if (!is_str(&f[F_ACTION]) || !is_str(&f[F_DOC_ID]) || f[F_DOC_ID].n < 1 || f[F_DOC_ID].n > MAX_ID) Py_RETURN_NONE;
    /* without an event_id its key is the content's hash (rules.py): Python's */
    if (!is_str(&f[F_EVENT_ID]) || f[F_EVENT_ID].n < 1 || f[F_EVENT_ID].n > MAX_ID) Py_RETURN_NONE;
    if (!is_int_or_null(&f[F_POSITION]) || !is_int_or_null(&f[F_DWELL_MS]) || !is_int_or_null(&f[F_GRADE]))
        Py_RETURN_NONE;
    if (f[F_LABEL].kind != ABSENT && f[F_LABEL].kind != NUL) Py_RETURN_NONE;  /* a judgment's label: rules.py's */
    int has_position = f[F_POSITION].kind == INT, has_dwell = f[F_DWELL_MS].kind == INT;
    if ((has_position && f[F_POSITION].i < 1) || (has_dwell && f[F_DWELL_MS].i < 0)) Py_RETURN_NONE;

    PyObject *action = text(&f[F_ACTION]);
    if (action == NULL) return NULL;
    PyObject *grade = NULL, *explicit = Py_False;
    int is_impression = PyUnicode_Compare(action, d->impression) == 0;
    int is_judgment = !is_impression && PyUnicode_Compare(action, d->judgment) == 0;
    if (is_impression) {
        if (!has_position) goto plain_no;  /* "ignored": rules.py says why */
        grade = PyFloat_FromDouble(0.0);
    } else if (is_judgment) {
        if (f[F_GRADE].kind != INT || f[F_GRADE].i < 0 || (double)f[F_GRADE].i > d->max_grade) goto plain_no;
        grade = PyFloat_FromDouble((double)f[F_GRADE].i);
        explicit = Py_True;
    } else {
        grade = PyDict_GetItemWithError(d->grades, action);  /* borrowed */
        if (grade == NULL) {
            if (PyErr_Occurred()) goto error;
            goto plain_no;  /* an unknown action: rules.py refuses or ignores it */
        }
        if (has_dwell && f[F_DWELL_MS].i >= d->long_dwell_ms && PyUnicode_Compare(action, d->click) == 0) {
            /* max(event_grade, long_dwell_grade): the first unless the second is greater */
            int greater = PyObject_RichCompareBool(d->long_dwell_grade, grade, Py_GT);
            if (greater < 0) goto error;
            if (greater) grade = d->long_dwell_grade;
        }
        Py_INCREF(grade);
    }
    if (grade == NULL) goto error;
    seen->timestamp_ms = f[F_TIMESTAMP].i;
    seen->shown = is_impression;
    PyObject *args[8] = {NULL};
    args[0] = text(&f[F_EVENT_ID]);
    args[1] = text(&f[F_QUERY_ID]);
    args[2] = PyLong_FromLongLong(f[F_TIMESTAMP].i);
    args[3] = action;
    args[4] = text(&f[F_DOC_ID]);
    args[5] = grade;
    args[6] = explicit;
    args[7] = has_position ? PyLong_FromLongLong(f[F_POSITION].i) : Py_NewRef(Py_None);
    PyObject *event = NULL;
    if (args[0] && args[1] && args[2] && args[4] && args[7])
        event = PyObject_Vectorcall(d->feedback_type, args, 8, NULL);
    Py_XDECREF(args[0]);
    Py_XDECREF(args[1]);
    Py_XDECREF(args[2]);
    Py_XDECREF(args[4]);
    Py_XDECREF(args[7]);
    Py_DECREF(grade);
    Py_DECREF(action);
    return event;
plain_no:
    Py_DECREF(action);
    Py_RETURN_NONE;
error:
    Py_DECREF(action);
    return NULL;
}

enum { I_QUERY_ID, I_RANKER, I_TIMESTAMP, I_RESULTS, I_SEGMENT, I_INTERLEAVING, I_USER_QUERY, I_SESSION_ID,
       I_CLIENT_ID, I_COUNT };
static const char *const IMPRESSION_FIELDS[I_COUNT] = {
    "query_id", "ranker", "timestamp", "results", "segment", "interleaving", "user_query", "session_id",
    "client_id"};

/* The results as sent, each document once at its first rank (engine/query.py first_occurrences). */
static PyObject *results_of(const Value *v) {
    PyObject *results = PyList_New(0), *seen = PySet_New(NULL);
    if (results == NULL || seen == NULL) goto error;
    Cursor c = {v->s + 1, v->end};  /* read_object checked the array: each item a plain string */
    for (Py_ssize_t i = 0; i < v->n; i++) {
        const char *s;
        Py_ssize_t n;
        skip_space(&c);
        read_string(&c, &s, &n);
        skip_space(&c);
        c.p++;  /* the ',' or the ']' */
        PyObject *doc = PyUnicode_DecodeASCII(s, n, NULL);
        if (doc == NULL) goto error;
        int known = PySet_Contains(seen, doc);
        if (known < 0 || (!known && (PySet_Add(seen, doc) < 0 || PyList_Append(results, doc) < 0))) {
            Py_DECREF(doc);
            goto error;
        }
        Py_DECREF(doc);
    }
    Py_DECREF(seen);
    return results;
error:
    Py_XDECREF(results);
    Py_XDECREF(seen);
    return NULL;
}

/* Every result id within rules.MAX_ID (check_ids). */
static int ids_in_limit(const Value *v) {
    Cursor c = {v->s + 1, v->end};
    for (Py_ssize_t i = 0; i < v->n; i++) {
        const char *s;
        Py_ssize_t n;
        skip_space(&c);
        read_string(&c, &s, &n);
        if (n > MAX_ID) return 0;
        skip_space(&c);
        c.p++;
    }
    return 1;
}

static PyObject *decode_impression(Decoder *d, const char *data, Py_ssize_t size, long long now_ms, PyObject *key,
                                   Seen *seen) {
    Value f[I_COUNT];
    if (!read_object(data, size, IMPRESSION_FIELDS, I_COUNT, f, I_RESULTS)) Py_RETURN_NONE;
    /* rules.impression's checks, each refusal left to it */
    if (!is_str(&f[I_QUERY_ID]) || f[I_QUERY_ID].n < 1 || f[I_QUERY_ID].n > MAX_QUERY_ID) Py_RETURN_NONE;
    if (!keyed_by(key, &f[I_QUERY_ID])) Py_RETURN_NONE;
    if (!is_str(&f[I_RANKER]) || f[I_RANKER].n < 1 || f[I_RANKER].n > MAX_NAME) Py_RETURN_NONE;
    if (f[I_TIMESTAMP].kind != INT || !in_time(d, f[I_TIMESTAMP].i, now_ms)) Py_RETURN_NONE;
    if (f[I_RESULTS].kind != ARRAY || f[I_RESULTS].n > d->max_results || !ids_in_limit(&f[I_RESULTS]))
        Py_RETURN_NONE;
    if (!is_str_or_null(&f[I_SEGMENT]) || (f[I_SEGMENT].kind == STR && f[I_SEGMENT].n > MAX_NAME)) Py_RETURN_NONE;
    if (f[I_INTERLEAVING].kind != ABSENT && f[I_INTERLEAVING].kind != NUL) Py_RETURN_NONE;  /* rules.py's */
    if (!is_str_or_null(&f[I_USER_QUERY]) || !is_str_or_null(&f[I_SESSION_ID]) || !is_str_or_null(&f[I_CLIENT_ID]))
        Py_RETURN_NONE;

    seen->timestamp_ms = f[I_TIMESTAMP].i;
    seen->shown = 0;
    PyObject *args[12] = {NULL};
    PyObject *event = NULL;
    args[0] = text(&f[I_QUERY_ID]);
    args[1] = text(&f[I_RANKER]);
    args[2] = PyLong_FromLongLong(f[I_TIMESTAMP].i);
    args[3] = results_of(&f[I_RESULTS]);
    args[4] = f[I_SEGMENT].kind == STR ? text(&f[I_SEGMENT]) : PyUnicode_FromStringAndSize("", 0);
    args[5] = PyUnicode_FromStringAndSize("", 0);  /* experiment */
    args[6] = PyList_New(0);                        /* teams */
    args[7] = Py_NewRef(Py_False);                  /* assemble */
    args[8] = PyLong_FromLong(0);                   /* expected */
    for (int i = 0; i < 9; i++)
        if (args[i] == NULL) goto done;  /* (no Python called with an exception set) */
    if (f[I_USER_QUERY].kind == STR && f[I_USER_QUERY].n > 0) {
        PyObject *query = text(&f[I_USER_QUERY]);
        args[9] = query ? PyObject_CallOneArg(d->query_hash, query) : NULL;
        Py_XDECREF(query);
    } else {
        args[9] = PyUnicode_FromStringAndSize("", 0);
    }
    if (args[9] == NULL) goto done;
    if (f[I_CLIENT_ID].kind == STR && f[I_CLIENT_ID].n > 0 && d->by_user) {
        PyObject *client = text(&f[I_CLIENT_ID]);
        args[11] = client ? PyObject_CallOneArg(d->user_hash, client) : NULL;
        args[10] = args[11] ? PyObject_CallOneArg(d->bucket_of, args[11]) : NULL;
        Py_XDECREF(client);
    } else {
        args[10] = PyLong_FromLong(-1);
        args[11] = PyLong_FromLong(-1);
    }
    if (args[10] != NULL && args[11] != NULL) event = PyObject_Vectorcall(d->impression_type, args, 12, NULL);
done:
    for (int i = 0; i < 12; i++) Py_XDECREF(args[i]);
    return event;
}

typedef PyObject *(*decode_fn)(Decoder *, const char *, Py_ssize_t, long long, PyObject *, Seen *);

static int ready(const Decoder *d) {
    if (d->grades != NULL) return 1;
    PyErr_SetString(PyExc_RuntimeError, "rankmeter._events.Decoder used before its __init__");
    return 0;
}

static PyObject *call(Decoder *d, PyObject *const *args, Py_ssize_t nargs, decode_fn decode) {
    if (!ready(d)) return NULL;
    if (nargs != 2 || !PyBytes_Check(args[0])) Py_RETURN_NONE;
    long long now_ms = PyLong_AsLongLong(args[1]);
    if (now_ms == -1 && PyErr_Occurred()) return NULL;
    Seen seen;
    return decode(d, PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0]), now_ms, NULL, &seen);
}

static PyObject *Decoder_feedback(Decoder *d, PyObject *const *args, Py_ssize_t nargs) {
    return call(d, args, nargs, decode_feedback);
}

static PyObject *Decoder_impression(Decoder *d, PyObject *const *args, Py_ssize_t nargs) {
    return call(d, args, nargs, decode_impression);
}

/* Record (source.py), the type each function is given: a tuple (topic, partition, offset,
   key, value, headers, timestamp). Anything else (kafka-python's ConsumerRecord has other
   fields at those places) is never read by index. */
enum { R_TOPIC, R_PARTITION, R_OFFSET, R_KEY, R_VALUE, R_HEADERS, R_TIMESTAMP, R_FIELDS };

static int is_record(PyObject *r, PyObject *type) {
    return (PyObject *)Py_TYPE(r) == type && PyTuple_GET_SIZE(r) == R_FIELDS;
}

static int is_record_type(PyObject *type) {
    if (PyType_Check(type) && PyType_IsSubtype((PyTypeObject *)type, &PyTuple_Type)) return 1;
    PyErr_SetString(PyExc_TypeError, "record_type must be a tuple type (source.Record)");
    return 0;
}

/* run_end(records, start, record_type) -> stop: records[start:stop] are one topic's
   partition's records, their offsets one after another (start < stop; anything not a
   record_type is a run alone). */
static PyObject *run_end(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t start;
    if (nargs != 3 || !PyList_Check(args[0]) || (start = PyLong_AsSsize_t(args[1])) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "run_end(records: list, start: int, record_type)");
        return NULL;
    }
    PyObject *type = args[2];
    if (!is_record_type(type)) return NULL;
    PyObject *records = args[0];
    Py_ssize_t n = PyList_GET_SIZE(records), stop = start + 1;
    if (start >= n) {
        PyErr_SetString(PyExc_IndexError, "run_end: start past the records");
        return NULL;
    }
    PyObject *first = PyList_GET_ITEM(records, start);
    if (!is_record(first, type)) return PyLong_FromSsize_t(stop);
    PyObject *topic = PyTuple_GET_ITEM(first, R_TOPIC), *partition = PyTuple_GET_ITEM(first, R_PARTITION);
    long long offset = PyLong_AsLongLong(PyTuple_GET_ITEM(first, R_OFFSET));
    if (offset == -1 && PyErr_Occurred()) return NULL;
    for (; stop < n; stop++) {
        PyObject *r = PyList_GET_ITEM(records, stop);
        if (!is_record(r, type)) break;
        PyObject *t = PyTuple_GET_ITEM(r, R_TOPIC), *p = PyTuple_GET_ITEM(r, R_PARTITION);
        if (t != topic) {
            int same = PyObject_RichCompareBool(t, topic, Py_EQ);
            if (same < 0) return NULL;
            if (!same) break;
        }
        if (p != partition) {
            int same = PyObject_RichCompareBool(p, partition, Py_EQ);
            if (same < 0) return NULL;
            if (!same) break;
        }
        long long next = PyLong_AsLongLong(PyTuple_GET_ITEM(r, R_OFFSET));
        if (next == -1 && PyErr_Occurred()) return NULL;
        if (next != ++offset) break;
    }
    return PyLong_FromSsize_t(stop);
}

/* run(records, start, stop, now_ms, feedback, record_type) -> (events, misses, newest_ms, shown):
   records[start:stop] decoded as impressions, or feedback events, each keyed by its
   query_id; events[i] None where the plain case does not hold, `misses` those i (the
   Python decoder's to decode and word); newest_ms the latest event time of the others
   (-1: none), shown whether one is an impression event. */
static PyObject *Decoder_run(Decoder *d, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t start, stop;
    long long now_ms;
    int feedback;
    if (!ready(d)) return NULL;
    if (nargs != 6 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "run(records: list, start, stop, now_ms, feedback, record_type)");
        return NULL;
    }
    PyObject *type = args[5];
    if (!is_record_type(type)) return NULL;
    if ((start = PyLong_AsSsize_t(args[1])) == -1 || (stop = PyLong_AsSsize_t(args[2])) == -1
        || ((now_ms = PyLong_AsLongLong(args[3])) == -1 && PyErr_Occurred()) || (feedback = PyObject_IsTrue(args[4])) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "run: start and stop must be >= 0");
        return NULL;
    }
    PyObject *records = args[0];
    if (start < 0 || start > stop || stop > PyList_GET_SIZE(records)) {
        PyErr_SetString(PyExc_IndexError, "run: start and stop outside the records");
        return NULL;
    }
    decode_fn decode = feedback ? decode_feedback : decode_impression;
    PyObject *events = PyList_New(stop - start), *misses = PyList_New(0);
    if (events == NULL || misses == NULL) {
        Py_XDECREF(events);
        Py_XDECREF(misses);
        return NULL;
    }
    long long newest = -1;
    int shown = 0;
    for (Py_ssize_t i = start; i < stop; i++) {
        PyObject *r = PyList_GET_ITEM(records, i), *event = Py_None;
        if (is_record(r, type) && PyBytes_Check(PyTuple_GET_ITEM(r, R_VALUE))) {
            PyObject *value = PyTuple_GET_ITEM(r, R_VALUE);
            Seen seen;
            event = decode(d, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value), now_ms, PyTuple_GET_ITEM(r, R_KEY),
                           &seen);
            if (event == NULL) goto error;
            if (event != Py_None) {
                if (seen.timestamp_ms > newest) newest = seen.timestamp_ms;
                shown |= seen.shown;
            }
        } else {
            Py_INCREF(event);
        }
        PyList_SET_ITEM(events, i - start, event);
        if (event == Py_None) {
            PyObject *at = PyLong_FromSsize_t(i - start);
            if (at == NULL || PyList_Append(misses, at) < 0) {
                Py_XDECREF(at);
                goto error;
            }
            Py_DECREF(at);
        }
    }
    return Py_BuildValue("(NNLO)", events, misses, newest, shown ? Py_True : Py_False);
error:
    Py_DECREF(events);
    Py_DECREF(misses);
    return NULL;
}

/* newest(records, into, record_type) -> bool: into[(topic, partition)] raised to each
   record's Kafka timestamp above it (lag.py `Lag.see`), once per run of one partition's
   records; False, nothing done, when one is not a record_type. */
static PyObject *newest(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "newest(records: list, into: dict, record_type)");
        return NULL;
    }
    PyObject *records = args[0], *into = args[1], *type = args[2];
    if (!is_record_type(type)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(records), i = 0;
    for (Py_ssize_t k = 0; k < n; k++)
        if (!is_record(PyList_GET_ITEM(records, k), type)) Py_RETURN_FALSE;
    while (i < n) {
        PyObject *r = PyList_GET_ITEM(records, i);
        PyObject *topic = PyTuple_GET_ITEM(r, R_TOPIC), *partition = PyTuple_GET_ITEM(r, R_PARTITION);
        PyObject *top = PyTuple_GET_ITEM(r, R_TIMESTAMP);
        for (i++; i < n; i++) {  /* the run's greatest timestamp */
            PyObject *next = PyList_GET_ITEM(records, i);
            int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(next, R_TOPIC), topic, Py_EQ);
            if (same > 0) same = PyObject_RichCompareBool(PyTuple_GET_ITEM(next, R_PARTITION), partition, Py_EQ);
            if (same < 0) return NULL;
            if (!same) break;
            int greater = PyObject_RichCompareBool(PyTuple_GET_ITEM(next, R_TIMESTAMP), top, Py_GT);
            if (greater < 0) return NULL;
            if (greater) top = PyTuple_GET_ITEM(next, R_TIMESTAMP);
        }
        PyObject *key = PyTuple_Pack(2, topic, partition);
        if (key == NULL) return NULL;
        PyObject *known = PyDict_GetItemWithError(into, key);
        if (known == NULL && PyErr_Occurred()) {
            Py_DECREF(key);
            return NULL;
        }
        int greater = known == NULL ? 1 : PyObject_RichCompareBool(top, known, Py_GT);
        if (known == NULL && greater) {  /* absent: -1 is below it, as `newest.get(key, -1)` */
            PyObject *minus_one = PyLong_FromLong(-1);
            greater = minus_one ? PyObject_RichCompareBool(top, minus_one, Py_GT) : -1;
            Py_XDECREF(minus_one);
        }
        if (greater < 0 || (greater && PyDict_SetItem(into, key, top) < 0)) {
            Py_DECREF(key);
            return NULL;
        }
        Py_DECREF(key);
    }
    Py_RETURN_TRUE;
}

static int Decoder_init(Decoder *d, PyObject *args, PyObject *Py_UNUSED(kwargs)) {
    PyObject *feedback_type, *impression_type, *grades, *long_dwell_grade, *query_hash, *user_hash, *bucket_of;
    long long long_dwell_ms, max_past_ms, max_future_ms;
    Py_ssize_t max_results;
    double max_grade;
    int by_user;
    if (!PyArg_ParseTuple(args, "OOO!LOLLndpOOO", &feedback_type, &impression_type, &PyDict_Type, &grades,
                          &long_dwell_ms, &long_dwell_grade, &max_past_ms, &max_future_ms, &max_results,
                          &max_grade, &by_user, &query_hash, &user_hash, &bucket_of))
        return -1;
    Py_XSETREF(d->feedback_type, Py_NewRef(feedback_type));
    Py_XSETREF(d->impression_type, Py_NewRef(impression_type));
    Py_XSETREF(d->grades, PyDict_Copy(grades));
    Py_XSETREF(d->long_dwell_grade, Py_NewRef(long_dwell_grade));
    Py_XSETREF(d->query_hash, Py_NewRef(query_hash));
    Py_XSETREF(d->user_hash, Py_NewRef(user_hash));
    Py_XSETREF(d->bucket_of, Py_NewRef(bucket_of));
    Py_XSETREF(d->judgment, PyUnicode_FromString("judgment"));
    Py_XSETREF(d->impression, PyUnicode_FromString("impression"));
    Py_XSETREF(d->click, PyUnicode_FromString("click"));
    if (!d->grades || !d->judgment || !d->impression || !d->click) return -1;
    d->long_dwell_ms = long_dwell_ms;
    d->max_past_ms = max_past_ms;
    d->max_future_ms = max_future_ms;
    d->max_results = max_results;
    d->max_grade = max_grade;
    d->by_user = by_user;
    return 0;
}

static void Decoder_dealloc(Decoder *d) {
    Py_XDECREF(d->feedback_type);
    Py_XDECREF(d->impression_type);
    Py_XDECREF(d->grades);
    Py_XDECREF(d->long_dwell_grade);
    Py_XDECREF(d->query_hash);
    Py_XDECREF(d->user_hash);
    Py_XDECREF(d->bucket_of);
    Py_XDECREF(d->judgment);
    Py_XDECREF(d->impression);
    Py_XDECREF(d->click);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static PyMethodDef Decoder_methods[] = {
    {"feedback", (PyCFunction)(void (*)(void))Decoder_feedback, METH_FASTCALL,
     "feedback(value, now_ms): the Feedback of a plain native message, or None"},
    {"impression", (PyCFunction)(void (*)(void))Decoder_impression, METH_FASTCALL,
     "impression(value, now_ms): the Impression of a plain native message, or None"},
    {"run", (PyCFunction)(void (*)(void))Decoder_run, METH_FASTCALL,
     "run(records, start, stop, now_ms, feedback, record_type) -> (events, misses, newest_ms, shown)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rankmeter._events.Decoder",
    .tp_basicsize = sizeof(Decoder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The plain native messages decoded and checked as events/rules.py does; None otherwise.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Decoder_init,
    .tp_dealloc = (destructor)Decoder_dealloc,
    .tp_methods = Decoder_methods,
};

static PyMethodDef module_methods[] = {
    {"run_end", (PyCFunction)(void (*)(void))run_end, METH_FASTCALL,
     "run_end(records, start, record_type) -> stop: the end of one topic's partition's run of consecutive offsets"},
    {"newest", (PyCFunction)(void (*)(void))newest, METH_FASTCALL,
     "newest(records, into, record_type) -> bool: into[(topic, partition)] raised to the records' Kafka timestamps"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_events", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__events(void) {
    if (PyType_Ready(&DecoderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Decoder", (PyObject *)&DecoderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
