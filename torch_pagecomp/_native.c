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
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define HAVE_THREADS 1
#else
#define HAVE_THREADS 0
#endif

enum {
    STATUS_OK = 0,
    STATUS_BAD_KIND = 1,
    STATUS_BAD_SIZE = 2,
    STATUS_TRUNCATED = 3,
    STATUS_BAD_OFFSET = 4,
    STATUS_OVERFLOW = 5,
    STATUS_SHORT = 6,
};
enum { KIND_RAW = 0, KIND_LZ4 = 1, KIND_FILL = 2, KIND_EXP = 3 }; /* a kind byte's low nibble */

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
        } else { /* overlapping: the match repeats its first `offset` bytes, so byte k of it
                  * equals byte k % step for any multiple `step` of the offset. With step >= 16,
                  * the first step + 16 bytes written (one by one where they overlap their
                  * source), every later 16 bytes are a copy from inside them: never overlapping,
                  * and read from bytes stored long before (a load that partly overlaps a store
                  * still in flight waits for it). Byte by byte took 2-3 cycles a byte on pages
                  * repeating a short pattern, slower than any other page. */
            int64_t step = offset, k;
            while (step < 16) step += offset;
            const int64_t head = mlen < step + 16 ? mlen : step + 16;
            if (offset >= 16) { /* step == offset: neither part overlaps its source */
                memcpy(dst + op, from, (size_t)offset);
                memcpy(dst + op + offset, dst + op, (size_t)(head - offset));
            } else {
                for (k = 0; k < head; k++) dst[op + k] = from[k];
            }
            int64_t r = head % step;
            for (k = head; k + 16 <= mlen; k += 16) {
                memcpy(dst + op + k, dst + op + r, 16);
                r += 16;
                if (r >= step) r -= step;
            }
            if (k < mlen) memcpy(dst + op + k, dst + op + r, (size_t)(mlen - k));
        }
        op += mlen;
    }
    return op == page ? STATUS_OK : STATUS_SHORT;
}

/* ---------------------------------------------------------------------- bit-shuffle
 * The format's bit-shuffle (torch_pagecomp.format, shuffle.bitshuffle_np): a page of n = P / E
 * elements of E bytes becomes 8E bit planes of n / 8 bytes, plane 8j + i holding bit i of byte j
 * of every element, element 8g + t at bit t of the plane's byte g. Per block of 64 elements and
 * byte j the 8 planes' bytes 8b .. 8b + 7 are a 64 x 8 bit transpose of byte j of the 64
 * elements: an 8 x 8 byte transpose (SSE2 unpacks) and an 8 x 8 bit transpose of each 64-bit
 * lane (three butterfly steps), both their own inverse, so the unshuffle runs the same steps in
 * the other order. SSE2 only (every x86-64); elsewhere the module has no bitshuffle and numpy
 * does it. */
#if defined(__SSE2__)
#include <emmintrin.h>
#include <tmmintrin.h> /* SSSE3, used only where the CPU has it (exp_lookup) */
#define HAVE_SHUFFLE 1

/* One butterfly step: in each 64-bit lane, the bits of `mask` and those `d` above them swap. */
static inline __m128i swap_bits(__m128i x, int d, long long mask) {
    const __m128i t = _mm_and_si128(_mm_xor_si128(x, _mm_srli_epi64(x, d)), _mm_set1_epi64x(mask));
    return _mm_xor_si128(_mm_xor_si128(x, t), _mm_slli_epi64(t, d));
}

/* In each 64-bit lane: bit c of byte r <-> bit r of byte c. */
static inline __m128i transpose_bits(__m128i x) {
    x = swap_bits(x, 7, 0x00AA00AA00AA00AAll);
    x = swap_bits(x, 14, 0x0000CCCC0000CCCCll);
    return swap_bits(x, 28, 0x00000000F0F0F0F0ll);
}

/* r[k]: row k in the low 8 bytes (k = 0..7) -> o[m]: columns 2m and 2m + 1 (column c: byte c of
 * every row, row k at byte k). */
static inline void transpose_bytes(const __m128i r[8], __m128i o[4]) {
    const __m128i s0 = _mm_unpacklo_epi8(r[0], r[1]), s1 = _mm_unpacklo_epi8(r[2], r[3]);
    const __m128i s2 = _mm_unpacklo_epi8(r[4], r[5]), s3 = _mm_unpacklo_epi8(r[6], r[7]);
    const __m128i t0 = _mm_unpacklo_epi16(s0, s1), t1 = _mm_unpackhi_epi16(s0, s1);
    const __m128i t2 = _mm_unpacklo_epi16(s2, s3), t3 = _mm_unpackhi_epi16(s2, s3);
    o[0] = _mm_unpacklo_epi32(t0, t2);
    o[1] = _mm_unpackhi_epi32(t0, t2);
    o[2] = _mm_unpacklo_epi32(t1, t3);
    o[3] = _mm_unpackhi_epi32(t1, t3);
}

/* Byte j of the 64 elements at `src` (E bytes each) -> x[k]: elements 16k .. 16k + 15. */
static inline void gather_byte(const uint8_t *src, int e, int j, __m128i x[4]) {
    const __m128i lo = _mm_set1_epi16(0xFF), lo32 = _mm_set1_epi32(0xFF);
    for (int k = 0; k < 4; k++) {
        const __m128i *v = (const __m128i *)(src + 16 * e * k);
        if (e == 2) {
            __m128i a = _mm_loadu_si128(v), b = _mm_loadu_si128(v + 1);
            if (j) { a = _mm_srli_epi16(a, 8); b = _mm_srli_epi16(b, 8); }
            x[k] = _mm_packus_epi16(_mm_and_si128(a, lo), _mm_and_si128(b, lo));
        } else { /* e == 4 */
            const __m128i shift = _mm_cvtsi32_si128(8 * j);
            __m128i t[4];
            for (int m = 0; m < 4; m++)
                t[m] = _mm_and_si128(_mm_srl_epi32(_mm_loadu_si128(v + m), shift), lo32);
            x[k] = _mm_packus_epi16(_mm_packs_epi32(t[0], t[1]), _mm_packs_epi32(t[2], t[3]));
        }
    }
}

/* x[j][k] (byte j of elements 16k .. 16k + 15) -> the 64 elements at `dst`. */
static inline void scatter_bytes(__m128i x[4][4], int e, uint8_t *dst) {
    for (int k = 0; k < 4; k++) {
        __m128i *v = (__m128i *)(dst + 16 * e * k);
        if (e == 2) {
            _mm_storeu_si128(v, _mm_unpacklo_epi8(x[0][k], x[1][k]));
            _mm_storeu_si128(v + 1, _mm_unpackhi_epi8(x[0][k], x[1][k]));
        } else {
            const __m128i a = _mm_unpacklo_epi8(x[0][k], x[1][k]);
            const __m128i b = _mm_unpacklo_epi8(x[2][k], x[3][k]);
            const __m128i c = _mm_unpackhi_epi8(x[0][k], x[1][k]);
            const __m128i d = _mm_unpackhi_epi8(x[2][k], x[3][k]);
            _mm_storeu_si128(v, _mm_unpacklo_epi16(a, b));
            _mm_storeu_si128(v + 1, _mm_unpackhi_epi16(a, b));
            _mm_storeu_si128(v + 2, _mm_unpacklo_epi16(c, d));
            _mm_storeu_si128(v + 3, _mm_unpackhi_epi16(c, d));
        }
    }
}

static void shuffle_page(const uint8_t *src, uint8_t *dst, int64_t page, int e) {
    const int64_t plane = page / e / 8;
    for (int64_t b = 0; b < page / e / 64; b++) {
        for (int j = 0; j < e; j++) {
            __m128i x[4], r[8], o[4];
            gather_byte(src + 64 * e * b, e, j, x);
            for (int k = 0; k < 4; k++) { /* group 2k, 2k + 1: byte i = bit i of its 8 bytes */
                const __m128i w = transpose_bits(x[k]);
                r[2 * k] = w;
                r[2 * k + 1] = _mm_srli_si128(w, 8);
            }
            transpose_bytes(r, o); /* o[m]: planes 2m, 2m + 1 at bytes 8b .. 8b + 7 */
            for (int m = 0; m < 4; m++) {
                _mm_storel_epi64((__m128i *)(dst + (8 * j + 2 * m) * plane + 8 * b), o[m]);
                _mm_storel_epi64((__m128i *)(dst + (8 * j + 2 * m + 1) * plane + 8 * b),
                                 _mm_srli_si128(o[m], 8));
            }
        }
    }
}

static void unshuffle_page(const uint8_t *src, uint8_t *dst, int64_t page, int e) {
    const int64_t plane = page / e / 8;
    for (int64_t b = 0; b < page / e / 64; b++) {
        __m128i x[4][4];
        for (int j = 0; j < e; j++) {
            __m128i r[8], o[4];
            for (int i = 0; i < 8; i++)
                r[i] = _mm_loadl_epi64((const __m128i *)(src + (8 * j + i) * plane + 8 * b));
            transpose_bytes(r, o); /* o[k]: groups 2k, 2k + 1, byte i from plane 8j + i */
            for (int k = 0; k < 4; k++) x[j][k] = transpose_bits(o[k]);
        }
        scatter_bytes(x, e, dst + 64 * e * b);
    }
}
#endif

