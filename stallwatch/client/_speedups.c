/* Read capture's hot paths in C: the open() it installs, the raw file's readinto, and a read's key.

   OpenHook. Every open() of a process that captures goes through the hook, and most are left to the
   original: the interpreter's and its packages' files, kernel pseudo-files, every open while the
   process's reads have no source. A hook written in Python costs about 100 ns an open however little it
   does; this one costs what any C callable does, and its tests touch little memory, since an open's
   system calls leave the caches cold (each line missed costs tens of nanoseconds).
   `OpenHook(original, capturing, context, skipped_folders)` calls `original` (io.open) for

     - an open while `context.source` is None (the process's reads have no source): read from the
       slot itself, not looked up by name,
     - a path (a str) that starts with one of `skipped_folders`: compared with the folders' bytes laid
       back to back in the hook (a Latin-1 path; any other through `str.startswith`'s own C),

   and `capturing` (capture.capturing_open, which decides the rest and tests these again) for every other
   open, with the arguments as given. The rules are capture.capturing_open's; tests hold the two alike.

   recorded_readinto. A captured file's buffer refills through its raw file's `readinto`, one event a
   read of the file system: `recorded_readinto(file_type, context, read_key, empty_read_ns)` is that
   method, reads.RecordedFileIO's `readinto` (reads.timed_read and reads.record_read inline) in C, for
   `file_type` (io.FileIO) and its subclasses.

   read_key. keys.read_key's hash, below. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pythread.h>
#include <stdint.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Py_ssize_t source_offset;  /* of `context`'s `source` slot */
    PyObject *context;
    PyObject *original;
    PyObject *capturing;
    PyObject *skipped_folders;  /* a tuple of str */
    int latin1;  /* every folder is Latin-1 (one byte a character) and laid out in `folder_bytes` */
    Py_ssize_t folder_bytes_size;
    char *folder_bytes;  /* each folder: its length (a Py_ssize_t) and its bytes */
} OpenHook;

static int
under_folders(OpenHook *self, PyObject *path)
{
    if (self->latin1 && PyUnicode_KIND(path) == PyUnicode_1BYTE_KIND) {
        const char *data = (const char *)PyUnicode_DATA(path);
        Py_ssize_t length = PyUnicode_GET_LENGTH(path);
        for (const char *at = self->folder_bytes, *end = at + self->folder_bytes_size; at < end;) {
            Py_ssize_t size;
            memcpy(&size, at, sizeof size);
            at += sizeof size;
            if (size <= length && memcmp(data, at, size) == 0) {
                return 1;
            }
            at += size;
        }
        return 0;
    }
    Py_ssize_t folders = PyTuple_GET_SIZE(self->skipped_folders);
    for (Py_ssize_t i = 0; i < folders; i++) {
        Py_ssize_t under = PyUnicode_Tailmatch(path, PyTuple_GET_ITEM(self->skipped_folders, i), 0, PY_SSIZE_T_MAX,
                                               -1);
        if (under != 0) {
            return (int)under;
        }
    }
    return 0;
}

static PyObject *
hook_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    OpenHook *self = (OpenHook *)callable;
    PyObject *source = *(PyObject **)((char *)self->context + self->source_offset);
    int original = source == NULL || source == Py_None;  /* unset: capture's own test raises, and refuses */
    if (!original && PyVectorcall_NARGS(nargsf) >= 1 && PyUnicode_CheckExact(args[0])) {
        original = PyUnicode_READY(args[0]) < 0 ? -1 : under_folders(self, args[0]);
        if (original < 0) {
            PyErr_Clear();  /* never into the reader: capture's own tests decide */
            original = 0;
        }
    }
    return PyObject_Vectorcall(original ? self->original : self->capturing, args, nargsf, kwnames);
}

/* The offset of the __slots__ member `name` of `object`'s type, or -1 with an error set. */
static Py_ssize_t
slot_offset(PyObject *object, const char *name)
{
    PyObject *member = PyObject_GetAttrString((PyObject *)Py_TYPE(object), name);
    if (member == NULL) {
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(member, &PyMemberDescr_Type)) {
        PyMemberDef *definition = ((PyMemberDescrObject *)member)->d_member;
        if (definition->type == T_OBJECT_EX || definition->type == T_OBJECT) {
            offset = definition->offset;
        }
    }
    Py_DECREF(member);
    if (offset < 0) {
        PyErr_Format(PyExc_TypeError, "the context's `%s` must be a __slots__ member", name);
    }
    return offset;
}

