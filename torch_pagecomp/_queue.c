/* torch_pagecomp._queue: a short list of CUDA driver calls queued by one Python call.

A compressed slice of the activation store queues the same few calls every time: stream
waits, two kernel launches, event records, copies to page-locked memory. Queued one by one
from Python (torch's events and streams, Triton's launcher) they cost the hooks' host about
100 us a slice inside a training step; the calls themselves are a few microseconds each
(bench/results/h200_session63, bench/dev_native_slice.py). Here the list is one call.

The driver is taken with dlopen (no CUDA headers or libraries are needed to build this), as
offload/_copies.py takes its copies. Everything is by raw handle: streams, events and
CUfunctions are what torch and Triton made (torch.cuda.Stream.cuda_stream,
torch.cuda.Event.cuda_event, a compiled kernel's function); this file owns none of them.

queue(device, ops): ops is a tuple of tuples, each one of
    (0, stream, event)                                 cuStreamWaitEvent
    (1, stream, event)                                 cuEventRecord
    (2, stream, function, grid, threads, shared, sizes, values)
                                                       cuLaunchKernel, grid (x, 1, 1);
                                                       sizes: bytes, each parameter's size (4
                                                       or 8); values: a tuple of ints
    (3, stream, host address, device address, bytes)   cuMemcpyDtoHAsync
in order. Raises RuntimeError naming the first call that failed and its CUresult (the calls
before it stay queued). device: the CUDA ordinal whose primary context is made current on a
thread that has none (as Triton's launcher does).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>

#define MAX_PARAMS 32

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*record_fn)(void *, void *);
typedef int (*wait_fn)(void *, void *, unsigned);
typedef int (*dtoh_fn)(void *, uint64_t, size_t, void *);
typedef int (*ctx_get_fn)(void **);
typedef int (*ctx_set_fn)(void *);
typedef int (*retain_fn)(void **, int);

static launch_fn cu_launch;
static record_fn cu_record;
static wait_fn cu_wait;
static dtoh_fn cu_dtoh;
static ctx_get_fn cu_ctx_get;
static ctx_set_fn cu_ctx_set;
static retain_fn cu_retain;
static int loaded; /* 0: not tried, 1: usable, -1: not available */

static int load(void) {
    if (loaded)
        return loaded > 0;
    loaded = -1;
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return 0;
    cu_launch = (launch_fn)dlsym(h, "cuLaunchKernel");
    cu_record = (record_fn)dlsym(h, "cuEventRecord");
    cu_wait = (wait_fn)dlsym(h, "cuStreamWaitEvent");
    cu_dtoh = (dtoh_fn)dlsym(h, "cuMemcpyDtoHAsync_v2");
    cu_ctx_get = (ctx_get_fn)dlsym(h, "cuCtxGetCurrent");
    cu_ctx_set = (ctx_set_fn)dlsym(h, "cuCtxSetCurrent");
    cu_retain = (retain_fn)dlsym(h, "cuDevicePrimaryCtxRetain");
    if (cu_launch && cu_record && cu_wait && cu_dtoh && cu_ctx_get && cu_ctx_set && cu_retain)
        loaded = 1;
    return loaded > 0;
}

static PyObject *available(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(load());
}

/* an int handle or address (None: 0); -1 and an exception set on failure */
static int as_u64(PyObject *o, uint64_t *out) {
    if (o == Py_None) {
        *out = 0;
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)v;
    return 0;
}

static int failed(Py_ssize_t i, const char *call, int rc) {
    PyErr_Format(PyExc_RuntimeError, "torch_pagecomp._queue: %s (op %zd) failed: CUresult %d",
                 call, i, rc);
    return -1;
}