/* A buffer argument of `itemsize`-byte elements of kind `kind` ('u' unsigned, 'i' signed),
 * C-contiguous; a clear TypeError otherwise. */
static int get_buffer(PyObject *obj, Py_buffer *b, int writable, Py_ssize_t itemsize, char kind,
                      const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, b, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer (a numpy array) of "
                     "%s%zd", name, writable ? " writable" : "", kind == 'u' ? "uint" : "int",
                     8 * itemsize);
        return 0;
    }
    const char *f = b->format ? b->format : "B";
    while (*f == '@' || *f == '=' || *f == '<' || *f == '|') f++;
    int ok = b->itemsize == itemsize && f[0] && !f[1];
    if (ok) {
        if (kind == 'u') ok = strchr("BHILQN", f[0]) != NULL;
        else ok = strchr("bhilqn", f[0]) != NULL;
    }
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must hold %s%zd, got format '%s' of %zd-byte items",
                     name, kind == 'u' ? "uint" : "int", 8 * itemsize,
                     b->format ? b->format : "B", b->itemsize);
        PyBuffer_Release(b);
        return 0;
    }
    return 1;
}

/* One buffer argument: get_buffer's parameters and where the buffer goes. */
typedef struct {
    PyObject *obj;
    Py_buffer *b;
    int writable;
    Py_ssize_t itemsize;
    char kind;
    const char *name;
} buffer_arg;

static void release_buffers(const buffer_arg *a, int count) {
    while (count-- > 0) PyBuffer_Release(a[count].b);
}

/* get_buffer of every argument of `a` in order; on the first failure the ones already got are
 * released (the error is that argument's). */
static int get_buffers(const buffer_arg *a, int count) {
    for (int i = 0; i < count; i++)
        if (!get_buffer(a[i].obj, a[i].b, a[i].writable, a[i].itemsize, a[i].kind, a[i].name)) {
            release_buffers(a, i);
            return 0;
        }
    return 1;
}

static int check(Py_buffer *b, Py_ssize_t itemsize, Py_ssize_t count, const char *name) {
    if (b->len < itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd", name, b->len,
                     itemsize * count);
        return 0;
    }
    return 1;
}

/* The ranges of pages one call works through. Without a counter: [start, stop), once. With one
 * (an int64 buffer that every thread's call for one batch shares, from 0 up): [start, stop) is
 * cut into `parts` ranges, r-th = start + span * r / parts .. start + span * (r + 1) / parts
 * (cpu_codec._run_ranges' bounds), and the call takes r after r from the counter (an atomic
 * fetch-and-add, with the GIL released) until r reaches `parts`: each thread makes one call per
 * batch and takes ranges as it finishes one, instead of one call, and one return to the GIL,
 * per range (#25). Each range is taken exactly once, by whichever call gets its number. */
typedef struct {
    int64_t *counter; /* NULL: the one range [start, stop) */
    Py_ssize_t start, stop, parts;
    int done;
} ranges_t;

/* Parse the optional (counter, parts) arguments (counter None: no counter). `b` holds the
 * counter's buffer (released by release_ranges) when one is given. */
static int get_ranges(PyObject *o_counter, Py_ssize_t parts, Py_ssize_t start, Py_ssize_t stop,
                      Py_buffer *b, ranges_t *g, const char *fn) {
    g->counter = NULL;
    g->start = start;
    g->stop = stop;
    g->parts = 1;
    g->done = 0;
    b->obj = NULL;
    if (o_counter == NULL || o_counter == Py_None) return 1;
    if (!get_buffer(o_counter, b, 1, 8, 'i', "counter")) return 0;
    if (b->len < 8 || ((uintptr_t)b->buf & 7) || parts < 1 || parts > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: counter must be an aligned int64 [>= 1] and parts "
                     "in 1..2**31 - 1, got %zd bytes and %zd parts", fn, b->len, parts);
        PyBuffer_Release(b);
        b->obj = NULL;
        return 0;
    }
    g->counter = b->buf;
    g->parts = parts;
    return 1;
}

static void release_ranges(Py_buffer *b) {
    if (b->obj != NULL) PyBuffer_Release(b);
}

/* get_buffers of `a`, then get_ranges over [start, stop), or over every page `sizes` (an
 * int32 buffer among `a`, got first) holds where `sizes` is given; on a failure nothing stays
 * held. */
static int get_args(const buffer_arg *a, int count, PyObject *o_counter, Py_ssize_t parts,
                    Py_ssize_t start, Py_ssize_t stop, const Py_buffer *sizes, Py_buffer *b,
                    ranges_t *g, const char *fn) {
    if (!get_buffers(a, count)) return 0;
    if (!get_ranges(o_counter, parts, start, sizes != NULL ? sizes->len / 4 : stop, b, g, fn)) {
        release_buffers(a, count);
        return 0;
    }
    return 1;
}

/* The next range [*lo, *hi) of this call, or 0 when none is left. */
static int next_range(ranges_t *g, Py_ssize_t *lo, Py_ssize_t *hi) {
    if (g->counter == NULL) {
        if (g->done) return 0;
        g->done = 1;
        *lo = g->start;
        *hi = g->stop;
        return 1;
    }
    const int64_t r = __atomic_fetch_add(g->counter, 1, __ATOMIC_RELAXED);
    if (r < 0 || r >= g->parts) return 0;
    /* span * r / parts without the product: r * rem < parts**2 < 2**62 */
    const int64_t span = g->stop - g->start, q = span / g->parts, rem = span % g->parts;
    *lo = g->start + (Py_ssize_t)(r * q + r * rem / g->parts);
    *hi = g->start + (Py_ssize_t)((r + 1) * q + (r + 1) * rem / g->parts);
    return 1;
}

/* ------------------------------------------------------------------ threads of one call
 * A batch's page loop on `threads` threads: the caller's, and threads - 1 started here and
 * joined before the call returns, all sharing the batch's range counter (next_range). The
 * Python threads this replaces each had to take the GIL to enter their C call and again to
 * leave it, one after the other: on a 16-core host the last of 8 threads entered its loop
 * 440-470 us after the call began and the threads left it over another 370-430 us, 10-15% of a
 * 64 MiB call (bench/results/h200_a1601c8_session29). No thread outlives the call, so nothing
 * is left to stop at interpreter exit or to lose in a forked child. A thread that cannot start
 * (or cannot get its working memory) leaves its ranges to the others; the call fails with
 * MemoryError only when no thread could work (ranges_done). */
enum { MAX_THREADS = 256 };

typedef struct {
    void (*body)(void *ctx);
    void *ctx;
} loop_t;

#if HAVE_THREADS
static void *loop_thread(void *arg) {
    const loop_t *l = arg;
    l->body(l->ctx);
    return NULL;
}
#endif

/* body(ctx) on the calling thread and on threads - 1 more (GIL released by the caller). */
static void run_loop(void (*body)(void *), void *ctx, Py_ssize_t threads) {
#if HAVE_THREADS
    pthread_t ids[MAX_THREADS];
    loop_t l = {body, ctx};
    Py_ssize_t started = 0;
    while (started + 1 < threads && pthread_create(&ids[started], NULL, loop_thread, &l) == 0)
        started++;
    body(ctx);
    for (Py_ssize_t k = 0; k < started; k++) pthread_join(ids[k], NULL);
#else
    (void)threads;
    body(ctx);
#endif
}

/* Whether every range was taken: a thread leaves its loop only after drawing a number past the
 * last range, so the counter is below `parts` only if no thread ran its loop. */
static int ranges_done(const ranges_t *g) {
    if (g->counter == NULL) return g->done;
    return __atomic_load_n(g->counter, __ATOMIC_RELAXED) >= g->parts;
}

/* The optional `threads` argument: 1..MAX_THREADS, and more than 1 only with a counter. */
static int check_threads(Py_ssize_t threads, const ranges_t *g, const char *fn) {
    if (threads < 1 || threads > MAX_THREADS || (threads > 1 && g->counter == NULL)) {
        PyErr_Format(PyExc_ValueError, "%s: threads must be in 1..%d (more than 1 only with a "
                     "counter), got %zd", fn, MAX_THREADS, threads);
        return 0;
    }
    return 1;
}

/* The size rules both decoders share: [o, o + s) non-empty and inside the payload (o >= 0 and
 * s <= total - o first: o + s cannot overflow), a RAW page `page` bytes, a FILL page 1. */
static int plain_size_bad(int codec, int64_t o, int64_t s, int64_t total, int64_t page) {
    return o < 0 || s < 1 || s > total - o || (codec == KIND_RAW && s != page) ||
           (codec == KIND_FILL && s != 1);
}

/* The status that page i's metadata alone gives it (BAD_KIND, BAD_SIZE), else OK: the rules of
 * cpu_codec._page_checks (the python-lz4 path runs those on the whole batch), page by page here
 * so that a threaded decode does no serial pass over the batch before its threads start. `off`
 * holds N offsets, or N + 1 when `packed` (page i is then off[i] .. off[i + 1], and off[0] is
 * 0). */
