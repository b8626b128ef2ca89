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

   CapturedFileIO. A captured file's buffer refills through its raw file's `readinto`, one event a read of
   the file system: `record_reads(file, path, verdict, position)` makes the raw file (an io.FileIO) this
   subclass of it, whose `readinto`, `readall`, `read` and `seek` time and record those reads with the
   FileReads kept for it in a table by the file's address (reads.FileReads, reads.timed_read and reads.record_read
   inline), until its `close` makes it an io.FileIO again. `configure(...)` says where the records go, once.

   read_key. keys.read_key's hash, below. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pthread.h>
#include <pythread.h>
#include <stdint.h>
#include <time.h>

/* A captured read's path runs once a file read, between two of which the reader's own work (a JPEG's decode)
   evicts it from the instruction cache: what runs only at a file's first read, beside another read or on an
   error is kept out of line, in the compiler's section for cold code, so the lines each read misses are few. */
#if defined(__GNUC__)
#define COLD __attribute__((cold, noinline))
#define UNLIKELY(condition) __builtin_expect(!!(condition), 0)
#else
#define COLD
#define UNLIKELY(condition) (condition)
#endif

/* Folders a path may lie under, each a str ending in the separator: laid out back to back when all are
   Latin-1 (each its length, a Py_ssize_t, and its bytes), so a Latin-1 path is compared with memcmp. */
typedef struct {
    PyObject *tuple;
    int latin1;
    Py_ssize_t size;
    char *bytes;
} Folders;

static int
folders_init(Folders *folders, PyObject *tuple)
{
    int latin1 = 1;
    Py_ssize_t size = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); i++) {
        PyObject *folder = PyTuple_GET_ITEM(tuple, i);
        if (!PyUnicode_Check(folder)) {
            PyErr_SetString(PyExc_TypeError, "OpenHook: folders must be str");
            return -1;
        }
        if (PyUnicode_READY(folder) < 0) {
            return -1;
        }
        latin1 &= PyUnicode_KIND(folder) == PyUnicode_1BYTE_KIND;
        size += (Py_ssize_t)sizeof(Py_ssize_t) + PyUnicode_GET_LENGTH(folder);
    }
    folders->bytes = latin1 ? PyMem_Malloc(size ? size : 1) : NULL;
    if (latin1 && folders->bytes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    folders->tuple = Py_NewRef(tuple);
    folders->latin1 = latin1;
    folders->size = size;
    char *at = folders->bytes;
    for (Py_ssize_t i = 0; latin1 && i < PyTuple_GET_SIZE(tuple); i++) {
        PyObject *folder = PyTuple_GET_ITEM(tuple, i);
        Py_ssize_t length = PyUnicode_GET_LENGTH(folder);
        memcpy(at, &length, sizeof length);
        memcpy(at + sizeof length, PyUnicode_DATA(folder), length);
        at += sizeof length + length;
    }
    return 0;
}

/* Whether `path` (a ready str) starts with one of the folders: 1, 0, or -1 with an error set. */
static int
under(Folders *folders, PyObject *path)
{
    if (folders->latin1 && PyUnicode_KIND(path) == PyUnicode_1BYTE_KIND) {
        const char *data = (const char *)PyUnicode_DATA(path);
        Py_ssize_t length = PyUnicode_GET_LENGTH(path);
        for (const char *at = folders->bytes, *end = at + folders->size; at < end;) {
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
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(folders->tuple); i++) {
        Py_ssize_t found = PyUnicode_Tailmatch(path, PyTuple_GET_ITEM(folders->tuple, i), 0, PY_SSIZE_T_MAX, -1);
        if (found != 0) {
            return (int)found;
        }
    }
    return 0;
}

static void
folders_clear(Folders *folders)
{
    Py_CLEAR(folders->tuple);
    PyMem_Free(folders->bytes);
    folders->bytes = NULL;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Py_ssize_t source_offset;  /* of `context`'s `source` slot */
    PyObject *context;
    PyObject *original;
    /* io.open's C function and its module, called straight (past the vectorcall of a builtin and its result's
       check: ~70 of the ~290 instructions the hook added to an open it skips), where `original` is io.open as
       3.11 defines it (METH_FASTCALL | METH_KEYWORDS); else NULL, and `original` is called. */
    _PyCFunctionFastWithKeywords original_function;
    PyObject *original_self;
    PyObject *capturing;
    Folders skipped;
    Folders mounts;           /* spoke mounts: a file under one is a spoke read */
    PyObject *spoke_verdict;  /* wire.VERDICT_UNKNOWN: the agent's to give */
    PyObject *other_verdict;  /* wire.VERDICT_DIRECT */
} OpenHook;

static PyObject *captured_open(PyObject *opened, int binary, PyObject *path, PyObject *verdict);

/* The modes of a file the hook captures itself: read only, binary or text. */
static int
read_mode(PyObject *mode, int *binary)
{
    if (!PyUnicode_CheckExact(mode) || PyUnicode_READY(mode) < 0 || PyUnicode_GET_LENGTH(mode) > 2 ||
        PyUnicode_KIND(mode) != PyUnicode_1BYTE_KIND) {
        PyErr_Clear();
        return 0;
    }
    const char *text = (const char *)PyUnicode_DATA(mode);
    *binary = strcmp(text, "rb") == 0 || strcmp(text, "br") == 0;
    return *binary || strcmp(text, "r") == 0 || strcmp(text, "rt") == 0 || strcmp(text, "tr") == 0;
}

static inline PyObject *
call_original(OpenHook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (self->original_function != NULL) {
        return self->original_function(self->original_self, args, PyVectorcall_NARGS(nargsf), kwnames);
    }
    return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
}

static PyObject *
hook_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    OpenHook *self = (OpenHook *)callable;
    PyObject *source = *(PyObject **)((char *)self->context + self->source_offset);
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    int original = source == NULL || source == Py_None;  /* unset: capture's own test raises, and refuses */
    if (original || nargs < 1 || !PyUnicode_CheckExact(args[0])) {
        return original ? call_original(self, args, nargsf, kwnames)
                        : PyObject_Vectorcall(self->capturing, args, nargsf, kwnames);
    }
    PyObject *path = args[0];
    original = PyUnicode_READY(path) < 0 ? -1 : under(&self->skipped, path);
    if (original < 0) {
        PyErr_Clear();  /* never into the reader: capture's own tests decide */
        original = 0;
    }
    if (original) {
        return call_original(self, args, nargsf, kwnames);
    }
    /* The common capture, `open(path)` or `open(path, mode)` of an absolute path for reading: here, as
       capturing_open does it; any other, capturing_open decides. */
    int binary = 0, mounted;
    if (kwnames != NULL || nargs > 2 || (nargs == 2 && !read_mode(args[1], &binary)) ||
        PyUnicode_READ_CHAR(path, 0) != '/' || (mounted = under(&self->mounts, path)) < 0) {
        PyErr_Clear();
        return PyObject_Vectorcall(self->capturing, args, nargsf, kwnames);
    }
    PyObject *opened = call_original(self, args, nargsf, NULL);
    return opened ? captured_open(opened, binary, path, mounted ? self->spoke_verdict : self->other_verdict) : NULL;
}