static int run_launch(Py_ssize_t i, PyObject *op, void *stream) {
    /* (2, stream, function, grid, threads, shared, sizes, values) */
    uint64_t fn, grid, threads, shared;
    if (PyTuple_GET_SIZE(op) != 8 || as_u64(PyTuple_GET_ITEM(op, 2), &fn) ||
        as_u64(PyTuple_GET_ITEM(op, 3), &grid) || as_u64(PyTuple_GET_ITEM(op, 4), &threads) ||
        as_u64(PyTuple_GET_ITEM(op, 5), &shared)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "torch_pagecomp._queue: launch op %zd malformed", i);
        return -1;
    }
    PyObject *sizes = PyTuple_GET_ITEM(op, 6), *values = PyTuple_GET_ITEM(op, 7);
    if (!PyBytes_Check(sizes) || !PyTuple_Check(values) ||
        PyBytes_GET_SIZE(sizes) != PyTuple_GET_SIZE(values) ||
        PyTuple_GET_SIZE(values) > MAX_PARAMS || !fn) {
        PyErr_Format(PyExc_ValueError, "torch_pagecomp._queue: launch op %zd: sizes must be "
                     "bytes as long as values (at most %d), function not 0", i, MAX_PARAMS);
        return -1;
    }
    uint64_t slot[MAX_PARAMS];
    void *params[MAX_PARAMS];
    const unsigned char *size = (const unsigned char *)PyBytes_AS_STRING(sizes);
    Py_ssize_t n = PyTuple_GET_SIZE(values);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (as_u64(PyTuple_GET_ITEM(values, k), &slot[k]))
            return -1;
        if (size[k] == 4)
            slot[k] &= 0xffffffffu; /* read from the slot's low half: little-endian hosts */
        else if (size[k] != 8) {
            PyErr_Format(PyExc_ValueError, "torch_pagecomp._queue: launch op %zd: parameter "
                         "%zd of %d bytes (4 or 8 taken)", i, k, (int)size[k]);
            return -1;
        }
        params[k] = &slot[k];
    }
    int rc = cu_launch((void *)(uintptr_t)fn, (unsigned)grid, 1, 1, (unsigned)threads, 1, 1,
                       (unsigned)shared, stream, params, NULL);
    return rc ? failed(i, "cuLaunchKernel", rc) : 0;
}

static int current_context(int device) {
    void *ctx = NULL;
    int rc = cu_ctx_get(&ctx);
    if (rc)
        return failed(-1, "cuCtxGetCurrent", rc);
    if (ctx)
        return 0;
    if ((rc = cu_retain(&ctx, device)))
        return failed(-1, "cuDevicePrimaryCtxRetain", rc);
    if ((rc = cu_ctx_set(ctx)))
        return failed(-1, "cuCtxSetCurrent", rc);
    return 0;
}

static PyObject *queue(PyObject *self, PyObject *args) {
    (void)self;
    int device;
    PyObject *ops;
    if (!PyArg_ParseTuple(args, "iO!", &device, &PyTuple_Type, &ops))
        return NULL;
    if (!load()) {
        PyErr_SetString(PyExc_RuntimeError, "torch_pagecomp._queue: libcuda.so.1 not usable");
        return NULL;
    }
    if (current_context(device))
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(ops);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *op = PyTuple_GET_ITEM(ops, i);
        uint64_t kind, stream, a, b, c;
        if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) < 3 ||
            as_u64(PyTuple_GET_ITEM(op, 0), &kind) || as_u64(PyTuple_GET_ITEM(op, 1), &stream)) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "torch_pagecomp._queue: op %zd malformed", i);
            return NULL;
        }
        void *s = (void *)(uintptr_t)stream;
        int rc;
        switch (kind) {
        case 0:
        case 1:
            if (PyTuple_GET_SIZE(op) != 3 || as_u64(PyTuple_GET_ITEM(op, 2), &a) || !a) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "torch_pagecomp._queue: op %zd: an event "
                                 "(not 0) after the stream", i);
                return NULL;
            }
            rc = kind == 0 ? cu_wait(s, (void *)(uintptr_t)a, 0)
                           : cu_record((void *)(uintptr_t)a, s);
            if (rc && failed(i, kind == 0 ? "cuStreamWaitEvent" : "cuEventRecord", rc))
                return NULL;
            break;
        case 2:
            if (run_launch(i, op, s))
                return NULL;
            break;
        case 3:
            if (PyTuple_GET_SIZE(op) != 5 || as_u64(PyTuple_GET_ITEM(op, 2), &a) ||
                as_u64(PyTuple_GET_ITEM(op, 3), &b) || as_u64(PyTuple_GET_ITEM(op, 4), &c)) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "torch_pagecomp._queue: copy op %zd "
                                 "malformed", i);
                return NULL;
            }
            if (c && (rc = cu_dtoh((void *)(uintptr_t)a, b, (size_t)c, s)) &&
                failed(i, "cuMemcpyDtoHAsync", rc))
                return NULL;
            break;
        default:
            PyErr_Format(PyExc_ValueError, "torch_pagecomp._queue: op %zd of unknown kind %llu",
                         i, (unsigned long long)kind);
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"available", available, METH_NOARGS,
     "available() -> bool: whether libcuda.so.1 and the calls queue() makes were found."},
    {"queue", queue, METH_VARARGS,
     "queue(device, ops) -> None: queue the driver calls ops (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_queue",
    "CUDA driver calls queued by one Python call (the activation store's hot path).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__queue(void) { return PyModule_Create(&module); }
