/* The CPU path's LZ4 page loops in C (torch_pagecomp._native): a decoder, and a loop that
 * compresses pages with liblz4's own compressor.
 *
 * The same rules and statuses as torch_pagecomp.cpu_codec.decode_block (the reference) and the
 * Triton decoder: a match offset of 0 or one reaching before the page is BAD_OFFSET, literals or a
 * match past the page OVERFLOW, a block ending inside a sequence TRUNCATED, one decoding to fewer
 * bytes than the page SHORT. Every read stays inside the page's block, every write inside its
 * output row, and every step consumes input.
 *
 * Why C: python-lz4 takes one 4 KiB block per call, holding the GIL for the call's arguments and
 * its result, so the CPU codec's threads convoyed on it (slower with every thread added); and
 * its decoder lets a match offset of 0 through (so the Python path walks such pages again). Here
 * a whole range of pages is done with the GIL released, so the threads run in parallel.
 * Optional: without a C compiler the package falls back to python-lz4 page by page. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum {
    STATUS_OK = 0,
    STATUS_BAD_SIZE = 2,
    STATUS_TRUNCATED = 3,
    STATUS_BAD_OFFSET = 4,
    STATUS_OVERFLOW = 5,
    STATUS_SHORT = 6,
};

/* A length's extension bytes (255 means more follow) added to *len; 0 if the block ends first. */
static int add_length(const uint8_t *src, int64_t *ip, int64_t end, int64_t *len) {
    unsigned b;
    do {
        if (*ip >= end) return 0;
        b = src[(*ip)++];
        *len += b;
    } while (b == 255);
    return 1;
}

/* One LZ4 block -> exactly `page` bytes at `dst`; the status. */
static int32_t decode_block(const uint8_t *src, int64_t end, uint8_t *dst, int64_t page) {
    int64_t ip = 0, op = 0;
    for (;;) {
        if (ip >= end) return STATUS_TRUNCATED;
        const unsigned token = src[ip++];
        int64_t lit = token >> 4;
        if (lit == 15 && !add_length(src, &ip, end, &lit)) return STATUS_TRUNCATED;
        if (lit > end - ip) return STATUS_TRUNCATED;
        if (lit > page - op) return STATUS_OVERFLOW;
        if (lit <= 16 && end - ip >= 16 && page - op >= 16) {
            /* a fixed 16-byte copy: the bytes past `lit` are inside this row and the block,
             * and are written again by the sequences after (nothing reads them before) */
            memcpy(dst + op, src + ip, 16);
        } else {
            memcpy(dst + op, src + ip, (size_t)lit);
        }
        ip += lit;
        op += lit;
        if (ip == end) break; /* the last sequence holds literals only */
        if (end - ip < 2) return STATUS_TRUNCATED;
        const int64_t offset = (int64_t)src[ip] | ((int64_t)src[ip + 1] << 8);
        ip += 2;
        if (offset == 0 || offset > op) return STATUS_BAD_OFFSET;
        int64_t mlen = (int64_t)(token & 15) + 4;
        if ((token & 15) == 15 && !add_length(src, &ip, end, &mlen)) return STATUS_TRUNCATED;
        if (mlen > page - op) return STATUS_OVERFLOW;
        const uint8_t *from = dst + op - offset;
        if (offset >= 16 && page - op >= ((mlen + 15) & ~(int64_t)15)) {
            /* 16-byte steps that never overlap their source; the last may write past the
             * match, inside this row (rewritten later, as above) */
            for (int64_t k = 0; k < mlen; k += 16) memcpy(dst + op + k, from + k, 16);
        } else if (offset >= mlen) {
            memcpy(dst + op, from, (size_t)mlen);
        } else { /* overlapping: byte by byte repeats the pattern */
            for (int64_t k = 0; k < mlen; k++) dst[op + k] = from[k];
        }
        op += mlen;
    }
    return op == page ? STATUS_OK : STATUS_SHORT;
}

static int check(Py_buffer *b, Py_ssize_t itemsize, Py_ssize_t count, const char *name) {
    if (b->len < itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd", name, b->len,
                     itemsize * count);
        return 0;
    }
    return 1;
}

/* Whether every entry of `rows` (int64) is a page of the batch (0..n-1); else an IndexError,
 * before the loop writes anything. */
static int rows_in_batch(Py_buffer *rows, Py_ssize_t n) {
    const int64_t *row = rows->buf;
    for (Py_ssize_t k = 0; k < rows->len / 8; k++) {
        if (row[k] < 0 || row[k] >= n) {
            PyErr_SetString(PyExc_IndexError, "rows: a page index outside the batch");
            return 0;
        }
    }
    return 1;
}

PyDoc_STRVAR(decode_pages_doc,
"decode_pages(payload, offsets, sizes, kinds, rows, out, status, page_size)\n\n"
"Decode the pages ``rows`` (int64 [R]) of a batch, with the GIL released: page i's stored\n"
"bytes are payload[offsets[i]:offsets[i] + sizes[i]] (uint8; int64 [N] offsets and sizes),\n"
"its kind's codec is kinds[i] & 15 (uint8 [N]: RAW 0, LZ4 1, FILL 2), its bytes go to\n"
"out[i * page_size:(i + 1) * page_size] (uint8 [N * page_size]) and its status to status[i]\n"
"(int32 [N]). The caller has checked kinds and sizes (cpu_codec._page_checks); a page whose\n"
"bytes lie outside the payload, or a RAW / FILL page of another size, is BAD_SIZE all the\n"
"same. Rows of failed pages hold partial bytes: the caller zeroes them. Bit-shuffled pages\n"
"come out shuffled.");