/* The offset of `type`'s __slots__ member `name`, or -1 with an error set. */
static Py_ssize_t
slot_offset(PyObject *type, const char *name)
{
    PyObject *member = PyObject_GetAttrString(type, name);
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
        PyErr_Format(PyExc_TypeError, "`%s` of %R must be a __slots__ member", name, type);
    }
    return offset;
}

static PyObject *
hook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"original", "capturing", "context", "skipped_folders", "spoke_mounts", "spoke_verdict",
                            "other_verdict", NULL};
    PyObject *original, *capturing, *context, *skipped_folders, *spoke_mounts, *spoke_verdict, *other_verdict;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO!O!OO:OpenHook", names, &original, &capturing, &context,
                                     &PyTuple_Type, &skipped_folders, &PyTuple_Type, &spoke_mounts, &spoke_verdict,
                                     &other_verdict)) {
        return NULL;
    }
    Py_ssize_t source_offset = slot_offset((PyObject *)Py_TYPE(context), "source");
    if (source_offset < 0) {
        return NULL;
    }
    OpenHook *self = (OpenHook *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = hook_vectorcall;
    self->source_offset = source_offset;
    self->context = Py_NewRef(context);
    self->original = Py_NewRef(original);
    if (PyCFunction_CheckExact(original) &&
        PyCFunction_GET_FLAGS(original) == (METH_FASTCALL | METH_KEYWORDS)) {
        self->original_function = (_PyCFunctionFastWithKeywords)(void (*)(void))PyCFunction_GET_FUNCTION(original);
        self->original_self = PyCFunction_GET_SELF(original);  /* io.open's module, held by `original` */
    }
    self->capturing = Py_NewRef(capturing);
    self->spoke_verdict = Py_NewRef(spoke_verdict);
    self->other_verdict = Py_NewRef(other_verdict);
    if (folders_init(&self->skipped, skipped_folders) < 0 || folders_init(&self->mounts, spoke_mounts) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
hook_traverse(OpenHook *self, visitproc visit, void *arg)
{
    Py_VISIT(self->context);
    Py_VISIT(self->original);
    Py_VISIT(self->capturing);
    Py_VISIT(self->skipped.tuple);
    Py_VISIT(self->mounts.tuple);
    Py_VISIT(self->spoke_verdict);
    Py_VISIT(self->other_verdict);
    return 0;
}

static int
hook_clear(OpenHook *self)
{
    Py_CLEAR(self->context);
    Py_CLEAR(self->original);
    Py_CLEAR(self->capturing);
    Py_CLEAR(self->spoke_verdict);
    Py_CLEAR(self->other_verdict);
    folders_clear(&self->skipped);
    folders_clear(&self->mounts);
    return 0;
}

static void
hook_dealloc(OpenHook *self)
{
    PyObject_GC_UnTrack(self);
    hook_clear(self);
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

/* read_key: keys.read_key's hash. The resource's: the first 8 bytes of BLAKE2b-64 (RFC 7693) of its UTF-8, as
   a little-endian integer (hashlib's object and its digest cost ~0.6 µs of the ~0.8 µs it takes in Python);
   a captured file computes it once, at its first read. Each read's: that and its offset mixed (key_at). */
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
    /* Rolled: unrolled, the twelve rounds are 6 KB of code, which the work between two files (a JPEG's decode)
       evicts from the instruction cache, so each file's hash missed it ~100 times; rolled, ~0.7 KB. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 1
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

/* The hash of `resource` (an exact str): BLAKE2b-64 of its UTF-8 into `hash`, 0; or -1 with an error set,
   UnicodeEncodeError as str.encode raises it. A file's reads share it: hashed once a file, not once a read. */
static int
resource_hash_of(PyObject *resource, uint64_t *hash)
{
    Py_ssize_t length;
    const char *utf8 = PyUnicode_AsUTF8AndSize(resource, &length);
    if (utf8 == NULL) {
        return -1;
    }
    *hash = blake2b_64((const uint8_t *)utf8, (size_t)length);
    return 0;
}

/* The key of the read at `offset` of the resource whose hash is `hash` (keys.key_at): splitmix64's finalizer
   of their sum modulo 2^64, a bijection, so two reads' keys collide only as often as any 64-bit hash's. */
static uint64_t
key_at(uint64_t hash, long long offset)
{
    uint64_t z = hash + (uint64_t)offset;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* The key of `resource` (an exact str) at `offset` (an exact int) into `key`: 0, or -1 with an error set,
   TypeError or OverflowError for what it does not take (keys.read_key hashes that in Python),
   UnicodeEncodeError as str.encode raises it. */
static int
hash_key(PyObject *resource, PyObject *offset_object, uint64_t *key)
{
    if (!PyUnicode_CheckExact(resource) || !PyLong_CheckExact(offset_object)) {
        PyErr_SetString(PyExc_TypeError, "read_key(resource: str, offset: int)");
        return -1;
    }
    long long offset = PyLong_AsLongLong(offset_object);
    uint64_t hash;
    if ((offset == -1 && PyErr_Occurred()) || resource_hash_of(resource, &hash) < 0) {
        return -1;
    }
    *key = key_at(hash, offset);
    return 0;
}

static PyObject *
read_key(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "read_key(resource: str, offset: int)");
        return NULL;
    }
    uint64_t key;
    return hash_key(args[0], args[1], &key) < 0 ? NULL : PyLong_FromUnsignedLongLong(key);
}

/* FileReads' settings: one set a process (reads.py calls `configure` once, at import). */
static struct {
    PyObject *context;         /* reads.context */
    Py_ssize_t reading_offset; /* its `reading` slot: each thread's open read, (location, offset, start) */
    Py_ssize_t batch_offset;   /* its `batch` slot: the batch the reads serve */
    Py_ssize_t channel_offset; /* its `channel` slot: where its reads go, while the process's sender owns it */
    PyObject *process_sender;  /* transport._current */
    Py_ssize_t sender_offset;  /* its `sender` slot: the process's sender */
    Py_ssize_t owner_offset;   /* a transport.Channel's `owner` slot */
    Py_ssize_t rows_offset;    /* a transport.Channel's `reads` slot: the packed records waiting to be sent */
    Py_ssize_t full;           /* records a channel holds before it flushes (transport.FULL) */
    PyObject *read_key;        /* keys.read_key, for a path hash_key does not take */
    long long empty_read_ns;   /* a read of no bytes at least this long is an event (reads.EMPTY_READ_NS) */
} reads;

static PyObject *target_name, *flush_full_name, *drop_name;  /* "target", "flush_full", "drop" */
static PyObject *scheme_separator;  /* "://" */
static PyObject *one;  /* 1 */
static PyObject *buffer_name, *raw_name;  /* "buffer", "raw" */

/* io.FileIO, the methods of it that a captured file's call, and CapturedFileIO: found and made at import. */
static PyTypeObject *file_io_type, *captured_type;
static PyObject *file_readinto, *file_readall, *file_read, *file_seek, *file_close;
/* io.FileIO's C functions that a captured file calls straight, past the checks of their descriptors (whose test of
   the first argument's type walks a subclass's bases), where they take their arguments as they do in 3.11:
   readinto (METH_O), close (METH_NOARGS), seek (METH_FASTCALL); else NULL, and the call goes through the descriptor. */
static PyCFunction readinto_function, close_function;
static _PyCFunctionFast seek_function;
/* The members of open()'s objects that a capture reads, from their structs where the object is of the exact type:
   io.BufferedReader's `raw`, io.TextIOWrapper's `buffer` (0: through getattr). */
static PyTypeObject *buffered_reader_type, *text_wrapper_type;
static Py_ssize_t raw_offset, buffer_offset;

/* `method(*call)`, one of io.FileIO's: its readinto called straight where it can be, the others through it. */
static inline PyObject *
call_file_io(PyObject *method, PyObject *const *call, Py_ssize_t nargs)
{
    if (method == file_readinto && readinto_function != NULL && nargs == 2) {
        return readinto_function(call[0], call[1]);
    }
    return PyObject_Vectorcall(method, call, nargs, NULL);
}

#define SLOT(object, offset) (*(PyObject **)((char *)(object) + (offset)))

/* The channel the context's reads go to: its own while the process's sender owns it (what
   `context.target()` returns then, without the call), else what `target()` returns. */
static PyObject *
read_channel(void)
{
    PyObject *channel = SLOT(reads.context, reads.channel_offset);
    PyObject *sender = SLOT(reads.process_sender, reads.sender_offset);
    if (channel != NULL && channel != Py_None && sender != NULL && sender != Py_None &&
        SLOT(channel, reads.owner_offset) == sender) {
        return Py_NewRef(channel);
    }
    return PyObject_CallMethodNoArgs(reads.context, target_name);
}

/* A READ record as wire.READ packs it ("<qQqqqb"): what a channel's `reads` holds. */
#define READ_RECORD_SIZE 41

static void
put_le64(char *at, uint64_t value)
{
    for (int i = 0; i < 8; i++) {
        at[i] = (char)(value >> (8 * i));
    }
}

/* A captured raw file's reads: reads.FileReads in C, the state its CapturedFileIO methods record with, kept
   in `captured_files` until the file's close. It holds no reference to the file, only an
   exact str and an exact int, so it cannot be part of a cycle and is not tracked by the cyclic garbage
   collector, whose bookkeeping costs more than the rest of a capture's open. */
typedef struct {
    PyObject_HEAD
    PyObject *path;      /* the str its reads are keyed by */
    long long position;  /* where the file's next read starts (a tell() would be a system call) */
    PyObject *verdict;
    int verdict_byte;        /* the verdict as its record packs it; outside -128..127 its reads cannot be packed */
    int keyed;               /* 0: not yet; 1: resource_hash is its path's; -1: keys.read_key keys its reads */
    uint64_t resource_hash;  /* its path's, for every read's key (keys.resource_hash) */
} FileReads;

/* Whether `text` holds "://": its colons found by memchr, whose code the interpreter keeps warm (memmem's
   is ten times the size, and each file's first read missed it in the instruction cache). */
static int
has_scheme_separator(const char *text, size_t size)
{
    const char *end = text + size;
    for (const char *colon = memchr(text, ':', size); colon != NULL; colon = memchr(colon + 1, ':', end - colon - 1)) {
        if (end - colon >= 3 && colon[1] == '/' && colon[2] == '/') {
            return 1;
        }
    }
    return 0;
}

/* The file's first read: whether its path is a URL, and if not, its hash (keys.resource_of: a file's path is its
   resource; a URL, or a path with no UTF-8, keys.read_key keys). 0, or -1 with an error set. */
COLD static int
key_the_file(FileReads *self)
{
    PyObject *path = self->path;
    Py_ssize_t url = PyUnicode_KIND(path) == PyUnicode_1BYTE_KIND  /* most paths: a byte search, no call */
                     ? (has_scheme_separator(PyUnicode_DATA(path), (size_t)PyUnicode_GET_LENGTH(path)) ? 0 : -1)
                     : PyUnicode_Find(path, scheme_separator, 0, PY_SSIZE_T_MAX, 1);
    if (url == -2) {
        return -1;
    }
    self->keyed = url == -1 && resource_hash_of(path, &self->resource_hash) == 0 ? 1 : -1;
    PyErr_Clear();
    return 0;
}

/* The key keys.read_key gives the read at `position`: 0, or -1 with an error set. */
COLD static int
key_in_python(FileReads *self, long long position, uint64_t *key)
{
    PyObject *offset = PyLong_FromLongLong(position);
    PyObject *hashed = offset ? PyObject_CallFunctionObjArgs(reads.read_key, self->path, offset, NULL) : NULL;
    Py_XDECREF(offset);
    *key = hashed ? PyLong_AsUnsignedLongLong(hashed) : 0;
    Py_XDECREF(hashed);
    return PyErr_Occurred() ? -1 : 0;
}

/* A record lost: an event that cannot be packed (`unpackable`, an Exception set) counted as dropped on the
   channel. 0 with nothing set unless something other than an Exception is set: -1 with it. */
COLD static int
record_lost(PyObject *channel, int unpackable)
{
    if (unpackable && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        PyObject *counted = PyObject_CallMethodObjArgs(channel, drop_name, one, NULL);
        Py_XDECREF(counted);
    }
    Py_XDECREF(channel);
    if (!PyErr_Occurred()) {
        return 0;  /* unset or not a bytearray: the AttributeError or TypeError record_read would drop */
    }
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* Room for one more READ record at the end of a channel's `reads` (an exact bytearray), its size grown by
   one record: where to write it, or NULL with an error set. Within the room the array has, the size is set in
   place; else the room made is a full channel's, for the records to come until its next flush (after which the
   array, emptied from the front, gives its memory back). */
static char *
new_record(PyObject *rows)
{
    PyByteArrayObject *array = (PyByteArrayObject *)rows;
    Py_ssize_t size = Py_SIZE(array), grown = size + READ_RECORD_SIZE;
    if (UNLIKELY(array->ob_exports != 0 || (array->ob_start - array->ob_bytes) + grown >= array->ob_alloc) &&
        PyByteArray_Resize(rows, Py_MAX(grown, reads.full * READ_RECORD_SIZE)) < 0) {
        return NULL;
    }
    Py_SET_SIZE(array, grown);
    array->ob_start[grown] = '\0';  /* as every bytearray ends */
    return array->ob_start + size;
}

/* reads.record_read, inline: the read's record packed, as `Channel.read` packs it, at the end of the
   channel's records. 0 once recorded or lost (an Exception loses the event, never reaching the reader;
   one that cannot be packed is counted as dropped, as there); -1 with anything else set
   (KeyboardInterrupt), as there. */
static int
record(FileReads *self, long long position, Py_ssize_t nbytes, long long start, long long end)
{
    PyObject *channel = read_channel();
    PyObject *batch = SLOT(reads.context, reads.batch_offset);
    PyObject *rows = channel ? SLOT(channel, reads.rows_offset) : NULL;
    if (UNLIKELY(batch == NULL || rows == NULL || !PyByteArray_CheckExact(rows))) {
        return record_lost(channel, 0);
    }
    if (UNLIKELY(self->keyed == 0) && key_the_file(self) < 0) {
        return record_lost(channel, 0);
    }
    uint64_t key;
    if (self->keyed == 1) {
        key = key_at(self->resource_hash, position);
    } else if (key_in_python(self, position, &key) < 0) {
        return record_lost(channel, 1);
    }
    long long batch_value = PyLong_AsLongLong(batch);
    if (UNLIKELY(PyErr_Occurred())) {
        return record_lost(channel, 1);
    }
    if (UNLIKELY(self->verdict_byte < -128 || self->verdict_byte > 127)) {
        PyErr_SetString(PyExc_OverflowError, "a verdict is a signed byte");
        return record_lost(channel, 1);
    }
    char *at = new_record(rows);
    if (UNLIKELY(at == NULL)) {
        return record_lost(channel, 0);
    }
    put_le64(at, (uint64_t)batch_value);
    put_le64(at + 8, key);
    put_le64(at + 16, (uint64_t)nbytes);
    put_le64(at + 24, (uint64_t)start);
    put_le64(at + 32, (uint64_t)end);
    at[40] = (char)self->verdict_byte;
    if (UNLIKELY(PyByteArray_GET_SIZE(rows) >= reads.full * READ_RECORD_SIZE)) {
        PyObject *done = PyObject_CallMethodNoArgs(channel, flush_full_name);
        if (done == NULL) {
            return record_lost(channel, 0);
        }
        Py_DECREF(done);
    }
    Py_DECREF(channel);
    return 0;
}

static long long
monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);  /* time.monotonic_ns()'s clock */
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

/* The read a FileReads has open while no other read is (`context.reading` empty, the usual case): kept
   here, its objects borrowed from the reading thread (which holds them until the read ends), so a read
   allocates nothing to be seen in flight. `open_reads()` gives it to the flush thread; a fork forgets it. */
static struct {
    unsigned long thread;  /* 0: none */
    PyObject *path;
    long long position;
    long long start;
} the_open_read;

static void
forget_the_open_read(void)
{
    the_open_read.thread = 0;  /* in a forked child, the thread that read it is gone */
}

static PyObject *
open_reads(PyObject *module, PyObject *unused)
{
    if (the_open_read.thread == 0) {
        return PyList_New(0);
    }
    return Py_BuildValue("[(OLL)]", the_open_read.path, the_open_read.position, the_open_read.start);
}

/* The bytes a read's result holds: an int (readinto), bytes (read, readall), None (nothing ready). */
static Py_ssize_t
bytes_read(PyObject *result)
{
    if (result == Py_None) {
        return 0;
    }
    if (PyBytes_Check(result)) {
        return PyBytes_GET_SIZE(result);
    }
    return PyLong_AsSsize_t(result);
}

/* The end of a timed read that returned `result` (a new reference) since `started`: recorded when it read bytes
   or waited, and the position moved on. `result`, or NULL with an error set and `result` released. */
static PyObject *
read_done(FileReads *self, PyObject *result, long long position, long long started)
{
    Py_ssize_t nbytes = bytes_read(result);
    if (UNLIKELY(nbytes == -1 && PyErr_Occurred())) {
        Py_DECREF(result);
        return NULL;
    }
    long long ended = monotonic_ns();
    if ((nbytes || ended - started >= reads.empty_read_ns) &&
        UNLIKELY(record(self, position, nbytes, started, ended) < 0)) {
        Py_DECREF(result);
        return NULL;
    }
    if (nbytes > 0) {  /* else as a seek during the read left it */
        self->position = position + nbytes;
    }
    return result;
}

/* The end of a timed read that raised since `started`: an Exception is recorded as a failed read, of no bytes,
   and left set as it was. */
COLD static void
read_failed(FileReads *self, long long position, long long started)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return;
    }
    PyObject *error_type, *error_value, *error_traceback;
    PyErr_Fetch(&error_type, &error_value, &error_traceback);
    if (record(self, position, 0, started, monotonic_ns()) < 0) {
        PyErr_Clear();  /* the read's own error is the one to raise */
    }
    PyErr_Restore(error_type, error_value, error_traceback);
}