static int32_t check_page(const int64_t *off, const int32_t *size, const uint8_t *kind,
                          Py_ssize_t i, int packed, int64_t total, int64_t page) {
    const int codec = kind[i] & 15, shift = kind[i] >> 4;
    if (codec > KIND_FILL || shift > 2 || (shift && codec != KIND_LZ4))
        return STATUS_BAD_KIND; /* no other kind reaches the unshuffle */
    const int64_t o = off[i], s = size[i];
    if (plain_size_bad(codec, o, s, total, page) ||
        (codec == KIND_LZ4 && s > page + page / 255 + 16)) /* format.lz4_bound */
        return STATUS_BAD_SIZE;
    if (packed && (off[i + 1] != o + s || (i == 0 && o != 0))) return STATUS_BAD_SIZE;
    return STATUS_OK;
}

PyDoc_STRVAR(decode_pages_doc,
"decode_pages(payload, offsets, sizes, kinds, out, status, page_size, start, stop,\n"
"             counter=None, parts=1, threads=1)\n\n"
"Decode pages start .. stop - 1 of a batch of N = len(sizes) pages, with the GIL released;\n"
"with a counter (int64 [>= 1], shared by every thread's call for the batch, 0 at first),\n"
"start .. stop - 1 cut into `parts` ranges, each taken by the call that draws its number from\n"
"the counter (an atomic fetch-and-add), until none is left (see next_range); with threads > 1\n"
"(a counter needed), threads - 1 threads started for the call take ranges beside the caller\n"
"and are joined before it returns (see run_loop).\n"
"The arguments are the whole batch's (C-contiguous): payload uint8 [T]; offsets int64 [N], or\n"
"[N + 1] for a packed container (page i is then payload[offsets[i]:offsets[i + 1]], which\n"
"must be sizes[i] bytes, and offsets[0] must be 0); sizes int32 [N]; kinds uint8 [N] (codec\n"
"kinds[i] & 15, RAW 0, LZ4 1, FILL 2; bit-shuffle shift kinds[i] >> 4); out uint8\n"
"[N * page_size], page i's bytes at out[i * page_size:(i + 1) * page_size]; status int32 [N].\n"
"Only the range's rows of out and status are written. Each page's status is decided here, as\n"
"cpu_codec._page_checks decides it, then by its block: an unknown kind, or a shift other than\n"
"0..2 or on a page that is not LZ4, is BAD_KIND; bytes outside the payload, a RAW page not of\n"
"page_size bytes, a FILL page not of 1, an LZ4 page over format.lz4_bound(page_size) or\n"
"packed offsets that disagree with the sizes, BAD_SIZE. A failed page's row is zeroed.\n"
"Bit-shuffled LZ4 pages are unshuffled where the module has bitshuffle (SSE2), else they come\n"
"out shuffled.");

/* What each thread of a decode_pages (or exp_decode_pages) call reads and writes: the whole
 * batch's buffers. */
typedef struct {
    const uint8_t *src, *kind;
    const int64_t *off;
    const int32_t *size;
    uint8_t *dst;
    int32_t *st;
    int64_t total, page;
    int packed;
    ranges_t *ranges;
} decode_ctx;

static void decode_body(void *arg) {
    const decode_ctx *c = arg;
    const uint8_t *src = c->src, *kind = c->kind;
    const int64_t *off = c->off;
    const int32_t *size = c->size;
    const int64_t page = c->page;
    /* a page: a bit-shuffled page is decoded here, then unshuffled into its row */
    uint8_t *tmp = PyMem_RawMalloc((size_t)page);
    if (tmp == NULL) return; /* the other threads take the ranges (ranges_done) */
    Py_ssize_t lo, hi;
    while (next_range(c->ranges, &lo, &hi)) /* every page of each range taken */
    for (Py_ssize_t i = lo; i < hi; i++) {
        uint8_t *to = c->dst + i * page;
        int32_t r = check_page(off, size, kind, i, c->packed, c->total, page);
        if (r != STATUS_OK) {
            /* decided by the metadata */
        } else if ((kind[i] & 15) == KIND_RAW) {
            memcpy(to, src + off[i], (size_t)page);
        } else if ((kind[i] & 15) == KIND_FILL) {
            memset(to, src[off[i]], (size_t)page);
        } else {
#if defined(HAVE_SHUFFLE)
            const int e = 1 << (kind[i] >> 4); /* 1, 2 or 4 */
            if (e > 1 && page % (64 * e) == 0) { /* decoded aside, unshuffled into the row */
                r = decode_block(src + off[i], size[i], tmp, page);
                if (r == STATUS_OK) unshuffle_page(tmp, to, page, e);
            } else
#endif
                r = decode_block(src + off[i], size[i], to, page);
        }
        c->st[i] = r;
        if (r != STATUS_OK) memset(to, 0, (size_t)page);
    }
    PyMem_RawFree(tmp);
}

static PyObject *decode_pages(PyObject *self, PyObject *args) {
    PyObject *o_payload, *o_offsets, *o_sizes, *o_kinds, *o_out, *o_status, *o_counter = NULL;
    Py_ssize_t page, start, stop, parts = 1, threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOnnn|Onn", &o_payload, &o_offsets, &o_sizes, &o_kinds,
                          &o_out, &o_status, &page, &start, &stop, &o_counter, &parts, &threads))
        return NULL;
    if (page <= 0 || page > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "decode_pages: page_size must be in 1..2**24");
        return NULL;
    }
    Py_buffer payload, offsets, sizes, kinds, out, status, counter;
    ranges_t ranges;
    PyObject *result = NULL;
    const buffer_arg bufs[] = {
        {o_payload, &payload, 0, 1, 'u', "payload"}, {o_offsets, &offsets, 0, 8, 'i', "offsets"},
        {o_sizes, &sizes, 0, 4, 'i', "sizes"}, {o_kinds, &kinds, 0, 1, 'u', "kinds"},
        {o_out, &out, 1, 1, 'u', "out"}, {o_status, &status, 1, 4, 'i', "status"}};
    const int nbufs = (int)(sizeof bufs / sizeof bufs[0]);
    if (!get_args(bufs, nbufs, o_counter, parts, start, stop, NULL, &counter, &ranges,
                  "decode_pages"))
        return NULL;
    const Py_ssize_t n = sizes.len / 4, n_off = offsets.len / 8;
    if ((n_off != n && n_off != n + 1) || kinds.len != n || out.len != n * page ||
        status.len != 4 * n || start < 0 || start > stop || stop > n) {
        PyErr_Format(PyExc_ValueError, "decode_pages: %zd pages (sizes) of %zd bytes need %zd or "
                     "%zd offsets, %zd kinds, out of %zd bytes, %zd statuses and 0 <= start <= "
                     "stop <= %zd, got %zd, %zd, %zd, %zd and %zd .. %zd", n, page, n, n + 1, n,
                     n * page, n, n, n_off, kinds.len, out.len, status.len / 4, start, stop);
    } else if (check_threads(threads, &ranges, "decode_pages")) {
        decode_ctx c = {payload.buf, kinds.buf, offsets.buf, sizes.buf, out.buf, status.buf,
                        payload.len, page, n_off == n + 1, &ranges};
        Py_BEGIN_ALLOW_THREADS
        run_loop(decode_body, &c, threads);
        Py_END_ALLOW_THREADS
        result = ranges_done(&ranges) ? Py_NewRef(Py_None) : PyErr_NoMemory();
    }
    release_buffers(bufs, nbufs);
    release_ranges(&counter);
    return result;
}

/* liblz4's streaming calls, as python-lz4 makes them for lz4.block.compress (a reset stream, then
 * one compress_fast_continue at acceleration 1): the same blocks, not LZ4_compress_default's,
 * which hashes small inputs differently. */
typedef void (*lz4_reset_fn)(void *stream);
typedef int (*lz4_continue_fn)(void *stream, const char *src, char *dst, int src_size,
                               int dst_capacity, int acceleration);
typedef int (*lz4_sizeof_fn)(void);

/* Whether every byte of the page r[0 .. page) is equal; if so it is stored FILL into `to` (the
 * byte, then zeros), with its size and kind. Both compressors take all-equal pages this way. */
static int store_if_fill(const uint8_t *r, uint8_t *to, int64_t page, int32_t *size,
                         uint8_t *kind) {
    uint64_t first, word = 0;
    memset(&first, r[0], 8);
    for (int64_t k = 0; k < page && word == 0; k += 8) {
        uint64_t w;
        memcpy(&w, r + k, 8);
        word = w ^ first;
    }
    if (word != 0) return 0;
    memset(to, 0, (size_t)page);
    to[0] = r[0];
    *size = 1;
    *kind = KIND_FILL;
    return 1;
}

PyDoc_STRVAR(compress_pages_doc,
"compress_pages(raw, src, out, sizes, kinds, page_size, limit, lz4_kind, shuffle, liblz4,\n"
"               counter=None, parts=1, threads=1)\n\n"
"Compress the N pages of a range (raw: uint8 [N * page_size]; src: the same pages as the LZ4\n"
"compressor reads them, bit-shuffled or raw itself) with the GIL released: a page whose bytes\n"
"are all equal is FILL (size 1, its byte then zeros); else src's page is compressed through\n"
"(shuffle 2 or 4, where the module has bitshuffle: raw's page bit-shuffled here with that\n"
"element size, page by page in a buffer that stays in cache; src is then not read)\n"
"the liblz4 that python-lz4 carries (``liblz4``: the addresses of its LZ4_resetStream,\n"
"LZ4_compress_fast_continue and LZ4_sizeofState, called as lz4.block.compress calls them, so\n"
"the blocks are its blocks) and kept as kind lz4_kind if at most ``limit`` bytes (the rest of\n"
"the row zeroed), else the raw page is stored RAW (size page_size). Writes out (uint8\n"
"[N * page_size]), sizes (int32 [N]) and kinds (uint8 [N]). With a counter (and threads), as\n"
"decode_pages: the N pages cut into `parts` ranges that the calls (and threads) sharing the\n"
"counter take one by one.");