static PyObject *
hook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"original", "capturing", "context", "skipped_folders", NULL};
    PyObject *original, *capturing, *context, *skipped_folders;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO!:OpenHook", names, &original, &capturing, &context,
                                     &PyTuple_Type, &skipped_folders)) {
        return NULL;
    }
    Py_ssize_t source_offset = slot_offset(context, "source");
    if (source_offset < 0) {
        return NULL;
    }
    int latin1 = 1;
    Py_ssize_t size = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(skipped_folders); i++) {
        PyObject *folder = PyTuple_GET_ITEM(skipped_folders, i);
        if (!PyUnicode_Check(folder)) {
            PyErr_SetString(PyExc_TypeError, "OpenHook: skipped_folders must hold str");
            return NULL;
        }
        if (PyUnicode_READY(folder) < 0) {
            return NULL;
        }
        latin1 &= PyUnicode_KIND(folder) == PyUnicode_1BYTE_KIND;
        size += (Py_ssize_t)sizeof(Py_ssize_t) + PyUnicode_GET_LENGTH(folder);
    }
    OpenHook *self = (OpenHook *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = hook_vectorcall;
    self->source_offset = source_offset;
    self->context = Py_NewRef(context);
    self->original = Py_NewRef(original);
    self->capturing = Py_NewRef(capturing);
    self->skipped_folders = Py_NewRef(skipped_folders);
    self->latin1 = latin1;
    if (latin1) {
        self->folder_bytes = PyMem_Malloc(size ? size : 1);
        if (self->folder_bytes == NULL) {
            Py_DECREF(self);
            return PyErr_NoMemory();
        }
        self->folder_bytes_size = size;
        char *at = self->folder_bytes;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(skipped_folders); i++) {
            PyObject *folder = PyTuple_GET_ITEM(skipped_folders, i);
            Py_ssize_t length = PyUnicode_GET_LENGTH(folder);
            memcpy(at, &length, sizeof length);
            memcpy(at + sizeof length, PyUnicode_DATA(folder), length);
            at += sizeof length + length;
        }
    }
    return (PyObject *)self;
}

static int
hook_traverse(OpenHook *self, visitproc visit, void *arg)
{
    Py_VISIT(self->context);
    Py_VISIT(self->original);
    Py_VISIT(self->capturing);
    Py_VISIT(self->skipped_folders);
    return 0;
}

static int
hook_clear(OpenHook *self)
{
    Py_CLEAR(self->context);
    Py_CLEAR(self->original);
    Py_CLEAR(self->capturing);
    Py_CLEAR(self->skipped_folders);
    return 0;
}