/* timed_read beside another read: a read inside one of this thread's recorded reads is that read's, and only
   read; a read while another thread's is open is kept open under its thread in `context.reading`. */
COLD static PyObject *
timed_read_beside(FileReads *self, PyObject *method, PyObject *const *call, Py_ssize_t nargs, PyObject *reading,
                  long long position)
{
    PyObject *result = NULL, *start = NULL, *open_read = NULL;
    unsigned long ident = PyThread_get_thread_ident();
    PyObject *thread = PyLong_FromUnsignedLong(ident);
    int inside = thread == NULL ? -1 : the_open_read.thread == ident ? 1 : PyDict_Contains(reading, thread);
    if (inside != 0) {
        result = inside < 0 ? NULL : PyObject_Vectorcall(method, call, nargs, NULL);
        goto done;
    }
    long long started = monotonic_ns();
    start = PyLong_FromLongLong(started);
    open_read = start ? Py_BuildValue("(OLO)", self->path, position, start) : NULL;
    if (open_read == NULL || PyDict_SetItem(reading, thread, open_read) < 0) {
        goto done;
    }
    result = PyObject_Vectorcall(method, call, nargs, NULL);
    /* As `reading.pop(thread, None)` in a finally: a ReadSpan inside may have ended it already. */
    PyObject *error_type, *error_value, *error_traceback;
    PyErr_Fetch(&error_type, &error_value, &error_traceback);
    if (PyDict_Contains(reading, thread) == 1 && PyDict_DelItem(reading, thread) < 0) {
        PyErr_Clear();
    }
    PyErr_Restore(error_type, error_value, error_traceback);
    if (result != NULL) {
        result = read_done(self, result, position, started);
    } else {
        read_failed(self, position, started);
    }
done:
    Py_XDECREF(thread);
    Py_XDECREF(start);
    Py_XDECREF(open_read);
    return result;
}