/* What each thread of a compress_pages call reads and writes. */
typedef struct {
    const uint8_t *from;
    const char *src;
    uint8_t *dst, *kind;
    int32_t *size;
    int64_t page, limit;
    int lz4_kind, shuffle;
    lz4_reset_fn reset;
    lz4_continue_fn compress;
    int state_size;
    ranges_t *ranges;
} compress_ctx;

static void compress_body(void *arg) {
    const compress_ctx *c = arg;
    const int64_t page = c->page;
    const int bound = (int)page + (int)page / 255 + 16; /* LZ4_COMPRESSBOUND */
    /* the block, then the stream state (8-byte aligned, as liblz4 needs), then a page */
    const size_t at = ((size_t)bound + 15) & ~(size_t)15;
    const size_t at_page = (at + (size_t)c->state_size + 15) & ~(size_t)15;
    char *tmp = PyMem_RawMalloc(at_page + (size_t)page);
    if (tmp == NULL) return; /* the other threads take the ranges (ranges_done) */
    Py_ssize_t lo, hi;
    while (next_range(c->ranges, &lo, &hi)) /* every page of each range taken */
    for (Py_ssize_t i = lo; i < hi; i++) {
        const uint8_t *r = c->from + i * page;
        uint8_t *to = c->dst + i * page;
        if (store_if_fill(r, to, page, c->size + i, c->kind + i)) continue;
        const char *from_page = c->src + i * page;
#if defined(HAVE_SHUFFLE)
        if (c->shuffle) {
            shuffle_page(r, (uint8_t *)tmp + at_page, page, c->shuffle);
            from_page = tmp + at_page;
        }
#endif
        /* into a buffer of the bound, as lz4.block.compress does, then kept if it fits */
        c->reset(tmp + at);
        const int got = c->compress(tmp + at, from_page, tmp, (int)page, bound, 1);
        if (got > 0 && got <= c->limit) {
            memcpy(to, tmp, (size_t)got);
            memset(to + got, 0, (size_t)(page - got));
            c->size[i] = got;
            c->kind[i] = (uint8_t)c->lz4_kind;
        } else { /* RAW: the page as it is */
            memcpy(to, r, (size_t)page);
            c->size[i] = (int32_t)page;
            c->kind[i] = KIND_RAW;
        }
    }
    PyMem_RawFree(tmp);
}

static PyObject *compress_pages(PyObject *self, PyObject *args) {
    Py_buffer raw, pages, out, sizes, kinds, counter;
    Py_ssize_t page, limit, parts = 1, threads = 1;
    int lz4_kind, shuffle;
    unsigned long long reset_addr, continue_addr, sizeof_addr;
    PyObject *o_counter = NULL;
    ranges_t ranges;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*w*w*nnii(KKK)|Onn", &raw, &pages, &out, &sizes, &kinds,
                          &page, &limit, &lz4_kind, &shuffle, &reset_addr, &continue_addr,
                          &sizeof_addr, &o_counter, &parts, &threads))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = sizes.len / 4;
    if (!get_ranges(o_counter, parts, 0, n, &counter, &ranges, "compress_pages")) goto done;
#if defined(HAVE_SHUFFLE)
    const int shuffle_ok = shuffle == 0 || ((shuffle == 2 || shuffle == 4) &&
                                            page % (64 * shuffle) == 0);
#else
    const int shuffle_ok = shuffle == 0;
#endif
    if (page <= 0 || page > (1 << 24) || page % 8 || limit < 1 || limit > page ||
        lz4_kind < 0 || lz4_kind > 255 || !shuffle_ok || !reset_addr || !continue_addr ||
        !sizeof_addr) {
        PyErr_SetString(PyExc_ValueError, "page_size, limit, lz4_kind, shuffle or the liblz4 "
                        "calls are invalid");
    } else if (check(&raw, page, n, "raw") && check(&pages, page, n, "pages") &&
               check(&out, page, n, "out") && check(&kinds, 1, n, "kinds") &&
               check_threads(threads, &ranges, "compress_pages")) {
        compress_ctx c = {raw.buf, pages.buf, out.buf, kinds.buf, sizes.buf, page, limit,
                          lz4_kind, shuffle, (lz4_reset_fn)(uintptr_t)reset_addr,
                          (lz4_continue_fn)(uintptr_t)continue_addr,
                          ((lz4_sizeof_fn)(uintptr_t)sizeof_addr)(), &ranges};
        Py_BEGIN_ALLOW_THREADS
        run_loop(compress_body, &c, threads);
        Py_END_ALLOW_THREADS
        result = ranges_done(&ranges) ? Py_NewRef(Py_None) : PyErr_NoMemory();
    }
    release_ranges(&counter);
done:
    PyBuffer_Release(&raw);
    PyBuffer_Release(&pages);
    PyBuffer_Release(&out);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&kinds);
    return result;
}

PyDoc_STRVAR(bitshuffle_doc,
"bitshuffle(src, dst, page_size, element_size, inverse)\n\n"
"The format's bit-shuffle of every page of src (uint8 [N * page_size]) into dst (the same\n"
"size; may be src itself), or its inverse, with the GIL released. element_size 2 or 4;\n"
"page_size a multiple of 64 * element_size. x86-64 (SSE2) only.");