static PyObject *decode_pages(PyObject *self, PyObject *args) {
    Py_buffer payload, offsets, sizes, kinds, rows, out, status;
    Py_ssize_t page;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*w*n", &payload, &offsets, &sizes, &kinds, &rows,
                          &out, &status, &page))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = status.len / 4, r = rows.len / 8;
    if (page <= 0) {
        PyErr_SetString(PyExc_ValueError, "page_size must be positive");
    } else if (check(&offsets, 8, n, "offsets") && check(&sizes, 8, n, "sizes") &&
               check(&kinds, 1, n, "kinds") && check(&out, page, n, "out") &&
               rows_in_batch(&rows, n)) {
        const uint8_t *src = payload.buf, *kind = kinds.buf;
        const int64_t *off = offsets.buf, *size = sizes.buf, *row = rows.buf;
        uint8_t *dst = out.buf;
        int32_t *st = status.buf;
        const int64_t total = payload.len;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < r; k++) {
            const int64_t i = row[k];
            const int codec = kind[i] & 15;
            uint8_t *to = dst + i * (int64_t)page;
            if (off[i] < 0 || size[i] < 1 || size[i] > total - off[i] ||
                (codec == 0 && size[i] != page) || (codec == 2 && size[i] != 1) || codec > 2) {
                st[i] = STATUS_BAD_SIZE;
            } else if (codec == 0) { /* RAW */
                memcpy(to, src + off[i], (size_t)page);
                st[i] = STATUS_OK;
            } else if (codec == 2) { /* FILL */
                memset(to, src[off[i]], (size_t)page);
                st[i] = STATUS_OK;
            } else {
                st[i] = decode_block(src + off[i], size[i], to, page);
            }
        }
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&payload);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&kinds);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    PyBuffer_Release(&status);
    return result;
}

/* liblz4's streaming calls, as python-lz4 makes them for lz4.block.compress (a reset stream, then
 * one compress_fast_continue at acceleration 1): the same blocks, not LZ4_compress_default's,
 * which hashes small inputs differently. */
typedef void (*lz4_reset_fn)(void *stream);
typedef int (*lz4_continue_fn)(void *stream, const char *src, char *dst, int src_size,
                               int dst_capacity, int acceleration);
typedef int (*lz4_sizeof_fn)(void);

PyDoc_STRVAR(compress_lz4_doc,
"compress_lz4(pages, rows, out, sizes, page_size, limit, liblz4)\n\n"
"Compress the pages ``rows`` (int64 [R]) of pages (uint8 [N * page_size]), with the GIL\n"
"released, through the liblz4 that python-lz4 carries: ``liblz4`` is the addresses of its\n"
"(LZ4_resetStream, LZ4_compress_fast_continue, LZ4_sizeofState), called as\n"
"lz4.block.compress calls them, so the blocks are its blocks. A block of at most ``limit``\n"
"bytes goes to out[i * page_size:] (uint8 [N * page_size]), the rest of the row zeroed, and\n"
"its size to sizes[i] (int32 [N]); a larger one is not written and sizes[i] = page_size\n"
"(stored RAW: the caller copies the page).");

static PyObject *compress_lz4(PyObject *self, PyObject *args) {
    Py_buffer pages, rows, out, sizes;
    Py_ssize_t page, limit;
    unsigned long long reset_addr, continue_addr, sizeof_addr;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*w*nn(KKK)", &pages, &rows, &out, &sizes, &page, &limit,
                          &reset_addr, &continue_addr, &sizeof_addr))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = sizes.len / 4, r = rows.len / 8;
    if (page <= 0 || page > (1 << 24) || limit < 1 || limit > page || !reset_addr ||
        !continue_addr || !sizeof_addr) {
        PyErr_SetString(PyExc_ValueError, "page_size, limit or the liblz4 calls are invalid");
    } else if (check(&pages, page, n, "pages") && check(&out, page, n, "out") &&
               rows_in_batch(&rows, n)) {
        const lz4_reset_fn reset = (lz4_reset_fn)(uintptr_t)reset_addr;
        const lz4_continue_fn compress = (lz4_continue_fn)(uintptr_t)continue_addr;
        const int state_size = ((lz4_sizeof_fn)(uintptr_t)sizeof_addr)();
        const int bound = (int)page + (int)page / 255 + 16; /* LZ4_COMPRESSBOUND */
        /* the block, then the stream state (8-byte aligned, as liblz4 needs) */
        const size_t at = ((size_t)bound + 15) & ~(size_t)15;
        char *tmp = PyMem_RawMalloc(at + (size_t)state_size);
        const int64_t *row = rows.buf;
        const char *src = pages.buf;
        char *dst = out.buf;
        int32_t *size = sizes.buf;
        if (tmp == NULL) {
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t k = 0; k < r; k++) {
                const int64_t i = row[k];
                /* into a buffer of the bound, as lz4.block.compress does, then kept if it fits */
                reset(tmp + at);
                const int got = compress(tmp + at, src + i * (int64_t)page, tmp, (int)page,
                                         bound, 1);
                if (got > 0 && got <= limit) {
                    memcpy(dst + i * (int64_t)page, tmp, (size_t)got);
                    memset(dst + i * (int64_t)page + got, 0, (size_t)(page - got));
                    size[i] = got;
                } else {
                    size[i] = (int32_t)page;
                }
            }
            Py_END_ALLOW_THREADS
            PyMem_RawFree(tmp);
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&pages);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    PyBuffer_Release(&sizes);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_pages", decode_pages, METH_VARARGS, decode_pages_doc},
    {"compress_lz4", compress_lz4, METH_VARARGS, compress_lz4_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "The CPU path's LZ4 page loops in C (see torch_pagecomp.cpu_codec).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