/* reads.timed_read for `method(file, *args)`: timed, open in `context.reading` while it runs, recorded
   when it read bytes or waited, and the position moved on; a read inside another recorded read of this
   thread is that read's, and only read. */
static PyObject *
timed_read(FileReads *self, PyObject *file, PyObject *method, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *call[3], *result;
    call[0] = file;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        call[i + 1] = args[i];
    }
    PyObject *reading = SLOT(reads.context, reads.reading_offset);
    if (UNLIKELY(reading == NULL || !PyDict_CheckExact(reading))) {
        return PyObject_Vectorcall(method, call, nargs + 1, NULL);
    }
    Py_INCREF(reading);  /* a fork handler may put another in the slot meanwhile */
    long long position = self->position;
    if (the_open_read.thread == 0 && PyDict_GET_SIZE(reading) == 0) {
        /* No other read open: this one is `the_open_read`, without an object made or a dict touched. */
        long long started = monotonic_ns();
        the_open_read.path = self->path;
        the_open_read.position = position;
        the_open_read.start = started;
        the_open_read.thread = PyThread_get_thread_ident();
        result = call_file_io(method, call, nargs + 1);
        the_open_read.thread = 0;
        if (result != NULL) {
            result = read_done(self, result, position, started);
        } else {
            read_failed(self, position, started);
        }
    } else {
        result = timed_read_beside(self, method, call, nargs + 1, reading, position);
    }
    Py_DECREF(reading);
    return result;
}