#if defined(HAVE_SHUFFLE)
static PyObject *bitshuffle(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    Py_ssize_t page;
    int e, inverse;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*nip", &src, &dst, &page, &e, &inverse)) return NULL;
    PyObject *result = NULL;
    if ((e != 2 && e != 4) || page <= 0 || page % (64 * e) || src.len % page ||
        dst.len != src.len) {
        PyErr_SetString(PyExc_ValueError, "bitshuffle: element_size 2 or 4, page_size a "
                        "multiple of 64 * element_size, src and dst whole pages of one size");
    } else {
        uint8_t *tmp = PyMem_RawMalloc((size_t)page);
        if (tmp == NULL) {
            PyErr_NoMemory();
        } else {
            const uint8_t *from = src.buf;
            uint8_t *to = dst.buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t at = 0; at < src.len; at += page) {
                const uint8_t *in = from + at;
                if (to == from) { /* in place (dst may be src): the page read from a copy */
                    memcpy(tmp, in, (size_t)page);
                    in = tmp;
                }
                if (inverse) unshuffle_page(in, to + at, page, e);
                else shuffle_page(in, to + at, page, e);
            }
            Py_END_ALLOW_THREADS
            PyMem_RawFree(tmp);
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}
#endif

/* ---------------------------------------------------------------------- exponent codec
 * EXP pages (torch_pagecomp.format; torch_pagecomp.exp_codec is the numpy reference, and these
 * loops write and read the same bytes, sizes, kinds and statuses). A page is n = P / 2
 * little-endian 16-bit values; layout 1 (bf16): e = (v >> 7) & 255, rest byte
 * (v >> 8 & 0x80) | (v & 0x7F); layout 2 (fp16): e = (v >> 10) & 31, rest v & 0xFF, high bits
 * (v >> 13 & 4) | (v >> 8 & 3). Stored: the 7-byte table, the 3-bit codes (8 to a 3-byte
 * little-endian group), fp16's high bits in the same packing, the n rest bytes, one byte per
 * escaped value (code 7). Values are read and written as host integers: little-endian hosts
 * with GCC or Clang only (x86-64, arm64); elsewhere the module has no exp_* functions and
 * exp_codec runs the numpy reference. */
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define HAVE_EXP_CODEC 1
enum { EXP_BF16 = 1, EXP_FP16 = 2, EXP_TABLE = 7, EXP_SAMPLE = 4 }; /* as triton_kernels.constants */

static int64_t exp_fixed(int64_t page, int layout) {
    const int64_t n = page / 2;
    return EXP_TABLE + 3 * n / 8 + (layout == EXP_FP16 ? 3 * n / 8 : 0) + n;
}

static int valid_exp_page(Py_ssize_t page) {
    return page >= 4096 && page <= 65536 && (page & (page - 1)) == 0;
}

#if defined(HAVE_SHUFFLE)
/* The 3-bit codes in bytes 0..7 of `x` (one a byte) -> bits 0..23, code t at bit 3t. */
static inline uint32_t gather_codes(uint64_t x) {
    x = (x | x >> 5) & 0x003F003F003F003Full;  /* pairs: 6 bits at bits 0, 16, 32, 48 */
    x = (x | x >> 10) & 0x00000FFF00000FFFull; /* halves: 12 bits at bits 0, 32 */
    return (uint32_t)((x | x >> 20) & 0xFFFFFFu);
}

/* Whether the exponent loops take 16 values a step (SSE2; the default) or the scalar loops
 * that other CPUs run (exp_lookup('scalar'): for the tests, which check both). */
static int exp_simd = 1;

/* exp_encode_layout's codes, rest bytes, fp16's high bits and the escapes, 16 values a step
 * in SSE2. Each value's exponent e (bf16: bits 7..14; fp16: bits 10..14); its code the index
 * of e in `table` (7 distinct exponents; 7, an escape, for any other), found by comparing e
 * with each entry (at most one matches, so `code ^= match & (7 ^ k)` leaves k there); its
 * rest byte bf16's sign and 7 mantissa bits, fp16's low 8 mantissa bits; fp16's high bits
 * h = sign << 2 | mantissa bits 8..9, gathered as 3-bit groups like the codes. Returns the
 * end of the escape bytes written. The same bytes as the scalar loop. `layout` is a constant
 * where it is inlined. */
static inline __attribute__((always_inline)) uint8_t *
exp_encode_sse2(const uint8_t *src, const uint8_t *table, uint8_t *codes, uint8_t *high,
                uint8_t *rest, uint8_t *esc, int64_t n, const int layout) {
    __m128i t[EXP_TABLE];
    for (int k = 0; k < EXP_TABLE; k++) t[k] = _mm_set1_epi8((char)table[k]);
    const int shift = layout == EXP_BF16 ? 7 : 10;
    const __m128i emask = _mm_set1_epi16(layout == EXP_BF16 ? 0xFF : 0x1F);
    const __m128i byte = _mm_set1_epi16(0xFF), low7 = _mm_set1_epi16(0x7F);
    const __m128i sign = _mm_set1_epi16(0x80), seven = _mm_set1_epi8(EXP_TABLE);
    const __m128i four = _mm_set1_epi16(4), three = _mm_set1_epi16(3);
    for (int64_t g = 0; g < n / 8; g += 2) { /* n / 8 groups: even for every valid page */
        const __m128i x0 = _mm_loadu_si128((const __m128i *)(src + 16 * g));
        const __m128i x1 = _mm_loadu_si128((const __m128i *)(src + 16 * g + 16));
        const __m128i e = _mm_packus_epi16(_mm_and_si128(_mm_srli_epi16(x0, shift), emask),
                                           _mm_and_si128(_mm_srli_epi16(x1, shift), emask));
        __m128i c = seven;
        for (int k = 0; k < EXP_TABLE; k++)
            c = _mm_xor_si128(c, _mm_and_si128(_mm_cmpeq_epi8(e, t[k]),
                                               _mm_set1_epi8((char)(EXP_TABLE ^ k))));
        __m128i r0, r1;
        if (layout == EXP_BF16) {
            r0 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(x0, 8), sign), _mm_and_si128(x0, low7));
            r1 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(x1, 8), sign), _mm_and_si128(x1, low7));
        } else {
            r0 = _mm_and_si128(x0, byte);
            r1 = _mm_and_si128(x1, byte);
        }
        _mm_storeu_si128((__m128i *)(rest + 8 * g), _mm_packus_epi16(r0, r1));
        uint64_t cl[2], hl[2];
        _mm_storeu_si128((__m128i *)cl, c);
        if (layout == EXP_FP16) {
            const __m128i h0 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(x0, 13), four),
                                            _mm_and_si128(_mm_srli_epi16(x0, 8), three));
            const __m128i h1 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(x1, 13), four),
                                            _mm_and_si128(_mm_srli_epi16(x1, 8), three));
            _mm_storeu_si128((__m128i *)hl, _mm_packus_epi16(h0, h1));
        }
        for (int k = 0; k < 2; k++) {
            const uint32_t cw = gather_codes(cl[k]);
            codes[3 * (g + k)] = (uint8_t)cw;
            codes[3 * (g + k) + 1] = (uint8_t)(cw >> 8);
            codes[3 * (g + k) + 2] = (uint8_t)(cw >> 16);
            if (layout == EXP_FP16) {
                const uint32_t hw = gather_codes(hl[k]);
                high[3 * (g + k)] = (uint8_t)hw;
                high[3 * (g + k) + 1] = (uint8_t)(hw >> 8);
                high[3 * (g + k) + 2] = (uint8_t)(hw >> 16);
            }
        }
        unsigned escapes = (unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(c, seven));
        if (escapes) { /* their exponent bytes, in value order */
            uint8_t eb[16];
            _mm_storeu_si128((__m128i *)eb, e);
            for (; escapes; escapes &= escapes - 1) *esc++ = eb[__builtin_ctz(escapes)];
        }
    }
    return esc;
}
#endif

/* Encode one page that is not all-equal: its kind and size, its row of `page` bytes written
 * (zero past the size; the page itself when RAW). `layout` is a constant where it is inlined. */
static inline __attribute__((always_inline)) void
exp_encode_layout(const uint8_t *src, uint8_t *to, int64_t page, const int layout, int64_t limit,
                  int32_t *size, uint8_t *kind) {
    const int64_t n = page / 2;
    const int bins = layout == EXP_BF16 ? 256 : 32;
    const int shift = layout == EXP_BF16 ? 7 : 10;
    /* every value counted, 4 a word into four histograms (no chain through one counter):
     * the sampled rows' (values 32j .. 32j + 7: torch_pagecomp.format) choose the table, and
     * with the other rows' they give the escapes (a second pass that looked each value's
     * code up ran the encoder 0.75x) */
    uint32_t hist[4][256], other[4][256];
    memset(hist, 0, sizeof hist);
    memset(other, 0, sizeof other);
    for (int64_t i = 0; i < n; i += 8 * EXP_SAMPLE) {
        for (int k = 0; k < 2 * EXP_SAMPLE; k++) {
            uint32_t (*h)[256] = k < 2 ? hist : other;
            uint64_t w;
            memcpy(&w, src + 2 * i + 8 * k, 8);
            h[0][(w >> shift) & (bins - 1)]++;
            h[1][(w >> (16 + shift)) & (bins - 1)]++;
            h[2][(w >> (32 + shift)) & (bins - 1)]++;
            h[3][(w >> (48 + shift)) & (bins - 1)]++;
        }
    }
    /* the 7 most frequent there: count descending, then value ascending (bins visited in
     * value order, each placed after every entry of at least its count: a stable sort's) */
    uint32_t top_count[EXP_TABLE];
    uint8_t table[EXP_TABLE];
    int have = 0;
    for (int b = 0; b < bins; b++) {
        const uint32_t c = hist[0][b] + hist[1][b] + hist[2][b] + hist[3][b];
        if (have == EXP_TABLE && c <= top_count[EXP_TABLE - 1]) continue;
        int k = have < EXP_TABLE ? have++ : EXP_TABLE - 1;
        while (k > 0 && top_count[k - 1] < c) {
            top_count[k] = top_count[k - 1];
            table[k] = table[k - 1];
            k--;
        }
        top_count[k] = c;
        table[k] = (uint8_t)b;
    }
    int64_t kept = 0;
    uint8_t code[256];
    memset(code, EXP_TABLE, sizeof code);
    for (int k = 0; k < EXP_TABLE; k++) {
        const int b = table[k];
        kept += top_count[k] + other[0][b] + other[1][b] + other[2][b] + other[3][b];
        code[b] = (uint8_t)k;
    }
    const int64_t fixed = exp_fixed(page, layout), escapes = n - kept;
    if (fixed + escapes > limit) { /* RAW: the page as it is */
        memcpy(to, src, (size_t)page);
        *size = (int32_t)page;
        *kind = KIND_RAW;
        return;
    }
    memcpy(to, table, EXP_TABLE);
    uint8_t *codes = to + EXP_TABLE;
    uint8_t *high = codes + 3 * n / 8; /* fp16 only */
    uint8_t *rest = layout == EXP_FP16 ? high + 3 * n / 8 : high;
    uint8_t *esc = to + fixed;
#if defined(HAVE_SHUFFLE)
    if (exp_simd)
        esc = exp_encode_sse2(src, table, codes, high, rest, esc, n, layout);
    else
#endif
    for (int64_t g = 0; g < n / 8; g++) { /* the scalar loop: 8 values a step */
        uint64_t w[2];
        memcpy(w, src + 16 * g, 16);
        uint32_t cw = 0, hw = 0;
        for (int t = 0; t < 8; t++) {
            const unsigned x = (unsigned)(w[t / 4] >> (16 * (t % 4))) & 0xFFFF;
            const unsigned e = (x >> shift) & (unsigned)(bins - 1), c = code[e];
            cw |= (uint32_t)c << (3 * t);
            if (layout == EXP_FP16) hw |= (uint32_t)(((x >> 13) & 4) | ((x >> 8) & 3)) << (3 * t);
        }
        for (int k = 0; k < 2; k++) { /* the rest bytes of 4 values at a time (16-bit lanes) */
            uint64_t r = w[k];
            if (layout == EXP_BF16)
                r = ((r >> 8) & 0x0080008000800080ull) | (r & 0x007F007F007F007Full);
            else
                r &= 0x00FF00FF00FF00FFull;
            r = (r | (r >> 8)) & 0x0000FFFF0000FFFFull; /* lanes' low bytes side by side */
            const uint32_t four = (uint32_t)(r | (r >> 16));
            memcpy(rest + 8 * g + 4 * k, &four, 4);
        }
        /* the escapes (code 7: bit 3t set below) in value order */
        for (uint32_t m = cw & (cw >> 1) & (cw >> 2) & 0x249249u; m; m &= m - 1) {
            const int t = __builtin_ctz(m) / 3;
            *esc++ = (uint8_t)((w[t / 4] >> (16 * (t % 4) + shift)) & (unsigned)(bins - 1));
        }
        codes[3 * g] = (uint8_t)cw;
        codes[3 * g + 1] = (uint8_t)(cw >> 8);
        codes[3 * g + 2] = (uint8_t)(cw >> 16);
        if (layout == EXP_FP16) {
            high[3 * g] = (uint8_t)hw;
            high[3 * g + 1] = (uint8_t)(hw >> 8);
            high[3 * g + 2] = (uint8_t)(hw >> 16);
        }
    }
    memset(esc, 0, (size_t)(page - (fixed + escapes)));
    *size = (int32_t)(fixed + escapes);
    *kind = (uint8_t)(KIND_EXP | layout << 4);
}

