/* The open() that read capture installs, its refusals settled in C.

   Every open() of a process that captures goes through the hook, and most are left to the original:
   the interpreter's and its packages' files, kernel pseudo-files, every open while the process's reads
   have no source. A hook written in Python costs about 100 ns an open however little it does; this one
   costs what any C callable does, and its tests touch little memory, since an open's system calls leave
   the caches cold (each line missed costs tens of nanoseconds).
   `OpenHook(original, capturing, context, skipped_folders)` calls `original` (io.open) for

     - an open while `context.source` is None (the process's reads have no source): read from the
       slot itself, not looked up by name,
     - a path (a str) that starts with one of `skipped_folders`: compared with the folders' bytes laid
       back to back in the hook (a Latin-1 path; any other through `str.startswith`'s own C),

   and `capturing` (capture.capturing_open, which decides the rest and tests these again) for every other
   open, with the arguments as given. The rules are capture.capturing_open's; tests hold the two alike. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

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
        original = under_folders(self, args[0]);
        if (original < 0) {
            PyErr_Clear();  /* never into the reader: capture's own tests decide */
            original = 0;
        }
    }
    return PyObject_Vectorcall(original ? self->original : self->capturing, args, nargsf, kwnames);
}

/* The offset of the `source` slot of `context`'s type (a __slots__ member), or -1 with an error set. */
static Py_ssize_t
source_slot(PyObject *context)
{
    PyObject *member = PyObject_GetAttrString((PyObject *)Py_TYPE(context), "source");
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
        PyErr_SetString(PyExc_TypeError, "OpenHook: the context's `source` must be a __slots__ member");
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
    Py_ssize_t source_offset = source_slot(context);
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
    .tp_name = "stallwatch.client._openhook.OpenHook",
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

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "stallwatch.client._openhook",
    .m_doc = PyDoc_STR("Read capture's open(), its refusals settled in C (capture.py falls back to Python)."),
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__openhook(void)
{
    if (PyType_Ready(&OpenHookType) < 0) {
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