static PyTypeObject FileReadsType;

/* The captured files' FileReads, by the file's address: a table of open addressing (linear probing, at most half
   full), where a lookup is a few instructions and no object is touched but the entry; the file's instance dict
   cost ~110 instructions a lookup and ~190 an insertion, four lookups and an insertion a JPEG. An entry goes at
   the file's close (CapturedFileIO's), or as the file is deallocated (closed past it); all under the GIL. */
typedef struct {
    PyObject *file;  /* borrowed: the file leaves the table at its close */
    FileReads *reads;
} CapturedEntry;

static struct {
    CapturedEntry *entries;
    size_t mask;  /* entries - 1, a power of two less one */
    size_t used;
} captured_files;

static inline size_t
entry_of(PyObject *file)
{
    return (size_t)(((uintptr_t)file * 0x9E3779B97F4A7C15u) >> 32) & captured_files.mask;
}

/* The FileReads of `file` (borrowed), NULL where it has none. Every CapturedFileIO has one, from its capture (just
   before it became one) to its close or end (just after it was one); its methods bound before its close may be
   called after it, on the io.FileIO it then is, which has none. */
static inline FileReads *
captured_reads(PyObject *file)
{
    for (size_t i = entry_of(file);; i = (i + 1) & captured_files.mask) {
        CapturedEntry *entry = &captured_files.entries[i];
        if (entry->file == file || entry->file == NULL) {
            return entry->reads;
        }
    }
}

/* The first empty entry from `file`'s home on. */
static size_t
empty_entry(PyObject *file)
{
    size_t i = entry_of(file);
    while (captured_files.entries[i].file != NULL) {
        i = (i + 1) & captured_files.mask;
    }
    return i;
}