static void exp_encode_page(const uint8_t *src, uint8_t *to, int64_t page, int layout,
                            int64_t limit, int32_t *size, uint8_t *kind) {
    if (layout == EXP_BF16) exp_encode_layout(src, to, page, EXP_BF16, limit, size, kind);
    else exp_encode_layout(src, to, page, EXP_FP16, limit, size, kind);
}

PyDoc_STRVAR(exp_encode_pages_doc,
"exp_encode_pages(raw, out, sizes, kinds, page_size, layout, counter=None, parts=1,\n"
"                 threads=1)\n\n"
"Exponent-code the N pages of raw (uint8 [N * page_size], C-contiguous; N = len(sizes))\n"
"with the GIL released, as torch_pagecomp.exp_codec's numpy reference does: an all-equal\n"
"page is FILL (size 1, its byte then zeros), a page whose EXP size would exceed\n"
"page_size - page_size / 32 is RAW (the page, size page_size), else kind 3 | layout << 4\n"
"with the rest of the row zeroed. Writes out (uint8 [N * page_size]), sizes (int32 [N]) and\n"
"kinds (uint8 [N]). layout 1 (bf16) or 2 (fp16); page_size a power of two, 4096..65536.\n"
"With a counter (and threads), as decode_pages: the N pages cut into `parts` ranges that the\n"
"calls (and threads) sharing the counter take one by one.");

/* What each thread of an exp_encode_pages call reads and writes. */
typedef struct {
    const uint8_t *from;
    uint8_t *dst, *kind;
    int32_t *size;
    int64_t page;
    int layout;
    ranges_t *ranges;
} exp_encode_ctx;

static void exp_encode_body(void *arg) {
    const exp_encode_ctx *c = arg;
    const int64_t page = c->page, limit = page - page / 32;
    Py_ssize_t lo, hi;
    while (next_range(c->ranges, &lo, &hi)) /* every page of each range taken */
    for (Py_ssize_t i = lo; i < hi; i++) {
        const uint8_t *r = c->from + i * page;
        uint8_t *to = c->dst + i * page;
        if (!store_if_fill(r, to, page, c->size + i, c->kind + i))
            exp_encode_page(r, to, page, c->layout, limit, c->size + i, c->kind + i);
    }
}

static PyObject *exp_encode_pages(PyObject *self, PyObject *args) {
    PyObject *o_raw, *o_out, *o_sizes, *o_kinds, *o_counter = NULL;
    Py_ssize_t page, parts = 1, threads = 1;
    int layout;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOni|Onn", &o_raw, &o_out, &o_sizes, &o_kinds, &page, &layout,
                          &o_counter, &parts, &threads))
        return NULL;
    if (!valid_exp_page(page) || (layout != EXP_BF16 && layout != EXP_FP16)) {
        PyErr_Format(PyExc_ValueError, "exp_encode_pages: page_size must be a power of two in "
                     "4096..65536 and layout 1 (bf16) or 2 (fp16), got %zd and %d", page, layout);
        return NULL;
    }
    Py_buffer raw, out, sizes, kinds, counter;
    ranges_t ranges;
    PyObject *result = NULL;
    const buffer_arg bufs[] = {
        {o_raw, &raw, 0, 1, 'u', "raw"}, {o_out, &out, 1, 1, 'u', "out"},
        {o_sizes, &sizes, 1, 4, 'i', "sizes"}, {o_kinds, &kinds, 1, 1, 'u', "kinds"}};
    const int nbufs = (int)(sizeof bufs / sizeof bufs[0]);
    if (!get_args(bufs, nbufs, o_counter, parts, 0, 0, &sizes, &counter, &ranges,
                  "exp_encode_pages"))
        return NULL;
    const Py_ssize_t n = sizes.len / 4;
    if (raw.len != n * page || out.len != n * page || kinds.len != n) {
        PyErr_Format(PyExc_ValueError, "exp_encode_pages: %zd pages (sizes) of %zd bytes need raw "
                     "and out of %zd bytes and kinds of %zd, got %zd, %zd and %zd", n, page,
                     n * page, n, raw.len, out.len, kinds.len);
    } else if (check_threads(threads, &ranges, "exp_encode_pages")) {
        exp_encode_ctx c = {raw.buf, out.buf, kinds.buf, sizes.buf, page, layout, &ranges};
        Py_BEGIN_ALLOW_THREADS
        run_loop(exp_encode_body, &c, threads);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None); /* nothing to allocate: every thread that started worked */
    }
    release_ranges(&counter);
    release_buffers(bufs, nbufs);
    return result;
}

/* Escaped values (code 7) among the 3-bit codes of `groups` 3-byte groups. */
static int64_t count_escapes(const uint8_t *codes, int64_t groups) {
    int64_t count = 0;
    for (int64_t g = 0; g < groups; g++) {
        const uint32_t w = (uint32_t)codes[3 * g] | (uint32_t)codes[3 * g + 1] << 8 |
                           (uint32_t)codes[3 * g + 2] << 16;
        /* a bit at 3t per escape; the multiply sums those of t = 0..6 at bits 18..20 (at most
         * 7; the lower sums, at most 6, never carry into them); t = 7's bit is bit 21 */
        const uint32_t x = w & (w >> 1) & (w >> 2) & 0x249249u;
        count += (int64_t)(((((x & 0x49249u) * 0x49249u) >> 18) & 7) + (x >> 21));
    }
    return count;
}

#if defined(HAVE_SHUFFLE)
/* The 3-bit codes of one 3-byte group (code t at bits 3t) -> byte t of the result. */
static inline uint64_t spread_codes(const uint8_t *c) {
    uint64_t x = (uint64_t)c[0] | (uint64_t)c[1] << 8 | (uint64_t)c[2] << 16;
    x = (x | x << 20) & 0x00000FFF00000FFFull; /* codes 0-3 | codes 4-7 at bit 32 */
    x = (x | x << 10) & 0x003F003F003F003Full; /* pairs at bits 0, 16, 32, 48 */
    return (x | x << 5) & 0x0707070707070707ull; /* one code a byte */
}

/* The exponent bytes of 16 values: byte t of `c` (a code 0..7) -> byte c of `table` (byte 7
 * is 0: an escape). SSSE3's byte shuffle does it in one step where the CPU has it (checked at
 * the module's import), else SSE2 compares each code with 0..6. */
__attribute__((target("ssse3"))) static inline __m128i exp_lookup_ssse3(__m128i c,
                                                                         __m128i table) {
    return _mm_shuffle_epi8(table, c);
}

static inline __m128i exp_lookup_sse2(__m128i c, __m128i table) {
    uint8_t t[16];
    _mm_storeu_si128((__m128i *)t, table);
    __m128i e = _mm_setzero_si128();
    for (int k = 0; k < EXP_TABLE; k++)
        e = _mm_or_si128(e, _mm_and_si128(_mm_cmpeq_epi8(c, _mm_set1_epi8((char)k)),
                                          _mm_set1_epi8((char)t[k])));
    return e;
}

/* exp_decode_layout's page, 16 values a step: each value's exponent e looked up from its
 * code (an escape gets its byte from the escape bytes after), then its two bytes put
 * together from e and its rest byte r. bf16 (r: sign and 7 mantissa bits): low = (e & 1) <<
 * 7 | r & 0x7F, high = r & 0x80 | e >> 1. fp16 (r: the low 8 mantissa bits; h, from the high
 * bits' 3-bit groups: sign << 2 | mantissa bits 8..9): low = r, high = (h & 4) << 5 | e << 2
 * | h & 3 (the table's bytes taken mod 32, as the scalar loop does). The escapes are counted
 * on the way: the status is BAD_SIZE unless they are exactly the bytes from `esc` to `end`
 * (none is read past `end`; the caller zeroes a failed row). One body, inlined into a
 * function per layout and lookup; `layout` and `ssse3` are constants there. */