static void
hook_dealloc(OpenHook *self)
{
    PyObject_GC_UnTrack(self);
    hook_clear(self);
    PyMem_Free(self->folder_bytes);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
hook_name(OpenHook *self, void *closure)
{
    return PyUnicode_FromString("open");
}

static PyObject *
hook_module(OpenHook *self, void *closure)
{
    return PyUnicode_FromString("stallwatch.client.capture");  /* as capturing_open's */
}

/* Pickled as a call of capture.current_open(): a process that unpickles it (a spawned loader worker) gets
   its own open(), as it would unpickling a Python hook by its name. */
static PyObject *
hook_reduce(OpenHook *self, PyObject *unused)
{
    PyObject *capture = PyImport_ImportModule("stallwatch.client.capture");
    if (capture == NULL) {
        return NULL;
    }
    PyObject *current_open = PyObject_GetAttrString(capture, "current_open");
    Py_DECREF(capture);
    return current_open == NULL ? NULL : Py_BuildValue("(N())", current_open);
}

static PyMethodDef hook_methods[] = {
    {"__reduce__", (PyCFunction)hook_reduce, METH_NOARGS, NULL},
    {NULL},
};

static PyMemberDef hook_members[] = {
    /* functools.wraps' convention: inspect.signature(open) is capturing_open's, open()'s own. */
    {"__wrapped__", T_OBJECT, offsetof(OpenHook, capturing), READONLY, NULL},
    {NULL},
};

static PyGetSetDef hook_getset[] = {
    {"__name__", (getter)hook_name, NULL, NULL, NULL},
    {"__qualname__", (getter)hook_name, NULL, NULL, NULL},
    {"__module__", (getter)hook_module, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject OpenHookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stallwatch.client._speedups.OpenHook",
    .tp_doc = PyDoc_STR("open(), whose file records its reads when read capture takes it."),
    .tp_basicsize = sizeof(OpenHook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = hook_new,
    .tp_dealloc = (destructor)hook_dealloc,
    .tp_traverse = (traverseproc)hook_traverse,
    .tp_clear = (inquiry)hook_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(OpenHook, vectorcall),
    .tp_members = hook_members,
    .tp_methods = hook_methods,
    .tp_getset = hook_getset,
};

/* read_key: keys.read_key's hash, the first 8 bytes of BLAKE2b-64 (RFC 7693) of the UTF-8 of
   "<resource>@<offset>", as a little-endian integer: hashlib's object and its digest cost ~0.6 µs of the
   ~0.8 µs a key took in Python. */
static const uint64_t blake2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

static const uint8_t blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

#define ROTR64(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define G(a, b, c, d, x, y)                 \
    do {                                    \
        v[a] = v[a] + v[b] + (x);           \
        v[d] = ROTR64(v[d] ^ v[a], 32);     \
        v[c] = v[c] + v[d];                 \
        v[b] = ROTR64(v[b] ^ v[c], 24);     \
        v[a] = v[a] + v[b] + (y);           \
        v[d] = ROTR64(v[d] ^ v[a], 16);     \
        v[c] = v[c] + v[d];                 \
        v[b] = ROTR64(v[b] ^ v[c], 63);     \
    } while (0)

static void
blake2b_compress(uint64_t h[8], const uint8_t block[128], uint64_t counted, int last)
{
    uint64_t v[16], m[16];
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(m, block, sizeof m);
#else
    for (int i = 0; i < 16; i++) {
        uint64_t word = 0;
        for (int byte = 7; byte >= 0; byte--) {
            word = (word << 8) | block[8 * i + byte];  /* little-endian */
        }
        m[i] = word;
    }
#endif
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = blake2b_iv[i];
    }
    v[12] ^= counted;  /* the byte counter's high word stays 0: messages here are far below 2^64 bytes */
    if (last) {
        v[14] = ~v[14];
    }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 12
#endif
    for (int round = 0; round < 12; round++) {
        const uint8_t *s = blake2b_sigma[round];
        G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) {
        h[i] ^= v[i] ^ v[i + 8];
    }
}

/* BLAKE2b with an 8-byte digest, unkeyed, of `size` bytes: the digest read as a little-endian integer. */
static uint64_t
blake2b_64(const uint8_t *data, size_t size)
{
    uint64_t h[8];
    memcpy(h, blake2b_iv, sizeof h);
    h[0] ^= 0x01010000ULL ^ 8;  /* depth 1, fanout 1, no key, 8-byte digest */
    size_t done = 0;
    while (size - done > 128) {
        blake2b_compress(h, data + done, done + 128, 0);
        done += 128;
    }
    uint8_t last[128] = {0};
    memcpy(last, data + done, size - done);
    blake2b_compress(h, last, size, 1);
    return h[0];  /* its 8 bytes little-endian are the digest */
}

/* The key of `resource` (an exact str) at `offset` (an exact int), or NULL with an error set: TypeError or
   OverflowError for what it does not take (keys.read_key hashes that in Python), UnicodeEncodeError as
   str.encode raises it. */
static PyObject *
hash_key(PyObject *resource_object, PyObject *offset_object)
{
    if (!PyUnicode_CheckExact(resource_object) || !PyLong_CheckExact(offset_object)) {
        PyErr_SetString(PyExc_TypeError, "read_key(resource: str, offset: int)");
        return NULL;
    }
    long long offset = PyLong_AsLongLong(offset_object);
    if (offset == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t length;
    const char *resource = PyUnicode_AsUTF8AndSize(resource_object, &length);
    if (resource == NULL) {
        return NULL;
    }
    char suffix[24];  /* "@" and the offset in decimal, as f"{offset}" writes it */
    char digits[21];
    int count = 0;
    unsigned long long rest = offset < 0 ? 0ULL - (unsigned long long)offset : (unsigned long long)offset;
    do {
        digits[count++] = (char)('0' + rest % 10);
        rest /= 10;
    } while (rest);
    int suffix_length = 0;
    suffix[suffix_length++] = '@';
    if (offset < 0) {
        suffix[suffix_length++] = '-';
    }
    while (count) {
        suffix[suffix_length++] = digits[--count];
    }
    size_t size = (size_t)length + (size_t)suffix_length;
    uint8_t local[512];
    uint8_t *message = size <= sizeof local ? local : PyMem_Malloc(size);
    if (message == NULL) {
        return PyErr_NoMemory();
    }
    memcpy(message, resource, length);
    memcpy(message + length, suffix, suffix_length);
    uint64_t key = blake2b_64(message, size);
    if (message != local) {
        PyMem_Free(message);
    }
    return PyLong_FromUnsignedLongLong(key);
}

static PyObject *
read_key(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "read_key(resource: str, offset: int)");
        return NULL;
    }
    return hash_key(args[0], args[1]);
}

/* recorded_readinto's settings: one set a process (reads.py makes the method once, at import). */
static struct {
    PyObject *context;         /* reads.context */
    Py_ssize_t reading_offset; /* its `reading` slot: each thread's open read, (location, offset, start) */
    Py_ssize_t batch_offset;   /* its `batch` slot: the batch the reads serve */
    PyObject *read_key;        /* keys.read_key, for a path hash_key does not take */
    PyObject *file_readinto;   /* io.FileIO.readinto */
    long long empty_read_ns;   /* a read of no bytes at least this long is an event (reads.EMPTY_READ_NS) */
} reads;

static PyObject *path_name, *position_name, *verdict_name;  /* "_path", "_position", "_verdict" */
static PyObject *target_name, *read_name, *scheme_separator;  /* "target", "read", "://" */

/* reads.record_read, inline: the row (batch, key, bytes, start, end, verdict) to `context.target()`'s
   `read`. 0 once recorded or dropped (an Exception loses the event, never reaching the reader); -1 with
   anything else (KeyboardInterrupt) set, as there. */
static int
record(PyObject *path, PyObject *position, Py_ssize_t nbytes, long long start, long long end, PyObject *verdict)
{
    PyObject *channel = NULL, *key = NULL, *row = NULL, *done = NULL;
    channel = PyObject_CallMethodNoArgs(reads.context, target_name);
    PyObject *batch = *(PyObject **)((char *)reads.context + reads.batch_offset);
    if (channel == NULL || batch == NULL) {
        goto failed;
    }
    Py_ssize_t url = PyUnicode_Check(path) ? PyUnicode_Find(path, scheme_separator, 0, PY_SSIZE_T_MAX, 1) : 0;
    if (url == -2) {
        goto failed;
    }
    /* A file's path is its resource (keys.resource_of); anything else, keys.read_key decides. */
    key = url == -1 ? hash_key(path, position) : NULL;
    if (key == NULL) {
        PyErr_Clear();
        key = PyObject_CallFunctionObjArgs(reads.read_key, path, position, NULL);
    }
    row = key ? Py_BuildValue("(OOnLLO)", batch, key, nbytes, start, end, verdict) : NULL;
    done = row ? PyObject_CallMethodOneArg(channel, read_name, row) : NULL;
    if (done == NULL) {
        goto failed;
    }
    Py_DECREF(done);
    Py_DECREF(row);
    Py_DECREF(key);
    Py_DECREF(channel);
    return 0;
failed:
    Py_XDECREF(row);
    Py_XDECREF(key);
    Py_XDECREF(channel);
    if (batch == NULL && !PyErr_Occurred()) {
        return 0;  /* unset: the AttributeError record_read would drop */
    }
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

static long long
monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);  /* time.monotonic_ns()'s clock */
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

static PyObject *
plain_readinto(PyObject *file, PyObject *buffer)
{
    PyObject *args[] = {file, buffer};
    return PyObject_Vectorcall(reads.file_readinto, args, 2, NULL);
}

/* reads.RecordedFileIO.readinto: the read timed, open in `context.reading` while it runs, recorded when it
   read bytes or waited, and the file's position moved on; a read inside another recorded read of this
   thread is that read's, and only read. */
static PyObject *
recorded_readinto(PyObject *file, PyObject *buffer)
{
    PyObject *reading = *(PyObject **)((char *)reads.context + reads.reading_offset);
    if (reading == NULL || !PyDict_CheckExact(reading)) {
        return plain_readinto(file, buffer);
    }
    Py_INCREF(reading);  /* a fork handler may put another in the slot meanwhile */
    PyObject *result = NULL, *thread = NULL, *path = NULL, *position = NULL, *verdict = NULL, *start = NULL,
             *open_read = NULL;
    thread = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (thread == NULL) {
        goto done;
    }
    int inside = PyDict_Contains(reading, thread);
    if (inside != 0) {
        result = inside < 0 ? NULL : plain_readinto(file, buffer);
        goto done;
    }
    path = PyObject_GetAttr(file, path_name);
    position = path ? PyObject_GetAttr(file, position_name) : NULL;
    verdict = position ? PyObject_GetAttr(file, verdict_name) : NULL;
    long long started = monotonic_ns();
    start = verdict ? PyLong_FromLongLong(started) : NULL;
    open_read = start ? PyTuple_Pack(3, path, position, start) : NULL;
    if (open_read == NULL || PyDict_SetItem(reading, thread, open_read) < 0) {
        goto done;
    }
    result = plain_readinto(file, buffer);
    /* As `reading.pop(thread, None)` in a finally: a ReadSpan inside may have ended it already. */
    PyObject *error_type, *error_value, *error_traceback;
    PyErr_Fetch(&error_type, &error_value, &error_traceback);
    if (PyDict_Contains(reading, thread) == 1 && PyDict_DelItem(reading, thread) < 0) {
        PyErr_Clear();
    }
    PyErr_Restore(error_type, error_value, error_traceback);
    if (result == NULL) {
        goto done;
    }
    Py_ssize_t nbytes = result == Py_None ? 0 : PyLong_AsSsize_t(result);
    if (nbytes == -1 && PyErr_Occurred()) {
        Py_CLEAR(result);
        goto done;
    }
    long long ended = monotonic_ns();
    if (nbytes || ended - started >= reads.empty_read_ns) {
        if (record(path, position, nbytes, started, ended, verdict) < 0) {
            Py_CLEAR(result);
            goto done;
        }
    }
    if (nbytes > 0) {
        PyObject *count = PyLong_FromSsize_t(nbytes);
        PyObject *moved = count ? PyNumber_Add(position, count) : NULL;
        Py_XDECREF(count);
        if (moved == NULL || PyObject_SetAttr(file, position_name, moved) < 0) {
            Py_CLEAR(result);
        }
        Py_XDECREF(moved);
    }
done:
    Py_DECREF(reading);
    Py_XDECREF(thread);
    Py_XDECREF(path);
    Py_XDECREF(position);
    Py_XDECREF(verdict);
    Py_XDECREF(start);
    Py_XDECREF(open_read);
    return result;
}

static PyMethodDef recorded_readinto_method = {
    "readinto", (PyCFunction)recorded_readinto, METH_O,
    PyDoc_STR("readinto(buffer): read into the buffer, the read recorded (read capture's raw file).")};

static PyObject *
make_recorded_readinto(PyObject *module, PyObject *args)
{
    PyObject *file_type, *context, *read_key;
    long long empty_read_ns;
    if (!PyArg_ParseTuple(args, "O!OOL:recorded_readinto", &PyType_Type, &file_type, &context, &read_key,
                          &empty_read_ns)) {
        return NULL;
    }
    Py_ssize_t reading_offset = slot_offset(context, "reading");
    Py_ssize_t batch_offset = reading_offset < 0 ? -1 : slot_offset(context, "batch");
    PyObject *file_readinto = batch_offset < 0 ? NULL : PyObject_GetAttrString(file_type, "readinto");
    if (file_readinto == NULL) {
        return NULL;
    }
    Py_XSETREF(reads.context, Py_NewRef(context));
    Py_XSETREF(reads.read_key, Py_NewRef(read_key));
    reads.batch_offset = batch_offset;
    Py_XSETREF(reads.file_readinto, file_readinto);
    reads.reading_offset = reading_offset;
    reads.empty_read_ns = empty_read_ns;
    return PyDescr_NewMethod((PyTypeObject *)file_type, &recorded_readinto_method);
}

static PyMethodDef module_functions[] = {
    {"read_key", (PyCFunction)(void (*)(void))read_key, METH_FASTCALL,
     PyDoc_STR("read_key(resource, offset): keys.read_key of a resource (a path, a URL's path), in C")},
    {"recorded_readinto", make_recorded_readinto, METH_VARARGS,
     PyDoc_STR("recorded_readinto(file_type, context, read_key, empty_read_ns): RecordedFileIO.readinto")},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "stallwatch.client._speedups",
    .m_doc = PyDoc_STR("Read capture's open() hook and raw readinto in C (capture.py and reads.py fall back to "
                       "Python)."),
    .m_size = -1,
    .m_methods = module_functions,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    path_name = PyUnicode_InternFromString("_path");
    position_name = PyUnicode_InternFromString("_position");
    verdict_name = PyUnicode_InternFromString("_verdict");
    target_name = PyUnicode_InternFromString("target");
    read_name = PyUnicode_InternFromString("read");
    scheme_separator = PyUnicode_InternFromString("://");
    if (path_name == NULL || position_name == NULL || verdict_name == NULL || target_name == NULL ||
        read_name == NULL || scheme_separator == NULL || PyType_Ready(&OpenHookType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "OpenHook", (PyObject *)&OpenHookType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