/* Put `file`'s entry in the table, holding `reads` (a new reference, taken): 0, or -1 with an error set. */
static int
captured_add(PyObject *file, FileReads *reads)
{
    if ((captured_files.used + 1) * 2 > captured_files.mask + 1) {
        size_t size = (captured_files.mask + 1) * 2;
        CapturedEntry *was = captured_files.entries, *grown = PyMem_Calloc(size, sizeof(CapturedEntry));
        if (grown == NULL) {
            Py_DECREF(reads);
            PyErr_NoMemory();
            return -1;
        }
        size_t old_size = captured_files.mask + 1;
        captured_files.entries = grown;
        captured_files.mask = size - 1;
        for (size_t j = 0; j < old_size; j++) {
            if (was[j].file != NULL) {
                grown[empty_entry(was[j].file)] = was[j];
            }
        }
        PyMem_Free(was);
    }
    size_t i = empty_entry(file);  /* the file has none: a file is captured once, and leaves at its close or end */
    captured_files.entries[i].file = file;
    captured_files.entries[i].reads = reads;
    captured_files.used++;
    return 0;
}

/* Take `file`'s entry out of the table, the entries after it moved back over the gap. */
static void
captured_remove(PyObject *file)
{
    size_t mask = captured_files.mask, i = entry_of(file);
    while (captured_files.entries[i].file != file) {
        if (captured_files.entries[i].file == NULL) {
            return;
        }
        i = (i + 1) & mask;
    }
    FileReads *reads = captured_files.entries[i].reads;
    for (size_t j = (i + 1) & mask; captured_files.entries[j].file != NULL; j = (j + 1) & mask) {
        size_t home = entry_of(captured_files.entries[j].file);
        if (((j - home) & mask) >= ((j - i) & mask)) {  /* its home is at or before the gap: it may move back */
            captured_files.entries[i] = captured_files.entries[j];
            i = j;
        }
    }
    captured_files.entries[i].file = NULL;
    captured_files.entries[i].reads = NULL;
    captured_files.used--;
    Py_DECREF(reads);
}

/* `method(file, *args)`, at most two `args`. */
static PyObject *
call_with(PyObject *method, PyObject *file, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *call[3] = {file, nargs > 0 ? args[0] : NULL, nargs > 1 ? args[1] : NULL};
    return PyObject_Vectorcall(method, call, nargs + 1, NULL);
}

/* `method(file, *args)` (io.FileIO's), timed and recorded with the file's FileReads, held for the read: another
   thread may close the file while this one waits on the file system. */
static PyObject *
recorded_call(PyObject *file, PyObject *method, PyObject *const *args, Py_ssize_t nargs)
{
    FileReads *recorder = (FileReads *)Py_XNewRef(captured_reads(file));
    if (UNLIKELY(recorder == NULL)) {
        return call_with(method, file, args, nargs);  /* no longer captured: as io.FileIO's own would */
    }
    PyObject *result = timed_read(recorder, file, method, args, nargs);
    Py_DECREF(recorder);
    return result;
}

static PyObject *
captured_readinto(PyObject *file, PyObject *buffer)
{
    return recorded_call(file, file_readinto, &buffer, 1);
}

static PyObject *
captured_readall(PyObject *file, PyObject *unused)
{
    return recorded_call(file, file_readall, NULL, 0);
}

static PyObject *
captured_read(PyObject *file, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "read expected at most 1 argument, got %zd", nargs);
        return NULL;
    }
    return recorded_call(file, file_read, args, nargs);
}