static inline __attribute__((always_inline)) int32_t
exp_decode_sse_body(const uint8_t *table, const uint8_t *codes, const uint8_t *high,
                    const uint8_t *rest, const uint8_t *esc, const uint8_t *end, uint8_t *to,
                    int64_t n, const int layout, const int ssse3) {
    uint8_t t16[16] = {0};
    for (int k = 0; k < EXP_TABLE; k++) t16[k] = layout == EXP_BF16 ? table[k] : table[k] & 31;
    const __m128i lut = _mm_loadu_si128((const __m128i *)t16);
    const __m128i low7 = _mm_set1_epi8(0x7F), sign = _mm_set1_epi8((char)0x80);
    const __m128i one = _mm_set1_epi8(1), seven = _mm_set1_epi8(EXP_TABLE);
    const __m128i three = _mm_set1_epi8(3), four = _mm_set1_epi8(4);
    for (int64_t g = 0; g < n / 8; g += 2) { /* n / 8 groups: even for every valid page */
        const uint8_t *cg = codes + 3 * g;
        const __m128i c = _mm_set_epi64x((long long)spread_codes(cg + 3),
                                         (long long)spread_codes(cg));
        const __m128i e = ssse3 ? exp_lookup_ssse3(c, lut) : exp_lookup_sse2(c, lut);
        const __m128i r = _mm_loadu_si128((const __m128i *)(rest + 8 * g));
        __m128i lo, hi;
        if (layout == EXP_BF16) {
            lo = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(e, one), 7), _mm_and_si128(r, low7));
            hi = _mm_or_si128(_mm_and_si128(r, sign), _mm_and_si128(_mm_srli_epi16(e, 1), low7));
        } else { /* the 16-bit shifts move bits within their bytes: h & 4 by 5, e < 32 by 2 */
            const uint8_t *hg = high + 3 * g;
            const __m128i h = _mm_set_epi64x((long long)spread_codes(hg + 3),
                                             (long long)spread_codes(hg));
            lo = r;
            hi = _mm_or_si128(_mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, four), 5),
                                           _mm_slli_epi16(e, 2)), _mm_and_si128(h, three));
        }
        _mm_storeu_si128((__m128i *)(to + 16 * g), _mm_unpacklo_epi8(lo, hi));
        _mm_storeu_si128((__m128i *)(to + 16 * g + 16), _mm_unpackhi_epi8(lo, hi));
        /* the escapes (code 7) among the 16, lowest first: value order */
        unsigned escapes = (unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(c, seven));
        for (; escapes; escapes &= escapes - 1) {
            if (esc == end) return STATUS_BAD_SIZE; /* more escapes than bytes */
            uint8_t *v = to + 16 * g + 2 * __builtin_ctz(escapes);
            const unsigned x = *esc++;
            if (layout == EXP_BF16) {
                v[0] |= (uint8_t)((x & 1) << 7);
                v[1] |= (uint8_t)(x >> 1);
            } else {
                v[1] |= (uint8_t)((x & 31) << 2);
            }
        }
    }
    return esc == end ? STATUS_OK : STATUS_BAD_SIZE; /* fewer escapes than bytes */
}

typedef int32_t (*exp_simd_fn)(const uint8_t *, const uint8_t *, const uint8_t *,
                               const uint8_t *, const uint8_t *, const uint8_t *, uint8_t *,
                               int64_t);

#define EXP_DECODER(name, layout, ssse3, target)                                               \
    target static int32_t name(const uint8_t *table, const uint8_t *codes, const uint8_t *high, \
                               const uint8_t *rest, const uint8_t *esc, const uint8_t *end,     \
                               uint8_t *to, int64_t n) {                                       \
        return exp_decode_sse_body(table, codes, high, rest, esc, end, to, n, layout, ssse3);  \
    }
EXP_DECODER(exp_decode_bf16_sse2, EXP_BF16, 0, )
EXP_DECODER(exp_decode_fp16_sse2, EXP_FP16, 0, )
EXP_DECODER(exp_decode_bf16_ssse3, EXP_BF16, 1, __attribute__((target("ssse3"))))
EXP_DECODER(exp_decode_fp16_ssse3, EXP_FP16, 1, __attribute__((target("ssse3"))))
#undef EXP_DECODER

/* [layout - 1]: the decoder in use per layout (the SSSE3 ones where the CPU has them) */
static exp_simd_fn exp_decode_simd[2] = {exp_decode_bf16_sse2, exp_decode_fp16_sse2};
#endif

/* Decode one EXP page whose [src, src + size) lies in the payload and size >= its fixed part:
 * the status (BAD_SIZE unless size is the fixed part plus the escapes its codes count; the row
 * may then be partly written, and the caller zeroes it). Reads only src[0 .. size), writes
 * only to[0 .. page). `layout` is a constant where it is inlined (one loop per layout; bf16 on
 * x86-64: exp_decode_simd, 16 values a step). */
static inline __attribute__((always_inline)) int32_t
exp_decode_layout(const uint8_t *src, int64_t size, uint8_t *to, int64_t page, const int layout) {
    const int64_t n = page / 2, fixed = exp_fixed(page, layout);
    const uint8_t *codes = src + EXP_TABLE;
    const uint8_t *high = codes + 3 * n / 8; /* fp16 only */
    const uint8_t *rest = layout == EXP_FP16 ? high + 3 * n / 8 : high;
#if defined(HAVE_SHUFFLE) /* escapes counted as they are decoded */
    if (exp_simd)
        return exp_decode_simd[layout - 1](src, codes, high, rest, src + fixed, src + size, to, n);
#endif
    if (size != fixed + count_escapes(codes, n / 8)) return STATUS_BAD_SIZE;
    const uint8_t *esc = src + fixed; /* exactly size - fixed of them: every read inside */
    const unsigned mask = layout == EXP_FP16 ? 31 : 255, shift = layout == EXP_FP16 ? 10 : 7;
    /* bf16: lut[c] the exponent of code c in place (code 7, an escape: 0); fp16: lut[c | h << 3]
     * that with the high bits h in place too. rl[r]: the rest byte r in place. */
    uint16_t lut[64], rl[256];
    for (int k = 0; k < 64; k++) {
        const int c = k & 7, h = k >> 3;
        lut[k] = (uint16_t)(c == EXP_TABLE ? 0 : (src[c] & mask) << shift);
        if (layout == EXP_FP16) lut[k] |= (uint16_t)(((h & 4) << 13) | ((h & 3) << 8));
    }
    for (int r = 0; r < 256; r++)
        rl[r] = (uint16_t)(layout == EXP_BF16 ? ((r & 0x80) << 8) | (r & 0x7F) : r);
    for (int64_t g = 0; g < n / 8; g++) {
        const uint32_t cw = (uint32_t)codes[3 * g] | (uint32_t)codes[3 * g + 1] << 8 |
                            (uint32_t)codes[3 * g + 2] << 16;
        uint32_t hw = 0;
        if (layout == EXP_FP16)
            hw = (uint32_t)high[3 * g] | (uint32_t)high[3 * g + 1] << 8 |
                 (uint32_t)high[3 * g + 2] << 16;
        const uint8_t *r = rest + 8 * g;
        uint64_t w[2] = {0, 0};
#define EXP_VALUE(t) \
        (uint64_t)(lut[((cw >> (3 * (t))) & 7) | (layout == EXP_FP16 ? ((hw >> (3 * (t))) & 7) << 3 : 0)] | \
                   rl[r[t]])
        w[0] = EXP_VALUE(0) | EXP_VALUE(1) << 16 | EXP_VALUE(2) << 32 | EXP_VALUE(3) << 48;
        w[1] = EXP_VALUE(4) | EXP_VALUE(5) << 16 | EXP_VALUE(6) << 32 | EXP_VALUE(7) << 48;
#undef EXP_VALUE
        /* the escapes (code 7: bit 3t set below) in value order */
        for (uint32_t m = cw & (cw >> 1) & (cw >> 2) & 0x249249u; m; m &= m - 1) {
            const int t = __builtin_ctz(m) / 3;
            w[t / 4] |= (uint64_t)((*esc++ & mask) << shift) << (16 * (t % 4));
        }
        memcpy(to + 16 * g, w, 16); /* little-endian: value 4k + t at bits 16t of w[k] */
    }
    return STATUS_OK;
}

static int32_t exp_decode_page(const uint8_t *src, int64_t size, uint8_t *to, int64_t page,
                               int layout) {
    return layout == EXP_BF16 ? exp_decode_layout(src, size, to, page, EXP_BF16)
                              : exp_decode_layout(src, size, to, page, EXP_FP16);
}

PyDoc_STRVAR(exp_decode_pages_doc,
"exp_decode_pages(payload, offsets, sizes, kinds, out, status, page_size, counter=None,\n"
"                 parts=1, threads=1)\n\n"
"Decode the N = len(sizes) pages of a batch of the exponent codec with the GIL released, as\n"
"torch_pagecomp.exp_codec.decompress_exp_cpu does: page i's stored bytes are\n"
"payload[offsets[i]:offsets[i] + sizes[i]] (payload uint8 [T]; offsets int64 [>= N]; sizes\n"
"int32 [N]; kinds uint8 [N]); its bytes go to out[i * page_size:(i + 1) * page_size] (uint8\n"
"[N * page_size]) and its status to status[i] (int32 [N]). RAW (0x00), FILL (0x02) and EXP\n"
"(0x13 bf16, 0x23 fp16) pages decode; any other kind is BAD_KIND; bytes outside the payload,\n"
"RAW not page_size, FILL not 1, EXP under its fixed part or over page_size - page_size / 32,\n"
"or EXP not its fixed part plus the escapes its codes count, BAD_SIZE. A failed page's row\n"
"is zeroed; nothing is read outside a page's stored bytes. page_size a power of two,\n"
"4096..65536. With a counter (and threads), as decode_pages: the N pages cut into `parts`\n"
"ranges that the calls (and threads) sharing the counter take one by one.");

/* Each thread of an exp_decode_pages call reads and writes what decode_pages' do (decode_ctx;
 * `packed` unused: offsets are page starts). */
static void exp_decode_body(void *arg) {
    const decode_ctx *c = arg;
    const uint8_t *src = c->src, *kind = c->kind;
    const int64_t page = c->page, total = c->total, limit = page - page / 32;
    const int64_t least_bf16 = exp_fixed(page, EXP_BF16), least_fp16 = exp_fixed(page, EXP_FP16);
    Py_ssize_t lo, hi;
    while (next_range(c->ranges, &lo, &hi)) /* every page of each range taken */
    for (Py_ssize_t i = lo; i < hi; i++) {
        const int codec = kind[i] & 15, high = kind[i] >> 4;
        const int64_t o = c->off[i], s = c->size[i];
        uint8_t *to = c->dst + i * page;
        const int plain = (codec == KIND_RAW || codec == KIND_FILL) && high == 0;
        const int exp = codec == KIND_EXP && (high == EXP_BF16 || high == EXP_FP16);
        int32_t r = STATUS_OK;
        if (!plain && !exp) {
            r = STATUS_BAD_KIND;
        } else if (plain_size_bad(codec, o, s, total, page) ||
                   (exp && (s < (high == EXP_FP16 ? least_fp16 : least_bf16) || s > limit))) {
            r = STATUS_BAD_SIZE;
        } else if (codec == KIND_RAW) {
            memcpy(to, src + o, (size_t)page);
        } else if (codec == KIND_FILL) {
            memset(to, src[o], (size_t)page);
        } else {
            r = exp_decode_page(src + o, s, to, page, high);
        }
        c->st[i] = r;
        if (r != STATUS_OK) memset(to, 0, (size_t)page);
    }
}

static PyObject *exp_decode_pages(PyObject *self, PyObject *args) {
    PyObject *o_payload, *o_offsets, *o_sizes, *o_kinds, *o_out, *o_status, *o_counter = NULL;
    Py_ssize_t page, parts = 1, threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOn|Onn", &o_payload, &o_offsets, &o_sizes, &o_kinds, &o_out,
                          &o_status, &page, &o_counter, &parts, &threads))
        return NULL;
    if (!valid_exp_page(page)) {
        PyErr_Format(PyExc_ValueError, "exp_decode_pages: page_size must be a power of two in "
                     "4096..65536, got %zd", page);
        return NULL;
    }
    Py_buffer payload, offsets, sizes, kinds, out, status, counter;
    ranges_t ranges;
    PyObject *result = NULL;
    const buffer_arg bufs[] = {
        {o_payload, &payload, 0, 1, 'u', "payload"}, {o_offsets, &offsets, 0, 8, 'i', "offsets"},
        {o_sizes, &sizes, 0, 4, 'i', "sizes"}, {o_kinds, &kinds, 0, 1, 'u', "kinds"},
        {o_out, &out, 1, 1, 'u', "out"}, {o_status, &status, 1, 4, 'i', "status"}};
    const int nbufs = (int)(sizeof bufs / sizeof bufs[0]);
    if (!get_args(bufs, nbufs, o_counter, parts, 0, 0, &sizes, &counter, &ranges,
                  "exp_decode_pages"))
        return NULL;
    const Py_ssize_t n = sizes.len / 4;
    if (offsets.len < 8 * n || kinds.len != n || out.len != n * page || status.len != 4 * n) {
        PyErr_Format(PyExc_ValueError, "exp_decode_pages: %zd pages (sizes) of %zd bytes need at "
                     "least %zd offsets, %zd kinds, out of %zd bytes and %zd statuses, got %zd, "
                     "%zd, %zd and %zd", n, page, n, n, n * page, n, offsets.len / 8, kinds.len,
                     out.len, status.len / 4);
    } else if (check_threads(threads, &ranges, "exp_decode_pages")) {
        decode_ctx c = {payload.buf, kinds.buf, offsets.buf, sizes.buf, out.buf, status.buf,
                        payload.len, page, 0, &ranges};
        Py_BEGIN_ALLOW_THREADS
        run_loop(exp_decode_body, &c, threads);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None); /* nothing to allocate: every thread that started worked */
    }
    release_ranges(&counter);
    release_buffers(bufs, nbufs);
    return result;
}
#endif /* HAVE_EXP_CODEC */

PyDoc_STRVAR(pack_pages_doc,
"pack_pages(payload, offsets, packed, page_size)\n\n"
"Fixed-stride payload (uint8 [N * page_size]) -> packed (uint8, at least offsets[N] bytes:\n"
"N * page_size for a bound known before, offsets[N] for the exact size): page i's first\n"
"offsets[i + 1] - offsets[i] bytes at offsets[i] (offsets: int64 [N + 1], from 0, each step\n"
"0..page_size), the bytes of packed past offsets[N] zeroed; with the GIL released. Raises\n"
"ValueError (nothing written) for offsets that break those rules or a packed too small.");

static PyObject *pack_pages(PyObject *self, PyObject *args) {
    Py_buffer payload, offsets, packed;
    Py_ssize_t page;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*n", &payload, &offsets, &packed, &page)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = offsets.len / 8 - 1;
    const int64_t *off = offsets.buf;
    int ok = page > 0 && n >= 0 && off[0] == 0 && check(&payload, page, n, "payload");
    for (Py_ssize_t i = 0; ok && i < n; i++) /* every copy inside both buffers */
        ok = off[i + 1] - off[i] >= 0 && off[i + 1] - off[i] <= page;
    ok = ok && check(&packed, 1, (Py_ssize_t)off[n], "packed");
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "pack_pages: page_size or offsets are invalid");
    } else {
        const uint8_t *src = payload.buf;
        uint8_t *dst = packed.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            memcpy(dst + off[i], src + i * (int64_t)page, (size_t)(off[i + 1] - off[i]));
        memset(dst + off[n], 0, (size_t)(packed.len - off[n]));
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&payload);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&packed);
    return result;
}

#if defined(HAVE_EXP_CODEC) && defined(HAVE_SHUFFLE)
PyDoc_STRVAR(exp_lookup_doc,
"exp_lookup(name=None) -> str\n\n"
"The exponent loops in use: 16 values a step with the decoder's table lookup 'ssse3' (a\n"
"byte shuffle, where the CPU has it) or 'sse2' (compares), or 'scalar' (8 values a step, the\n"
"loops of CPUs without SSE2). With a name, use those (for tests: all give the same bytes and\n"
"statuses); 'ssse3' where the CPU lacks it is a ValueError.");

static PyObject *exp_lookup_arg(PyObject *self, PyObject *args) {
    const char *name = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "|z", &name)) return NULL;
    if (name != NULL) {
        if (strcmp(name, "scalar") == 0) {
            exp_simd = 0;
        } else if (strcmp(name, "sse2") == 0) {
            exp_simd = 1;
            exp_decode_simd[0] = exp_decode_bf16_sse2;
            exp_decode_simd[1] = exp_decode_fp16_sse2;
        } else if (strcmp(name, "ssse3") == 0 && __builtin_cpu_supports("ssse3")) {
            exp_simd = 1;
            exp_decode_simd[0] = exp_decode_bf16_ssse3;
            exp_decode_simd[1] = exp_decode_fp16_ssse3;
        } else {
            PyErr_Format(PyExc_ValueError, "exp_lookup: 'scalar', 'sse2', or 'ssse3' where the CPU has it; "
                         "got %s", name);
            return NULL;
        }
    }
    return PyUnicode_FromString(!exp_simd ? "scalar"
                                : exp_decode_simd[0] == exp_decode_bf16_ssse3 ? "ssse3" : "sse2");
}
#endif

static PyMethodDef methods[] = {
    {"pack_pages", pack_pages, METH_VARARGS, pack_pages_doc},
    {"decode_pages", decode_pages, METH_VARARGS, decode_pages_doc},
    {"compress_pages", compress_pages, METH_VARARGS, compress_pages_doc},
#if defined(HAVE_EXP_CODEC)
    {"exp_encode_pages", exp_encode_pages, METH_VARARGS, exp_encode_pages_doc},
    {"exp_decode_pages", exp_decode_pages, METH_VARARGS, exp_decode_pages_doc},
#endif
#if defined(HAVE_SHUFFLE)
    {"bitshuffle", bitshuffle, METH_VARARGS, bitshuffle_doc},
#endif
#if defined(HAVE_EXP_CODEC) && defined(HAVE_SHUFFLE)
    {"exp_lookup", exp_lookup_arg, METH_VARARGS, exp_lookup_doc},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "The CPU path's LZ4 and exponent-codec page loops in C (see torch_pagecomp.cpu_codec, "
    "torch_pagecomp.exp_codec).", -1, methods,
};

/* SHARED_RANGES: the page loops take (counter, parts), ranges drawn from a shared counter
 * (cpu_codec uses them only where the module says so: an older build takes one range a call).
 * THREADS: they also take `threads` (at most MAX_THREADS) and start that many less one threads
 * of their own for the call (run_loop); 0 where the platform has no pthreads (cpu_codec then
 * runs the loops on its Python threads, each call with threads=1). */
PyMODINIT_FUNC PyInit__native(void) {
#if defined(HAVE_EXP_CODEC) && defined(HAVE_SHUFFLE)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("ssse3")) {
        exp_decode_simd[0] = exp_decode_bf16_ssse3;
        exp_decode_simd[1] = exp_decode_fp16_ssse3;
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "SHARED_RANGES", 1) < 0 ||
                      PyModule_AddIntConstant(m, "THREADS", HAVE_THREADS) < 0 ||
                      PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0))
        Py_CLEAR(m);
    return m;
}