/* io.FileIO.seek, the position kept. */
static PyObject *
captured_seek(PyObject *file, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs > 2) {
        PyErr_Format(PyExc_TypeError, "seek expected at most 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *moved = seek_function ? seek_function(file, args, nargs) : call_with(file_seek, file, args, nargs);
    FileReads *recorder = moved ? captured_reads(file) : NULL;
    if (recorder != NULL) {
        long long position = PyLong_AsLongLong(moved);  /* lseek's: an off_t */
        if (position == -1 && PyErr_Occurred()) {
            Py_CLEAR(moved);
        } else {
            recorder->position = position;
        }
    }
    return moved;
}

/* Make `file` an object of `type` (the same layout), as assigning `__class__` does: an object holds a reference
   to its type where that is a heap type (CapturedFileIO; io.FileIO from 3.12, not in 3.11, where moving one
   from it left it none to give once the files open at once outnumbered its references). */
static void
set_type(PyObject *file, PyTypeObject *type)
{
    PyTypeObject *was = Py_TYPE(file);
    if (type->tp_flags & Py_TPFLAGS_HEAPTYPE) {
        Py_INCREF(type);
    }
    Py_SET_TYPE(file, type);
    if (was->tp_flags & Py_TPFLAGS_HEAPTYPE) {
        Py_DECREF(was);
    }
}

/* io.FileIO.close, and the file a plain io.FileIO again: a closed file reads nothing more to record (each read
   raises, as the type's would), and it is deallocated as the io.FileIO that open() made. The close of a file
   nobody closed, as it is dropped, is this one too. */
static PyObject *
captured_close(PyObject *file, PyObject *unused)
{
    PyObject *closed = close_function ? close_function(file, NULL) : PyObject_CallOneArg(file_close, file);
    if (Py_TYPE(file) == captured_type) {
        set_type(file, file_io_type);
        captured_remove(file);
    }
    return closed;
}

/* A file dropped while still a CapturedFileIO (closed by io.FileIO.close itself, past its type's close, or never
   closed): its entry out of the table and the file an io.FileIO again, deallocated as one (closed first if open). */
static void
captured_dealloc(PyObject *file)
{
    captured_remove(file);
    set_type(file, file_io_type);
    file_io_type->tp_dealloc(file);
}

static PyMethodDef captured_methods[] = {
    {"readinto", (PyCFunction)captured_readinto, METH_O, PyDoc_STR("io.FileIO.readinto, recorded")},
    {"readall", (PyCFunction)captured_readall, METH_NOARGS, PyDoc_STR("io.FileIO.readall, recorded")},
    {"read", (PyCFunction)(void (*)(void))captured_read, METH_FASTCALL, PyDoc_STR("io.FileIO.read, recorded")},
    {"seek", (PyCFunction)(void (*)(void))captured_seek, METH_FASTCALL,
     PyDoc_STR("io.FileIO.seek, the position kept")},
    {"close", (PyCFunction)captured_close, METH_NOARGS, PyDoc_STR("io.FileIO.close, the file an io.FileIO again")},
    {NULL},
};

/* Named as io.FileIO is, so that its repr, its errors and its pickling's refusal read as the file's did. */
static PyType_Slot captured_slots[] = {
    {Py_tp_doc, (void *)PyDoc_STR("io.FileIO whose reads read capture records (stallwatch.client._speedups), from "
                                  "open() to close")},
    {Py_tp_methods, captured_methods},
    {Py_tp_dealloc, captured_dealloc},
    {0, NULL},
};

static PyType_Spec captured_spec = {
    .name = "_io.FileIO",
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = captured_slots,
};

/* A FileReads of a file from `position`, or NULL with an error set. The path becomes an exact str and the
   verdict an exact int (see FileReads: nothing it holds may lead back to the file). */
static PyObject *
file_reads_of(PyObject *path, PyObject *verdict, long long position)
{
    FileReads *self = PyObject_New(FileReads, &FileReadsType);
    if (self == NULL) {
        return NULL;
    }
    self->keyed = 0;
    self->path = PyUnicode_CheckExact(path) ? Py_NewRef(path) : PyUnicode_FromObject(path);
    self->verdict = PyNumber_Index(verdict);
    self->position = position;
    if (self->path == NULL || self->verdict == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    int overflow;
    long byte = PyLong_AsLongAndOverflow(self->verdict, &overflow);
    self->verdict_byte = overflow || byte < -128 || byte > 127 ? INT_MAX : (int)byte;
    return (PyObject *)self;
}

static void
file_reads_dealloc(FileReads *self)
{
    Py_XDECREF(self->path);
    Py_XDECREF(self->verdict);
    PyObject_Free(self);
}

static PyObject *
file_reads_position(FileReads *self, void *closure)
{
    return PyLong_FromLongLong(self->position);
}

/* As reads.FileReads names its state. */
static PyMemberDef file_reads_members[] = {
    {"_path", T_OBJECT, offsetof(FileReads, path), READONLY, NULL},
    {"_verdict", T_OBJECT, offsetof(FileReads, verdict), READONLY, NULL},
    {NULL},
};

static PyGetSetDef file_reads_getset[] = {
    {"_position", (getter)file_reads_position, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject FileReadsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stallwatch.client._speedups.FileReads",
    .tp_doc = PyDoc_STR("A captured raw file's reads: what its CapturedFileIO methods record with"),
    .tp_basicsize = sizeof(FileReads),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .tp_dealloc = (destructor)file_reads_dealloc,
    .tp_members = file_reads_members,
    .tp_getset = file_reads_getset,
};

/* reads.record_reads in C: `file` (an exact io.FileIO, as open() makes it) a CapturedFileIO from now on, its
   reads from `position` recorded. 0, or -1 with an error set and the file as it was. Its type changes after
   open() has made the buffer over it, whose fast paths for an exact io.FileIO (its closed test in C rather
   than an attribute lookup, 42 of them for a JPEG through PIL) stay in place: they read the fields the two
   types share. */
static int
record_file(PyObject *file, PyObject *path, PyObject *verdict, long long position)
{
    if (!Py_IS_TYPE(file, file_io_type)) {
        PyErr_Format(PyExc_TypeError, "read capture records an io.FileIO, not %.200s", Py_TYPE(file)->tp_name);
        return -1;
    }
    PyObject *recorder = file_reads_of(path, verdict, position);
    if (recorder == NULL || captured_add(file, (FileReads *)recorder) < 0) {
        return -1;
    }
    set_type(file, captured_type);
    return 0;
}

static PyObject *
record_reads(PyObject *module, PyObject *args)
{
    PyObject *file, *path, *verdict;
    long long position = 0;
    if (!PyArg_ParseTuple(args, "OUO|L:record_reads", &file, &path, &verdict, &position) ||
        record_file(file, path, verdict, position) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
recorder(PyObject *module, PyObject *file)
{
    FileReads *found = Py_IS_TYPE(file, captured_type) ? captured_reads(file) : NULL;
    return Py_NewRef(found ? (PyObject *)found : Py_None);
}

/* `object.name`, read from its struct where `object` is of exactly `type`, whose member it is at `offset` (not 0). */
static PyObject *
member(PyObject *object, PyTypeObject *type, Py_ssize_t offset, PyObject *name)
{
    PyObject *value = offset && Py_IS_TYPE(object, type) ? SLOT(object, offset) : NULL;
    return value ? Py_NewRef(value) : PyObject_GetAttr(object, name);
}

/* reads.record_reads for the file open() made (its raw file, or its buffer's under a text layer), from
   its start: `opened` returned, its reads recorded, or left as it was where recording fails. */
static PyObject *
captured_open(PyObject *opened, int binary, PyObject *path, PyObject *verdict)
{
    PyObject *buffer = binary ? Py_NewRef(opened) : member(opened, text_wrapper_type, buffer_offset, buffer_name);
    PyObject *file = buffer ? member(buffer, buffered_reader_type, raw_offset, raw_name) : NULL;
    if (file != NULL) {
        record_file(file, path, verdict, 0);
    }
    Py_XDECREF(buffer);
    Py_XDECREF(file);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            Py_DECREF(opened);
            return NULL;
        }
        PyErr_Clear();  /* never into the reader: the file reads on, uncaptured */
    }
    return opened;
}

/* The settings FileReads records with, one set a process (reads.py sets them once, at import). */
static PyObject *
configure(PyObject *module, PyObject *args)
{
    PyObject *context, *read_key, *process_sender, *channel_type;
    long long empty_read_ns;
    Py_ssize_t full;
    if (!PyArg_ParseTuple(args, "OOLOO!n:configure", &context, &read_key, &empty_read_ns, &process_sender, &PyType_Type, &channel_type, &full)) {
        return NULL;
    }
    PyObject *context_type = (PyObject *)Py_TYPE(context), *sender_type = (PyObject *)Py_TYPE(process_sender);
    Py_ssize_t offsets[6] = {
        slot_offset(context_type, "reading"), slot_offset(context_type, "batch"),
        slot_offset(context_type, "channel"), slot_offset(sender_type, "sender"),
        slot_offset(channel_type, "owner"), slot_offset(channel_type, "reads")};
    for (int i = 0; i < 6; i++) {
        if (offsets[i] < 0) {
            return NULL;
        }
    }
    Py_XSETREF(reads.context, Py_NewRef(context));
    Py_XSETREF(reads.process_sender, Py_NewRef(process_sender));
    Py_XSETREF(reads.read_key, Py_NewRef(read_key));
    reads.reading_offset = offsets[0];
    reads.batch_offset = offsets[1];
    reads.channel_offset = offsets[2];
    reads.sender_offset = offsets[3];
    reads.owner_offset = offsets[4];
    reads.rows_offset = offsets[5];
    reads.full = full;
    reads.empty_read_ns = empty_read_ns;
    Py_RETURN_NONE;
}

static PyMethodDef module_functions[] = {
    {"read_key", (PyCFunction)(void (*)(void))read_key, METH_FASTCALL,
     PyDoc_STR("read_key(resource, offset): keys.read_key of a resource (a path, a URL's path), in C")},
    {"open_reads", open_reads, METH_NOARGS,
     PyDoc_STR("open_reads(): [(location, offset, start)] of the read a FileReads has open outside context.reading")},
    {"configure", configure, METH_VARARGS,
     PyDoc_STR("configure(context, read_key, empty_read_ns, process_sender, channel_type, full): what captured "
               "files record with")},
    {"recorder", recorder, METH_O,
     PyDoc_STR("recorder(file): the FileReads a CapturedFileIO records its reads with, None for any other object")},
    {"record_reads", record_reads, METH_VARARGS,
     PyDoc_STR("record_reads(file, path, verdict, position=0): reads.record_reads in C, `file` a CapturedFileIO "
               "until its close")},
    {NULL},
};

/* The C function of `method` (a method descriptor) where it takes its arguments as `flags` say, else NULL. */
static void *
c_function(PyObject *method, int flags)
{
    if (Py_IS_TYPE(method, &PyMethodDescr_Type) && ((PyMethodDescrObject *)method)->d_method->ml_flags == flags) {
        return (void *)((PyMethodDescrObject *)method)->d_method->ml_meth;
    }
    return NULL;
}

/* The offset of `type`'s member `name` (an object), 0 where it is not one. */
static Py_ssize_t
member_offset(PyTypeObject *type, const char *name)
{
    Py_ssize_t offset = slot_offset((PyObject *)type, name);
    if (offset < 0) {
        PyErr_Clear();
        return 0;
    }
    return offset;
}

/* io.FileIO, its methods that a captured file's call, and CapturedFileIO, its subclass: 0, or -1 with an error set. */
static int
file_io_methods(void)
{
    PyObject *io = PyImport_ImportModule("io");
    PyObject *file_io = io ? PyObject_GetAttrString(io, "FileIO") : NULL;
    if (file_io == NULL) {
        Py_XDECREF(io);
        return -1;
    }
    if (!PyType_Check(file_io)) {
        PyErr_SetString(PyExc_TypeError, "io.FileIO is not a type");
        Py_DECREF(io);
        Py_DECREF(file_io);
        return -1;
    }
    file_io_type = (PyTypeObject *)file_io;
    file_readinto = PyObject_GetAttrString(file_io, "readinto");
    file_readall = PyObject_GetAttrString(file_io, "readall");
    file_read = PyObject_GetAttrString(file_io, "read");
    file_seek = PyObject_GetAttrString(file_io, "seek");
    file_close = PyObject_GetAttrString(file_io, "close");
    if (file_readinto == NULL || file_readall == NULL || file_read == NULL || file_seek == NULL || file_close == NULL) {
        Py_DECREF(io);
        return -1;
    }
    readinto_function = (PyCFunction)c_function(file_readinto, METH_O);
    close_function = (PyCFunction)c_function(file_close, METH_NOARGS);
    seek_function = (_PyCFunctionFast)c_function(file_seek, METH_FASTCALL);
    buffered_reader_type = (PyTypeObject *)PyObject_GetAttrString(io, "BufferedReader");
    text_wrapper_type = (PyTypeObject *)PyObject_GetAttrString(io, "TextIOWrapper");
    Py_DECREF(io);
    if (buffered_reader_type == NULL || text_wrapper_type == NULL) {
        return -1;
    }
    raw_offset = member_offset(buffered_reader_type, "raw");
    buffer_offset = member_offset(text_wrapper_type, "buffer");
    captured_type = (PyTypeObject *)PyType_FromSpecWithBases(&captured_spec, file_io);
    if (captured_type == NULL) {
        return -1;
    }
    if (captured_type->tp_basicsize != file_io_type->tp_basicsize ||
        captured_type->tp_dictoffset != file_io_type->tp_dictoffset) {
        PyErr_SetString(PyExc_TypeError, "CapturedFileIO: not io.FileIO's layout");
        return -1;
    }
    return 0;
}

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
    target_name = PyUnicode_InternFromString("target");
    flush_full_name = PyUnicode_InternFromString("flush_full");
    drop_name = PyUnicode_InternFromString("drop");
    one = PyLong_FromLong(1);
    scheme_separator = PyUnicode_InternFromString("://");
    buffer_name = PyUnicode_InternFromString("buffer");
    raw_name = PyUnicode_InternFromString("raw");
    captured_files.mask = 63;
    captured_files.entries = PyMem_Calloc(captured_files.mask + 1, sizeof(CapturedEntry));
    if (target_name == NULL || flush_full_name == NULL || drop_name == NULL || one == NULL ||
        scheme_separator == NULL || buffer_name == NULL || raw_name == NULL || captured_files.entries == NULL ||
        PyType_Ready(&OpenHookType) < 0 || PyType_Ready(&FileReadsType) < 0 || file_io_methods() < 0) {
        return NULL;
    }
    if (pthread_atfork(NULL, NULL, forget_the_open_read) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "OpenHook", (PyObject *)&OpenHookType) < 0 ||
        PyModule_AddObjectRef(m, "FileReads", (PyObject *)&FileReadsType) < 0 ||
        PyModule_AddObjectRef(m, "CapturedFileIO", (PyObject *)captured_type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
