/*
 * Compiled hot paths of the embedding PS storage engine (persia.embedding_ps._kernels).
 *
 * Why: in numpy a lookup is a dozen passes over the batch (hash, home slot, slot gather, row
 * gather, sign check, copy, stamp), each sweeping temporaries, and the two random reads per ID
 * (index slot, then row) are serialized pass by pass. Here one pass per ID does it all, and the
 * random reads of a group of IDs are prefetched together so their cache misses overlap.
 *
 *   locate       hash -> probe the open-addressing index -> copy the row out (lookups); misses
 *                are reported back (hit = 0, zeros in the output) for Python to create rows.
 *   update       probe -> optimizer step (SGD / Adagrad / Adam, exactly the numpy code's float32
 *                arithmetic) -> weight-bound clip -> promote the row to its home slot, in place;
 *                a batch that may repeat a sign is refused untouched (the caller sums first).
 *   replay       an NN worker's missed own update stepped onto its copy of a looked-up table
 *                (nn_worker/replay.py): a merge of two sorted sign lists, then the same step.
 *   partition    stable counting sort of a batch (signs and gradients) by internal shard.
 *   insert       new (hash, row) entries into the index, each in the first free slot of its probe
 *                sequence (rows' inserts, region rebuilds); index.py's insert is the reference.
 *   init_rows    new rows written whole: deterministic initial weights (hashing.py's
 *                uniform_from_signs, to the bit), the sign, the stamp, the optimizer's initial state.
 *   sign_hash    the internal 64-bit hash (tests check it equals persia.hashing.mix64_salted).
 *
 * The table layout and the index rules are those of table.py and index.py (docs/ps-storage.md).
 * Arrays come through the buffer protocol (no numpy headers needed): dtype, shape, contiguity and
 * writability are checked before any loop, and every row number read from the index is
 * bounds-checked inside. The PS loops run without the GIL (concurrent RPC threads on different
 * internal shards overlap; the caller holds the shard locks), replay's short one with it; none
 * allocates.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#define SLOT_EMPTY 0u
#define SLOT_TOMBSTONE 1u
#define FIRST_ROW 2u

/*
 * Software pipeline: while ID i is processed, the row (and state) of ID i + DIST is prefetched,
 * and the index slot of ID i + 2*DIST, so the cache misses of ~2*DIST IDs overlap instead of
 * following one another. RING holds the per-ID values between the stages.
 */
#ifndef DIST
#define DIST 16
#endif
#ifndef DIST1
#define DIST1 (2 * DIST)
#endif
#define RING 64 /* a power of two > DIST1 */
#if RING <= DIST1 || DIST1 <= DIST
#error "need DIST < DIST1 < RING"
#endif

/* The lookup's specialised loop (gather_body) does less work per ID, so it needs its misses
 * requested further ahead: distance 48 (slots 96 ahead) measured 0.97-0.99 of numpy's gather on
 * the --small benchmark against 0.91-0.92 at 32 and 0.79 at 16; 64 was no better. */
#ifndef GDIST
#define GDIST 48
#endif
#define GDIST1 (2 * GDIST)
#define GRING 128 /* a power of two > GDIST1 */
#if GRING <= GDIST1
#error "need GDIST1 < GRING"
#endif

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH_R(p) __builtin_prefetch((const void *)(p), 0, 3)
#define PREFETCH_W(p) __builtin_prefetch((const void *)(p), 1, 3)
#define STORE_RELAXED(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#else
#define PREFETCH_R(p) ((void)0)
#define PREFETCH_W(p) ((void)0)
#define STORE_RELAXED(p, v) (*(p) = (v))
#endif

/* Optimizer codes: the checkpoint-header codes of optimizers.py (OPTIMIZER_CODES). */
#define OPT_SGD 1
#define OPT_ADAGRAD 2
#define OPT_ADAM 3

/* Errors found without the GIL, raised once it is back. */
#define ERR_NONE 0
#define ERR_CORRUPT_INDEX 1
#define ERR_UNSORTED 2 /* replay: signs not sorted and distinct */
#define ERR_REPLICA 3  /* replay: a replica index past done */

/* ---------------------------------------------------------------------------------------------
 * Argument checking
 * ------------------------------------------------------------------------------------------- */

enum kind { K_UINT, K_INT, K_FLOAT, K_BOOL };

typedef struct {
    Py_buffer view;
    int held;
} arg_buf;

#define MAX_BUFS 12

typedef struct {
    arg_buf b[MAX_BUFS];
    int n;
} buf_set;

static void release_all(buf_set *s)
{
    for (int i = 0; i < s->n; i++) {
        if (s->b[i].held) {
            PyBuffer_Release(&s->b[i].view);
            s->b[i].held = 0;
        }
    }
    s->n = 0;
}

static const char *kind_name(int kind)
{
    switch (kind) {
    case K_UINT: return "unsigned integer";
    case K_INT: return "signed integer";
    case K_FLOAT: return "float";
    default: return "bool";
    }
}

/* The element kind of a buffer format string ("L", "<f", "?", ...), or -1. */
static int format_kind(const char *fmt)
{
    if (fmt == NULL)
        return K_UINT; /* plain bytes */
    if (*fmt == '@' || *fmt == '=' || *fmt == '<') {
#if PY_BIG_ENDIAN
        if (*fmt == '<')
            return -1;
#endif
        fmt++;
    }
    if (fmt[0] == '\0' || fmt[1] != '\0')
        return -1;
    switch (fmt[0]) {
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': return K_UINT;
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': return K_INT;
    case 'f': case 'd': return K_FLOAT;
    case '?': return K_BOOL;
    default: return -1;
    }
}

/*
 * Borrow `obj`'s memory as a C-contiguous array of `ndim` dimensions of `itemsize`-byte `kind`
 * elements. Returns the data pointer, or NULL with ValueError naming `name` (or NULL without an
 * error when obj is None and `optional`; check PyErr_Occurred()).
 */
static void *take(buf_set *s, PyObject *obj, const char *name, int kind, Py_ssize_t itemsize, int ndim,
                  int writable, int optional)
{
    if (obj == Py_None && optional)
        return NULL;
    if (s->n >= MAX_BUFS) {
        PyErr_SetString(PyExc_RuntimeError, "too many array arguments");
        return NULL;
    }
    arg_buf *a = &s->b[s->n];
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &a->view, flags) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s %zd-D array of %zd-byte %s, got %R", name,
                     writable ? " writable" : "", (Py_ssize_t)ndim, itemsize, kind_name(kind), Py_TYPE(obj));
        return NULL;
    }
    a->held = 1;
    s->n++;
    int got = format_kind(a->view.format);
    if (a->view.ndim != ndim || a->view.itemsize != itemsize || got != kind) {
        PyErr_Format(PyExc_ValueError, "%s must be a %zd-D array of %zd-byte %s, got %zd-D of %zd-byte format '%s'",
                     name, (Py_ssize_t)ndim, itemsize, kind_name(kind), (Py_ssize_t)a->view.ndim, a->view.itemsize,
                     a->view.format ? a->view.format : "B");
        return NULL;
    }
    return a->view.buf;
}

static Py_ssize_t dim_of(buf_set *s, int i, int axis)
{
    return s->b[i].view.shape[axis];
}

static int expect_len(Py_ssize_t got, Py_ssize_t want, const char *name, const char *what)
{
    if (got != want) {
        PyErr_Format(PyExc_ValueError, "%s has %zd %s, expected %zd", name, got, what, want);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Hashing and the index (index.py)
 * ------------------------------------------------------------------------------------------- */

/* splitmix64 finalizer, as persia.hashing.mix64 (never change: checkpoints depend on it). */
static inline uint64_t mix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* index.py _fastrange: floor(hi * n / 2**32) of the high 32 bits (wrapping like numpy's uint64). */
static inline uint64_t fastrange(uint64_t h, uint64_t n)
{
    return ((h >> 32) * n) >> 32;
}

typedef struct {
    uint32_t *index;
    uint64_t total_slots; /* num_shards * slots_per_region */
    uint64_t slots;       /* slots per region (M) */
    float *rows;
    uint64_t nrows;
    Py_ssize_t width;   /* floats per row */
    Py_ssize_t key_col; /* the sign's first float cell */
    Py_ssize_t stamp_col; /* the row's uint32 recency stamp cell */
    Py_ssize_t dim;
    uint64_t salt;
} table_view;

/* The recency stamp of row r, a uint32 cell inside the row: a training lookup writes it into a
 * cache line it has just read for the weights, instead of missing on a separate stamp array. */
static inline uint32_t *stamp_of(const table_view *t, uint32_t r)
{
    return (uint32_t *)(t->rows + (size_t)r * (size_t)t->width + t->stamp_col);
}

static inline uint64_t stored_sign(const table_view *t, uint32_t r)
{
    uint64_t s;
    memcpy(&s, t->rows + (size_t)r * (size_t)t->width + t->key_col, sizeof s);
    return s;
}

/*
 * Probe from `home` (whose slot value `first` is already loaded), as index.py / DimTable.locate:
 * EMPTY ends the chain, TOMBSTONE and other signs' rows continue it, linearly, wrapping inside the
 * region. Returns 1 (found: *row, *slot), 0 (absent) or -1 (no end, or a slot names a row past
 * the table: a corrupt index).
 */
static inline int probe(const table_view *t, uint64_t sign, uint64_t home, uint32_t first, uint32_t *row,
                        uint64_t *slot)
{
    uint64_t p = home;
    uint32_t r = first;
    uint64_t region_end = 0; /* computed (one division) only when the chain leaves the home slot */
    for (uint64_t step = 0; step <= t->slots; step++) {
        if (r == SLOT_EMPTY)
            return 0;
        if (r >= FIRST_ROW) {
            if (r >= t->nrows)
                return -1;
            if (stored_sign(t, r) == sign) {
                *row = r;
                *slot = p;
                return 1;
            }
        }
        if (region_end == 0)
            region_end = (home / t->slots + 1) * t->slots;
        p += 1;
        if (p == region_end)
            p -= t->slots;
        r = t->index[p];
    }
    return -1;
}

/* Prefetch the cache lines of `bytes` (> 0) bytes at p: its first line, the next one and its last
 * one, i.e. all of a row of up to 128 bytes (a 76-byte dim-16 row spans two lines, or three when
 * it starts in the last 12 bytes of one); wider rows get these and the hardware streams the rest. */
static inline void prefetch_span_r(const void *p, size_t bytes)
{
    PREFETCH_R(p);
    if (bytes > 64)
        PREFETCH_R((const char *)p + 64);
    PREFETCH_R((const char *)p + bytes - 1);
}

static inline void prefetch_span_w(const void *p, size_t bytes)
{
    PREFETCH_W(p);
    if (bytes > 64)
        PREFETCH_W((const char *)p + 64);
    PREFETCH_W((const char *)p + bytes - 1);
}

/* The index array of (num_shards, slots_per_region), borrowed and checked: NULL with ValueError. */
static uint32_t *index_arg(buf_set *s, PyObject *index, Py_ssize_t num_shards, Py_ssize_t slots, int writable)
{
    if (num_shards < 1 || slots < 1) {
        PyErr_Format(PyExc_ValueError, "num_shards (%zd) and slots_per_region (%zd) must be positive", num_shards,
                     slots);
        return NULL;
    }
    int ib = s->n;
    uint32_t *ix = take(s, index, "index", K_UINT, 4, 1, writable, 0);
    if (ix == NULL)
        return NULL;
    if ((Py_ssize_t)(dim_of(s, ib, 0) / num_shards) != slots || dim_of(s, ib, 0) % num_shards != 0) {
        PyErr_Format(PyExc_ValueError, "index has %zd slots, expected num_shards * slots_per_region = %zd * %zd",
                     dim_of(s, ib, 0), num_shards, slots);
        return NULL;
    }
    return ix;
}

/* A row of `width` float cells holds dim weights, then the sign (two cells at key_col) and the
 * stamp (one cell at stamp_col) past them: -1 with ValueError if it cannot. */
static int row_layout_args(Py_ssize_t width, Py_ssize_t dim, Py_ssize_t key_col, Py_ssize_t stamp_col)
{
    if (dim < 1 || key_col < dim || key_col + 2 > width) {
        PyErr_Format(PyExc_ValueError, "rows of width %zd cannot hold dim %zd and a sign at column key_col %zd",
                     width, dim, key_col);
        return -1;
    }
    /* the stamp cell: inside the row, clear of the weights and of the sign */
    if (stamp_col < 0 || stamp_col >= width || stamp_col < dim || (stamp_col >= key_col && stamp_col < key_col + 2)) {
        PyErr_Format(PyExc_ValueError,
                     "stamp_col %zd must be a cell of the row (width %zd) past the %zd weights and off the sign at "
                     "key_col %zd", stamp_col, width, dim, key_col);
        return -1;
    }
    return 0;
}

/* Check and fill a table_view from (index, rows, num_shards, slots_per_region, key_col, dim). */
static int table_args(buf_set *s, table_view *t, PyObject *index, PyObject *rows, Py_ssize_t num_shards,
                      Py_ssize_t slots, Py_ssize_t key_col, Py_ssize_t stamp_col, Py_ssize_t dim,
                      unsigned long long salt, int writable)
{
    t->index = index_arg(s, index, num_shards, slots, writable);
    if (t->index == NULL)
        return -1;
    int rb = s->n;
    t->rows = take(s, rows, "rows", K_FLOAT, 4, 2, writable, 0);
    if (PyErr_Occurred())
        return -1;
    t->nrows = (uint64_t)dim_of(s, rb, 0);
    t->width = dim_of(s, rb, 1);
    if (row_layout_args(t->width, dim, key_col, stamp_col) < 0)
        return -1;
    if (t->nrows > (uint64_t)UINT32_MAX + 1) {
        PyErr_Format(PyExc_ValueError, "rows has %zd rows, more than uint32 row numbers address",
                     dim_of(s, rb, 0));
        return -1;
    }
    t->total_slots = (uint64_t)num_shards * (uint64_t)slots;
    t->slots = (uint64_t)slots;
    t->key_col = key_col;
    t->stamp_col = stamp_col;
    t->dim = dim;
    t->salt = (uint64_t)salt;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * locate: probe-and-gather
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    const uint64_t *signs;
    Py_ssize_t n;
    uint8_t *hit;
    float *out;         /* (n, dim) or NULL */
    int64_t *rows_out;  /* or NULL */
    int64_t *slots_out; /* or NULL */
    int64_t *home_out;  /* or NULL */
    int stamp;          /* stamp found rows with clock (a training lookup) */
    uint32_t clock;
} locate_job;

static int locate_loop(const table_view *t, const locate_job *j, Py_ssize_t *misses_out)
{
    const size_t row_bytes = (size_t)t->width * sizeof(float);
    const size_t out_bytes = (size_t)t->dim * sizeof(float);
    const Py_ssize_t n = j->n;
    Py_ssize_t misses = 0;
    uint64_t home[RING];
    uint32_t first[RING];
    /* stage 1: hash, home slot, prefetch the slot */
#define LOCATE_STAGE1(i)                                                                 \
    do {                                                                                 \
        const uint64_t h_ = fastrange(mix64(j->signs[(i)] ^ t->salt), t->total_slots);    \
        home[(i) & (RING - 1)] = h_;                                                     \
        PREFETCH_R(t->index + h_);                                                       \
    } while (0)
    /* stage 2: read the slot, prefetch the row it names (its stamp is in it) */
#define LOCATE_STAGE2(i)                                                                 \
    do {                                                                                 \
        const uint32_t r_ = t->index[home[(i) & (RING - 1)]];                            \
        first[(i) & (RING - 1)] = r_;                                                    \
        if (r_ >= FIRST_ROW && r_ < t->nrows)                                            \
            prefetch_span_r(t->rows + (size_t)r_ * (size_t)t->width, row_bytes);         \
    } while (0)
    for (Py_ssize_t i = 0; i < n && i < DIST1; i++)
        LOCATE_STAGE1(i);
    for (Py_ssize_t i = 0; i < n && i < DIST; i++)
        LOCATE_STAGE2(i);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + DIST1 < n)
            LOCATE_STAGE1(i + DIST1);
        if (i + DIST < n)
            LOCATE_STAGE2(i + DIST);
        /* stage 3: confirm the sign (probing on if needed), copy, stamp */
        const uint64_t hm = home[i & (RING - 1)];
        uint32_t r = 0;
        uint64_t slot = hm;
        const int found = probe(t, j->signs[i], hm, first[i & (RING - 1)], &r, &slot);
        if (found < 0)
            return ERR_CORRUPT_INDEX;
        j->hit[i] = (uint8_t)found;
        if (found) {
            if (j->out) {
                const float *src = t->rows + (size_t)r * (size_t)t->width;
                if (out_bytes == 64) /* dim 16: a fixed-size copy the compiler inlines, no libc call */
                    memcpy(j->out + (size_t)i * 16u, src, 64);
                else
                    memcpy(j->out + (size_t)i * (size_t)t->dim, src, out_bytes);
            }
            /* The stamp shares the row's lines, just read: an unconditional store (a test of
             * whether it already holds the clock was an unpredictable branch and cost more). */
            if (j->stamp)
                STORE_RELAXED(stamp_of(t, r), j->clock);
        } else {
            misses++;
            r = first[i & (RING - 1)]; /* as DimTable.locate: a miss keeps its home slot's value */
            if (j->out)
                memset(j->out + (size_t)i * (size_t)t->dim, 0, out_bytes);
        }
        if (j->rows_out)
            j->rows_out[i] = (int64_t)r;
        if (j->slots_out)
            j->slots_out[i] = (int64_t)slot;
        if (j->home_out)
            j->home_out[i] = (int64_t)hm;
    }
#undef LOCATE_STAGE1
#undef LOCATE_STAGE2
    *misses_out = misses;
    return ERR_NONE;
}

/*
 * The lookup's hot case (weights out, no positions): locate_loop specialised, with the row size and
 * the stamping known at compile time (dim 16 gets a fixed 64-byte copy), the common "found in its
 * home slot" case tested before the general probe, and the main loop free of end-of-batch checks.
 * Same results as locate_loop; profiling showed the lookup bound by instructions per ID once its
 * cache misses overlap (a table that fits in cache ran at the same ratio to numpy's gather).
 */
#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

/* 64 bytes as four 16-byte moves (a plain 64-byte memcpy became `rep movs` here, whose start-up
 * cost is most of a lookup's per-ID budget). */
static ALWAYS_INLINE void copy64(float *dst, const float *src)
{
    memcpy(dst, src, 16);
    memcpy(dst + 4, src + 4, 16);
    memcpy(dst + 8, src + 8, 16);
    memcpy(dst + 12, src + 12, 16);
}

static ALWAYS_INLINE int gather_body(const table_view *t, const locate_job *j, Py_ssize_t *misses_out,
                                     const size_t out_bytes, const int stamp)
{
    const size_t row_bytes = (size_t)t->width * sizeof(float);
    const size_t out_floats = out_bytes / sizeof(float);
    const Py_ssize_t n = j->n;
    const uint64_t *signs = j->signs;
    const uint64_t salt = t->salt, total = t->total_slots, nrows = t->nrows;
    const uint32_t *index = t->index;
    const float *rows = t->rows;
    const size_t width = (size_t)t->width;
    const size_t key_col = (size_t)t->key_col;
    const uint32_t clock = j->clock;
    float *out = j->out;
    uint8_t *hit = j->hit;
    Py_ssize_t misses = 0;
    uint64_t home[GRING];
    uint32_t first[GRING];
#define G_STAGE1(i)                                                                      \
    do {                                                                                 \
        const uint64_t h_ = fastrange(mix64(signs[(i)] ^ salt), total);                  \
        home[(i) & (GRING - 1)] = h_;                                                     \
        PREFETCH_R(index + h_);                                                          \
    } while (0)
#define G_STAGE2(i)                                                                      \
    do {                                                                                 \
        const uint32_t r_ = index[home[(i) & (GRING - 1)]];                               \
        first[(i) & (GRING - 1)] = r_;                                                    \
        if (r_ >= FIRST_ROW && r_ < nrows)                                               \
            prefetch_span_r(rows + (size_t)r_ * width, row_bytes);                       \
    } while (0)
#define G_STAGE3(i)                                                                      \
    do {                                                                                 \
        const uint64_t sg_ = signs[(i)];                                                 \
        uint32_t r_ = first[(i) & (GRING - 1)];                                           \
        int found_ = 0;                                                                  \
        if (r_ >= FIRST_ROW && r_ < nrows) {                                             \
            uint64_t st_;                                                                \
            memcpy(&st_, rows + (size_t)r_ * width + key_col, sizeof st_);               \
            found_ = st_ == sg_;                                                         \
        }                                                                                \
        if (!found_) {                                                                   \
            uint64_t slot_ = 0;                                                          \
            found_ = probe(t, sg_, home[(i) & (GRING - 1)], r_, &r_, &slot_);              \
            if (found_ < 0)                                                              \
                return ERR_CORRUPT_INDEX;                                                \
        }                                                                                \
        hit[(i)] = (uint8_t)found_;                                                      \
        if (found_) {                                                                    \
            const float *src_ = rows + (size_t)r_ * width;                               \
            if (out_bytes == 64)                                                         \
                copy64(out + (size_t)(i) * 16u, src_);                                   \
            else                                                                         \
                memcpy(out + (size_t)(i) * out_floats, src_, out_bytes);                 \
            if (stamp)                                                                   \
                STORE_RELAXED((uint32_t *)(src_ + t->stamp_col), clock);                 \
        } else {                                                                         \
            misses++;                                                                    \
            memset(out + (size_t)(i) * out_floats, 0, out_bytes);                        \
        }                                                                                \
    } while (0)
    Py_ssize_t i = 0;
    for (Py_ssize_t k = 0; k < n && k < GDIST1; k++)
        G_STAGE1(k);
    for (Py_ssize_t k = 0; k < n && k < GDIST; k++)
        G_STAGE2(k);
    for (; i + GDIST1 < n; i++) { /* main loop: every stage in range */
        G_STAGE1(i + GDIST1);
        G_STAGE2(i + GDIST);
        G_STAGE3(i);
    }
    for (; i < n; i++) { /* the last GDIST1 IDs */
        if (i + GDIST < n)
            G_STAGE2(i + GDIST);
        G_STAGE3(i);
    }
#undef G_STAGE1
#undef G_STAGE2
#undef G_STAGE3
    *misses_out = misses;
    return ERR_NONE;
}

static int gather_loop(const table_view *t, const locate_job *j, Py_ssize_t *misses_out)
{
    const size_t out_bytes = (size_t)t->dim * sizeof(float);
    if (out_bytes == 64)
        return j->stamp ? gather_body(t, j, misses_out, 64, 1) : gather_body(t, j, misses_out, 64, 0);
    return j->stamp ? gather_body(t, j, misses_out, out_bytes, 1) : gather_body(t, j, misses_out, out_bytes, 0);
}

static PyObject *raise_loop_error(int err)
{
    if (err == ERR_CORRUPT_INDEX)
        PyErr_SetString(PyExc_RuntimeError,
                        "index region has no empty slot or names a row past the table: invariant broken");
    else
        PyErr_SetString(PyExc_RuntimeError, "kernel failed");
    return NULL;
}

PyDoc_STRVAR(locate_doc,
"locate(index, rows, signs, num_shards, slots_per_region, key_col, stamp_col, dim, salt, hit,\n"
"       out=None, rows_out=None, slots_out=None, home_out=None, stamp=False, clock=0) -> misses\n\n"
"Find each sign's row: hit[i] tells whether it has one; out[i] (float32 (n, dim)) gets its\n"
"weights or zeros; rows_out / slots_out / home_out (int64) get what DimTable.locate returns;\n"
"with stamp, found rows get clock in their uint32 cell stamp_col. Returns the number of misses.");

static PyObject *k_locate(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"index", "rows", "signs", "num_shards", "slots_per_region", "key_col", "stamp_col",
                             "dim", "salt", "hit", "out", "rows_out", "slots_out", "home_out", "stamp", "clock", NULL};
    PyObject *index, *rows, *signs, *hit, *out = Py_None, *rows_out = Py_None, *slots_out = Py_None,
             *home_out = Py_None;
    Py_ssize_t num_shards, slots, key_col, stamp_col, dim;
    unsigned long long salt, clock = 0;
    int stamp = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOnnnnnKO|OOOOpK", kwlist, &index, &rows, &signs, &num_shards,
                                     &slots, &key_col, &stamp_col, &dim, &salt, &hit, &out, &rows_out, &slots_out,
                                     &home_out, &stamp, &clock))
        return NULL;
    buf_set s = {0};
    table_view t;
    locate_job j;
    memset(&j, 0, sizeof j);
    /* rows writable only when stamping */
    if (table_args(&s, &t, index, rows, num_shards, slots, key_col, stamp_col, dim, salt, stamp) < 0)
        goto fail;
    int sb = s.n;
    j.signs = take(&s, signs, "signs", K_UINT, 8, 1, 0, 0);
    if (PyErr_Occurred())
        goto fail;
    j.n = dim_of(&s, sb, 0);
    int hb = s.n;
    j.hit = take(&s, hit, "hit", K_BOOL, 1, 1, 1, 0);
    if (PyErr_Occurred() || expect_len(dim_of(&s, hb, 0), j.n, "hit", "elements") < 0)
        goto fail;
    int ob = s.n;
    j.out = take(&s, out, "out", K_FLOAT, 4, 2, 1, 1);
    if (PyErr_Occurred())
        goto fail;
    if (j.out && (expect_len(dim_of(&s, ob, 0), j.n, "out", "rows") < 0 ||
                  expect_len(dim_of(&s, ob, 1), dim, "out", "columns") < 0))
        goto fail;
    int64_t **outs[3] = {&j.rows_out, &j.slots_out, &j.home_out};
    PyObject *objs[3] = {rows_out, slots_out, home_out};
    const char *names[3] = {"rows_out", "slots_out", "home_out"};
    for (int q = 0; q < 3; q++) {
        int b = s.n;
        *outs[q] = take(&s, objs[q], names[q], K_INT, 8, 1, 1, 1);
        if (PyErr_Occurred())
            goto fail;
        if (*outs[q] && expect_len(dim_of(&s, b, 0), j.n, names[q], "elements") < 0)
            goto fail;
    }
    j.stamp = stamp;
    if (clock > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "clock %llu does not fit a uint32 stamp", clock);
        goto fail;
    }
    j.clock = (uint32_t)clock;

    Py_ssize_t misses = 0;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = (j.out && !j.rows_out && !j.slots_out && !j.home_out) ? gather_loop(&t, &j, &misses)
                                                                 : locate_loop(&t, &j, &misses);
    Py_END_ALLOW_THREADS
    release_all(&s);
    if (err != ERR_NONE)
        return raise_loop_error(err);
    return PyLong_FromSsize_t(misses);
fail:
    release_all(&s);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * update: probe-and-apply (optimizers.py, float32 operation by operation)
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    int code;
    int vectorwise;
    int has_momentum; /* as optimizers.py: momentum > 0 in double */
    int has_wd;
    int gsm_not_one;
    float lr, wd, eps, momentum, gsm, beta1, beta2, one_minus_beta1, one_minus_beta2;
    double lr_d, beta1_d, beta2_d;
    int clip;
    float bound;
} optimizer;

/* numpy's pairwise float32 sum (add.reduce over a contiguous row), so vectorwise Adagrad's mean
 * matches the numpy path. */
static float pairwise_sum(const float *a, Py_ssize_t n)
{
    if (n < 8) {
        float res = 0.0f;
        for (Py_ssize_t i = 0; i < n; i++)
            res += a[i];
        return res;
    }
    if (n <= 128) {
        float r[8];
        Py_ssize_t i;
        for (int k = 0; k < 8; k++)
            r[k] = a[k];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int k = 0; k < 8; k++)
                r[k] += a[i + k];
        float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += a[i];
        return res;
    }
    Py_ssize_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

/* Adam's bias corrections depend on a row's own step count t; rows of a batch share few values
 * of t, so the two pow() calls per row are memoized (exactly: same t, same result). */
#define ADAM_CACHE 64
typedef struct {
    float t[ADAM_CACHE];
    float step_size[ADAM_CACHE];
    float bc2_sqrt[ADAM_CACHE];
} adam_cache;

static inline void adam_factors_of(const optimizer *o, float t, float *step_size, float *bc2_sqrt)
{
    const double td = (double)t; /* in double, as numpy: float32(lr / (1 - beta1**t)) */
    *step_size = (float)(o->lr_d / (1.0 - pow(o->beta1_d, td)));
    *bc2_sqrt = (float)sqrt(1.0 - pow(o->beta2_d, td));
}

static inline void adam_factors(const optimizer *o, adam_cache *c, float t, float *step_size, float *bc2_sqrt)
{
    if (!(t >= 1.0f && t <= 16777216.0f)) { /* not a step count (state from elsewhere): no cache */
        adam_factors_of(o, t, step_size, bc2_sqrt);
        return;
    }
    const unsigned slot = (unsigned)((uint32_t)t % ADAM_CACHE);
    if (c->t[slot] != t) { /* the cache starts zeroed and t >= 1 here: no stale match */
        adam_factors_of(o, t, &c->step_size[slot], &c->bc2_sqrt[slot]);
        c->t[slot] = t;
    }
    *step_size = c->step_size[slot];
    *bc2_sqrt = c->bc2_sqrt[slot];
}

/*
 * One step on one row: w (dim weights), s (its state), g_in (its gradient); g is 2*dim floats of
 * scratch. Each line mirrors optimizers.py in the same float32 operation order (the loops
 * vectorize; IEEE sqrt and division are correctly rounded in every lane, so results match numpy
 * bit for bit).
 */
static inline void step_row(const optimizer *o, adam_cache *ac, float *restrict w, float *restrict s,
                            const float *restrict g_in, float *restrict g, Py_ssize_t dim)
{
    if (o->has_wd) {
        const float wd = o->wd;
        for (Py_ssize_t k = 0; k < dim; k++)
            g[k] = g_in[k] + wd * w[k];
    } else {
        memcpy(g, g_in, (size_t)dim * sizeof(float));
    }
    const float lr = o->lr;
    switch (o->code) {
    case OPT_SGD:
        if (o->has_momentum) {
            const float mom = o->momentum;
            for (Py_ssize_t k = 0; k < dim; k++) {
                const float b = s[k] * mom + g[k]; /* two roundings: -ffp-contract=off */
                s[k] = b;
                w[k] = w[k] - lr * b;
            }
        } else {
            for (Py_ssize_t k = 0; k < dim; k++)
                w[k] = w[k] - lr * g[k];
        }
        break;
    case OPT_ADAGRAD: {
        const float eps = o->eps, gsm = o->gsm;
        if (o->vectorwise) {
            float *restrict sq = g + dim; /* the second half of the scratch */
            for (Py_ssize_t k = 0; k < dim; k++)
                sq[k] = g[k] * g[k];
            const float mean = pairwise_sum(sq, dim) / (float)dim;
            float st = s[0];
            if (o->gsm_not_one)
                st = st * gsm;
            st = st + mean;
            s[0] = st;
            const float d = sqrtf(st) + eps;
            for (Py_ssize_t k = 0; k < dim; k++)
                w[k] = w[k] - (g[k] / d) * lr;
        } else {
            if (o->gsm_not_one) {
                for (Py_ssize_t k = 0; k < dim; k++)
                    s[k] = s[k] * gsm;
            }
            for (Py_ssize_t k = 0; k < dim; k++) {
                const float st = s[k] + g[k] * g[k];
                s[k] = st;
                w[k] = w[k] - (g[k] / (sqrtf(st) + eps)) * lr;
            }
        }
        break;
    }
    case OPT_ADAM: {
        float *restrict m = s;
        float *restrict v = s + dim;
        const float t = s[2 * dim] + 1.0f; /* per-row count of steps that had a gradient */
        s[2 * dim] = t;
        const float b1 = o->beta1, b2 = o->beta2, c1 = o->one_minus_beta1, c2 = o->one_minus_beta2, eps = o->eps;
        for (Py_ssize_t k = 0; k < dim; k++) {
            m[k] = m[k] * b1 + c1 * g[k];
            v[k] = v[k] * b2 + c2 * (g[k] * g[k]);
        }
        float step_size, bc2_sqrt;
        adam_factors(o, ac, t, &step_size, &bc2_sqrt);
        for (Py_ssize_t k = 0; k < dim; k++)
            w[k] = w[k] - (m[k] / (sqrtf(v[k]) / bc2_sqrt + eps)) * step_size;
        break;
    }
    }
    if (o->clip) {
        const float lo = -o->bound, hi = o->bound;
        for (Py_ssize_t k = 0; k < dim; k++) {
            float x = w[k];
            x = x < lo ? lo : x; /* NaN stays NaN, as np.clip */
            x = x > hi ? hi : x;
            w[k] = x;
        }
    }
}

typedef struct {
    const uint64_t *signs;
    Py_ssize_t n;
    const float *grads; /* (n, dim) */
    float *state;
    Py_ssize_t state_width;
    uint8_t *hit; /* (n,) */
    float *gbuf;  /* 2*dim floats of scratch */
    uint32_t *scratch;
    uint64_t scratch_len; /* a power of two >= 2n, or 0: no check for repeated signs */
} update_job;

/*
 * Whether signs[0..n) may hold a sign twice: a set of 32-bit fingerprints of the hashes in `set`
 * (len a power of two >= 2n; a rare fingerprint collision only sends the caller to its exact
 * path). Set lookups are prefetched ahead: for big batches the set outgrows the caches.
 */
static int find_repeat(const uint64_t *q, Py_ssize_t n, uint64_t salt, uint32_t *set, uint64_t len)
{
    memset(set, 0, (size_t)len * sizeof(uint32_t));
    const uint64_t mask = len - 1;
    uint64_t hashes[RING];
    for (Py_ssize_t i = 0; i < n && i < DIST1; i++) {
        hashes[i & (RING - 1)] = mix64(q[i] ^ salt);
        PREFETCH_W(set + ((hashes[i & (RING - 1)] >> 32) & mask));
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + DIST1 < n) {
            const uint64_t ha = mix64(q[i + DIST1] ^ salt);
            hashes[(i + DIST1) & (RING - 1)] = ha;
            PREFETCH_W(set + ((ha >> 32) & mask));
        }
        const uint64_t h = hashes[i & (RING - 1)];
        const uint32_t fp = (uint32_t)h | 1u;
        uint64_t p = (h >> 32) & mask;
        for (;;) {
            const uint32_t cur = set[p];
            if (cur == 0) {
                set[p] = fp;
                break;
            }
            if (cur == fp)
                return 1;
            p = (p + 1) & mask;
        }
    }
    return 0;
}

static int update_loop(const table_view *t, const optimizer *o, const update_job *j, Py_ssize_t *missing,
                       Py_ssize_t *promoted)
{
    const Py_ssize_t dim = t->dim;
    const Py_ssize_t m = j->n;
    const size_t row_bytes = (size_t)t->width * sizeof(float);
    const size_t state_bytes = (size_t)j->state_width * sizeof(float);
    Py_ssize_t miss = 0, moved = 0;
    uint64_t home[RING];
    uint32_t first[RING];
    adam_cache ac;
    memset(&ac, 0, sizeof ac);
    /* stage 1: hash, home slot, prefetch the slot (gradients are read in order) */
#define UPDATE_STAGE1(i)                                                                  \
    do {                                                                                  \
        const uint64_t h_ = fastrange(mix64(j->signs[(i)] ^ t->salt), t->total_slots);    \
        home[(i) & (RING - 1)] = h_;                                                      \
        PREFETCH_R(t->index + h_);                                                        \
    } while (0)
    /* stage 2: read the slot, prefetch the row and state it names, for writing */
#define UPDATE_STAGE2(i)                                                                  \
    do {                                                                                  \
        const uint32_t r_ = t->index[home[(i) & (RING - 1)]];                             \
        first[(i) & (RING - 1)] = r_;                                                     \
        if (r_ >= FIRST_ROW && r_ < t->nrows) {                                           \
            prefetch_span_w(t->rows + (size_t)r_ * (size_t)t->width, row_bytes);          \
            if (state_bytes)                                                              \
                prefetch_span_w(j->state + (size_t)r_ * (size_t)j->state_width, state_bytes); \
        }                                                                                 \
    } while (0)
    for (Py_ssize_t i = 0; i < m && i < DIST1; i++)
        UPDATE_STAGE1(i);
    for (Py_ssize_t i = 0; i < m && i < DIST; i++)
        UPDATE_STAGE2(i);
    for (Py_ssize_t i = 0; i < m; i++) {
        if (i + DIST1 < m)
            UPDATE_STAGE1(i + DIST1);
        if (i + DIST < m)
            UPDATE_STAGE2(i + DIST);
        /* stage 3: confirm the sign (probing on if needed), step, clip, promote */
        const Py_ssize_t p = i;
        const uint64_t hm = home[i & (RING - 1)];
        uint32_t r = 0;
        uint64_t slot = hm;
        const int found = probe(t, j->signs[p], hm, first[i & (RING - 1)], &r, &slot);
        if (found < 0)
            return ERR_CORRUPT_INDEX;
        j->hit[p] = (uint8_t)found;
        if (!found) {
            miss++;
            continue;
        }
        step_row(o, &ac, t->rows + (size_t)r * (size_t)t->width, j->state + (size_t)r * (size_t)j->state_width,
                 j->grads + (size_t)p * (size_t)dim, j->gbuf, dim);
        if (slot != hm) {
            /* DimTable.promote: swap with the home slot's occupant when that one is less recently
             * used (a swap inside one probe chain keeps every sign reachable) */
            const uint32_t occ = t->index[hm];
            if (occ != SLOT_EMPTY && occ < t->nrows && *stamp_of(t, occ) < *stamp_of(t, r)) {
                t->index[hm] = r;
                t->index[slot] = occ;
                moved++;
            }
        }
    }
#undef UPDATE_STAGE1
#undef UPDATE_STAGE2
    *missing = miss;
    *promoted = moved;
    return ERR_NONE;
}

static Py_ssize_t expected_state_width(const optimizer *o, Py_ssize_t dim)
{
    switch (o->code) {
    case OPT_SGD: return o->has_momentum ? dim : 0;
    case OPT_ADAGRAD: return o->vectorwise ? 1 : dim;
    default: return 2 * dim + 1;
    }
}

/* The optimizer of an update or replay call (the keyword arguments of kernels.optimizer_args);
 * -1 with ValueError for an unknown code. */
static int optimizer_of(optimizer *o, int code, double lr, double wd, double eps, double momentum, double gsm,
                        double beta1, double beta2, int vectorwise, double bound)
{
    if (code != OPT_SGD && code != OPT_ADAGRAD && code != OPT_ADAM) {
        PyErr_Format(PyExc_ValueError, "code must be 1 (SGD), 2 (Adagrad) or 3 (Adam), got %d", code);
        return -1;
    }
    memset(o, 0, sizeof *o);
    o->code = code;
    o->vectorwise = vectorwise;
    o->has_momentum = momentum > 0.0;
    o->has_wd = wd != 0.0;
    o->gsm_not_one = gsm != 1.0;
    o->lr = (float)lr;
    o->wd = (float)wd;
    o->eps = (float)eps;
    o->momentum = (float)momentum;
    o->gsm = (float)gsm;
    o->beta1 = (float)beta1;
    o->beta2 = (float)beta2;
    o->one_minus_beta1 = (float)(1.0 - beta1);
    o->one_minus_beta2 = (float)(1.0 - beta2);
    o->lr_d = lr;
    o->beta1_d = beta1;
    o->beta2_d = beta2;
    o->clip = bound > 0.0;
    o->bound = (float)bound;
    return 0;
}

PyDoc_STRVAR(update_doc,
"update(index, rows, state, signs, grads, num_shards, slots_per_region, key_col, stamp_col, dim, salt,\n"
"       code, lr, weight_decay, eps, momentum, g_square_momentum, beta1, beta2, vectorwise,\n"
"       weight_bound, hit, gbuf, scratch=None) -> (may_repeat, missing, promoted)\n\n"
"Apply one optimizer step (code 1 SGD, 2 Adagrad, 3 Adam) to the rows of signs with gradients\n"
"grads (float32 (n, dim)), clip to weight_bound (when > 0), promote rows found away from home,\n"
"and set hit[i] when signs[i] has a row. gbuf: 2*dim float32 of scratch. With scratch (uint32,\n"
"a power of two >= 2n) the signs are first checked for repeats: when one may repeat, nothing is\n"
"changed and (True, 0, 0) is returned, so the caller sums their gradients first.");

static PyObject *k_update(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"index", "rows", "state", "signs", "grads", "num_shards",
                             "slots_per_region", "key_col", "stamp_col", "dim", "salt", "code", "lr", "weight_decay", "eps",
                             "momentum", "g_square_momentum", "beta1", "beta2", "vectorwise", "weight_bound", "hit",
                             "gbuf", "scratch", NULL};
    PyObject *index, *rows, *state, *signs, *grads, *hit, *gbuf, *scratch = Py_None;
    Py_ssize_t num_shards, slots, key_col, stamp_col, dim;
    unsigned long long salt;
    int code, vectorwise;
    double lr, wd, eps, momentum, gsm, beta1, beta2, bound;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOnnnnnKidddddddpdOO|O", kwlist, &index, &rows, &state,
                                     &signs, &grads, &num_shards, &slots, &key_col, &stamp_col, &dim, &salt,
                                     &code, &lr, &wd, &eps, &momentum, &gsm, &beta1, &beta2, &vectorwise, &bound,
                                     &hit, &gbuf, &scratch))
        return NULL;
    optimizer o;
    if (optimizer_of(&o, code, lr, wd, eps, momentum, gsm, beta1, beta2, vectorwise, bound) < 0)
        return NULL;

    buf_set s = {0};
    table_view t;
    update_job j;
    memset(&j, 0, sizeof j);
    if (table_args(&s, &t, index, rows, num_shards, slots, key_col, stamp_col, dim, salt, 1) < 0)
        goto fail;
    int stb = s.n;
    j.state = take(&s, state, "state", K_FLOAT, 4, 2, 1, 0);
    if (PyErr_Occurred())
        goto fail;
    j.state_width = dim_of(&s, stb, 1);
    if (expect_len(dim_of(&s, stb, 0), (Py_ssize_t)t.nrows, "state", "rows") < 0 ||
        expect_len(j.state_width, expected_state_width(&o, dim), "state", "columns for this optimizer") < 0)
        goto fail;
    int gb = s.n;
    j.signs = take(&s, signs, "signs", K_UINT, 8, 1, 0, 0);
    if (PyErr_Occurred())
        goto fail;
    j.n = dim_of(&s, gb, 0);
    int grb = s.n;
    j.grads = take(&s, grads, "grads", K_FLOAT, 4, 2, 0, 0);
    if (PyErr_Occurred())
        goto fail;
    if (expect_len(dim_of(&s, grb, 0), j.n, "grads", "rows") < 0 ||
        expect_len(dim_of(&s, grb, 1), dim, "grads", "columns") < 0)
        goto fail;
    int hb = s.n;
    j.hit = take(&s, hit, "hit", K_BOOL, 1, 1, 1, 0);
    if (PyErr_Occurred() || expect_len(dim_of(&s, hb, 0), j.n, "hit", "elements") < 0)
        goto fail;
    int bb = s.n;
    j.gbuf = take(&s, gbuf, "gbuf", K_FLOAT, 4, 1, 1, 0);
    if (PyErr_Occurred() || expect_len(dim_of(&s, bb, 0), 2 * dim, "gbuf", "elements") < 0)
        goto fail;
    int scb = s.n;
    j.scratch = take(&s, scratch, "scratch", K_UINT, 4, 1, 1, 1);
    if (PyErr_Occurred())
        goto fail;
    if (j.scratch) {
        const Py_ssize_t len = dim_of(&s, scb, 0);
        if (len < 2 * j.n || len < 1 || (len & (len - 1)) != 0) {
            PyErr_Format(PyExc_ValueError, "scratch must hold a power of two >= 2 * %zd elements, got %zd", j.n,
                         len);
            goto fail;
        }
        j.scratch_len = (uint64_t)len;
    }

    int err = ERR_NONE, repeat;
    Py_ssize_t missing = 0, promoted = 0;
    Py_BEGIN_ALLOW_THREADS
    repeat = j.scratch_len ? find_repeat(j.signs, j.n, t.salt, j.scratch, j.scratch_len) : 0;
    if (!repeat)
        err = update_loop(&t, &o, &j, &missing, &promoted);
    Py_END_ALLOW_THREADS
    release_all(&s);
    if (err != ERR_NONE)
        return raise_loop_error(err);
    return Py_BuildValue("(Onn)", repeat ? Py_True : Py_False, missing, promoted);
fail:
    release_all(&s);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * replay: an NN worker's own missed update, stepped onto its copy of a looked-up table
 * (persia.nn_worker.replay.correct_table)
 * ------------------------------------------------------------------------------------------- */

/*
 * Merge the update's sorted signs with the table's sorted signs; each sign found at position p,
 * live there and whose replica had not applied the update, gets one step of its gradient on
 * rows[p] / state[p] and touched[p] = 1. Returns the row-steps, or -ERR_*.
 */
static Py_ssize_t replay_loop(const optimizer *o, float *rows, float *state, Py_ssize_t width, const uint64_t *signs,
                              Py_ssize_t n, const uint16_t *replica, const uint8_t *live, const uint8_t *done,
                              Py_ssize_t replicas, const uint64_t *usigns, const float *ugrads, Py_ssize_t m,
                              uint8_t *touched, float *gbuf, Py_ssize_t dim)
{
    adam_cache ac;
    memset(&ac, 0, sizeof ac);
    Py_ssize_t steps = 0, p = 0;
    for (Py_ssize_t i = 0; i < m && p < n; i++) {
        const uint64_t u = usigns[i];
        if (i > 0 && u <= usigns[i - 1])
            return -ERR_UNSORTED;
        while (p < n && signs[p] < u) {
            if (p + 1 < n && signs[p + 1] <= signs[p])
                return -ERR_UNSORTED;
            p++;
        }
        if (p == n || signs[p] != u || (live && !live[p]))
            continue;
        const uint16_t r = replica[p];
        if (r >= replicas)
            return -ERR_REPLICA;
        if (done[r])
            continue;
        step_row(o, &ac, rows + (size_t)p * (size_t)dim, state + (size_t)p * (size_t)width,
                 ugrads + (size_t)i * (size_t)dim, gbuf, dim);
        touched[p] = 1;
        steps++;
    }
    return steps;
}

PyDoc_STRVAR(replay_doc,
"replay(rows, state, signs, replica, live, done, usigns, ugrads, touched, gbuf, code, lr, weight_decay,\n"
"       eps, momentum, g_square_momentum, beta1, beta2, vectorwise, weight_bound, release_gil=False)\n"
"       -> row_steps\n\n"
"One missed update on a looked-up table, in place: rows (float32 (n, dim)) and state (float32\n"
"(n, width)) at the positions whose signs (uint64 (n,), sorted, distinct) occur in usigns (uint64\n"
"(m,), sorted, distinct), that are live (uint8 (n,) or None) and whose replica (uint16 (n,)) is\n"
"not marked in done (uint8 (replicas,)), take one optimizer step with their row of ugrads\n"
"(float32 (m, dim)) and are marked in touched (uint8 (n,)). gbuf: 2*dim float32 of scratch.\n"
"release_gil: step without the GIL (no other thread may touch these arrays meanwhile).");

static PyObject *k_replay(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"rows", "state", "signs", "replica", "live", "done", "usigns", "ugrads", "touched",
                             "gbuf", "code", "lr", "weight_decay", "eps", "momentum", "g_square_momentum", "beta1",
                             "beta2", "vectorwise", "weight_bound", "release_gil", NULL};
    PyObject *rows, *state, *signs, *replica, *live, *done, *usigns, *ugrads, *touched, *gbuf;
    int code, vectorwise, release_gil = 0;
    double lr, wd, eps, momentum, gsm, beta1, beta2, bound;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOOOOidddddddpd|p", kwlist, &rows, &state, &signs, &replica,
                                     &live, &done, &usigns, &ugrads, &touched, &gbuf, &code, &lr, &wd, &eps,
                                     &momentum, &gsm, &beta1, &beta2, &vectorwise, &bound, &release_gil))
        return NULL;
    optimizer o;
    if (optimizer_of(&o, code, lr, wd, eps, momentum, gsm, beta1, beta2, vectorwise, bound) < 0)
        return NULL;
    buf_set s = {0};
    float *w = take(&s, rows, "rows", K_FLOAT, 4, 2, 1, 0);
    if (PyErr_Occurred())
        goto fail;
    const Py_ssize_t n = dim_of(&s, 0, 0), dim = dim_of(&s, 0, 1);
    float *st = take(&s, state, "state", K_FLOAT, 4, 2, 1, 0);
    if (PyErr_Occurred() || expect_len(dim_of(&s, 1, 0), n, "state", "rows") < 0 ||
        expect_len(dim_of(&s, 1, 1), expected_state_width(&o, dim), "state", "columns for this optimizer") < 0)
        goto fail;
    const Py_ssize_t width = dim_of(&s, 1, 1);
    const uint64_t *q = take(&s, signs, "signs", K_UINT, 8, 1, 0, 0);
    if (PyErr_Occurred() || expect_len(dim_of(&s, 2, 0), n, "signs", "elements") < 0)
        goto fail;
    const uint16_t *rep = take(&s, replica, "replica", K_UINT, 2, 1, 0, 0);
    if (PyErr_Occurred() || expect_len(dim_of(&s, 3, 0), n, "replica", "elements") < 0)
        goto fail;
    int lb = s.n;
    const uint8_t *lv = take(&s, live, "live", K_BOOL, 1, 1, 0, 1);
    if (PyErr_Occurred() || (lv && expect_len(dim_of(&s, lb, 0), n, "live", "elements") < 0))
        goto fail;
    int db = s.n;
    const uint8_t *dn = take(&s, done, "done", K_BOOL, 1, 1, 0, 0);
    if (PyErr_Occurred())
        goto fail;
    const Py_ssize_t replicas = dim_of(&s, db, 0);
    int ub = s.n;
    const uint64_t *uq = take(&s, usigns, "usigns", K_UINT, 8, 1, 0, 0);
    if (PyErr_Occurred())
        goto fail;
    const Py_ssize_t m = dim_of(&s, ub, 0);
    int gb = s.n;
    const float *ug = take(&s, ugrads, "ugrads", K_FLOAT, 4, 2, 0, 0);
    if (PyErr_Occurred() || expect_len(dim_of(&s, gb, 0), m, "ugrads", "rows") < 0 ||
        expect_len(dim_of(&s, gb, 1), dim, "ugrads", "columns") < 0)
        goto fail;
    int tb = s.n;
    uint8_t *tc = take(&s, touched, "touched", K_BOOL, 1, 1, 1, 0);
    if (PyErr_Occurred() || expect_len(dim_of(&s, tb, 0), n, "touched", "elements") < 0)
        goto fail;
    int bb = s.n;
    float *g = take(&s, gbuf, "gbuf", K_FLOAT, 4, 1, 1, 0);
    if (PyErr_Occurred() || expect_len(dim_of(&s, bb, 0), 2 * dim, "gbuf", "elements") < 0)
        goto fail;
    /* On the training thread the GIL is kept: a call is tens of microseconds, and handing the GIL
     * away that briefly cost throughput (another thread takes it and the training thread waits
     * for it back: 16,960 against 17,600 samples/s in three interleaved pairs). A lookup thread's
     * replay (release_gil) hands it to the training thread instead: there it was the largest
     * share of the GIL the NN worker's helper threads held. */
    Py_ssize_t steps;
    if (release_gil) {
        Py_BEGIN_ALLOW_THREADS
        steps = replay_loop(&o, w, st, width, q, n, rep, lv, dn, replicas, uq, ug, m, tc, g, dim);
        Py_END_ALLOW_THREADS
    } else {
        steps = replay_loop(&o, w, st, width, q, n, rep, lv, dn, replicas, uq, ug, m, tc, g, dim);
    }
    release_all(&s);
    if (steps == -ERR_UNSORTED) { /* named as correct_table's fields: its caller sees these */
        PyErr_SetString(PyExc_ValueError, "field 'signs': signs and the update's signs must be sorted and distinct");
        return NULL;
    }
    if (steps == -ERR_REPLICA) {
        PyErr_Format(PyExc_ValueError, "field 'replica': a replica index is not below len(applied) = %zd", replicas);
        return NULL;
    }
    return PyLong_FromSsize_t(steps);
fail:
    release_all(&s);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * partition and sign_hash
 * ------------------------------------------------------------------------------------------- */

/* ---------------------------------------------------------------------------------------------
 * insert: new entries into the index
 * ------------------------------------------------------------------------------------------- */

PyDoc_STRVAR(insert_doc,
"insert(index, hashes, rows, num_shards, slots_per_region) -> reused\n\n"
"Put each absent entry (hashes[i], rows[i]) in the first EMPTY or TOMBSTONE slot of its probe\n"
"sequence (home slot from the hash's high 32 bits, linear, wrapping inside its region). Home\n"
"slots are claimed first, last entry first, so a free home slot goes to the last entry whose home\n"
"it is, as in index.py's insert (last writer wins); the rest then probe on. Rows must be\n"
"distinct. Returns how many tombstones were reused. Every row number is checked before any slot\n"
"is written; a region without a free slot is a RuntimeError (a broken invariant).");

static PyObject *k_insert(PyObject *self, PyObject *args)
{
    PyObject *index, *hashes, *rows;
    Py_ssize_t num_shards, slots;
    if (!PyArg_ParseTuple(args, "OOOnn", &index, &hashes, &rows, &num_shards, &slots))
        return NULL;
    buf_set s = {0};
    uint32_t *ix = index_arg(&s, index, num_shards, slots, 1);
    if (ix == NULL)
        goto fail;
    const uint64_t *h = take(&s, hashes, "hashes", K_UINT, 8, 1, 0, 0);
    if (PyErr_Occurred())
        goto fail;
    const int64_t *r = take(&s, rows, "rows", K_INT, 8, 1, 0, 0);
    if (PyErr_Occurred())
        goto fail;
    const Py_ssize_t n = dim_of(&s, 1, 0);
    if (expect_len(dim_of(&s, 2, 0), n, "rows", "elements") < 0)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (r[i] < (int64_t)FIRST_ROW || r[i] > (int64_t)UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "rows[%zd] = %lld is not a row number (%u..%u)", i, (long long)r[i],
                         FIRST_ROW, UINT32_MAX);
            goto fail;
        }
    }
    Py_ssize_t reused = 0, full = -1;
    Py_BEGIN_ALLOW_THREADS
    const uint64_t total = (uint64_t)num_shards * (uint64_t)slots, m = (uint64_t)slots;
    /* pass 1, home slots only, last entry first: a free home slot goes to the last entry whose
     * home it is, never to an entry probing past its own (numpy's first round) */
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        if (i >= DIST)
            PREFETCH_W(ix + fastrange(h[i - DIST], total));
        const uint64_t p = fastrange(h[i], total);
        if (ix[p] <= SLOT_TOMBSTONE) {
            reused += ix[p] == SLOT_TOMBSTONE;
            ix[p] = (uint32_t)r[i];
        }
    }
    /* pass 2: the others (their home slot holds another row) probe on from it */
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        uint64_t p = fastrange(h[i], total);
        if (ix[p] == (uint32_t)r[i])
            continue;
        const uint64_t region_end = (p / m + 1) * m;
        uint64_t step = 0;
        while (ix[p] > SLOT_TOMBSTONE && step < m) {
            step++;
            if (++p == region_end)
                p -= m;
        }
        if (step == m) {
            full = i;
            break;
        }
        reused += ix[p] == SLOT_TOMBSTONE;
        ix[p] = (uint32_t)r[i];
    }
    Py_END_ALLOW_THREADS
    if (full >= 0) {
        PyErr_Format(PyExc_RuntimeError, "index region is full: invariant broken (entry %zd)", full);
        goto fail;
    }
    release_all(&s);
    return PyLong_FromSsize_t(reused);
fail:
    release_all(&s);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * init_rows: new rows with their initial values
 * ------------------------------------------------------------------------------------------- */

PyDoc_STRVAR(init_rows_doc,
"init_rows(rows, state, at, signs, dim, key_col, stamp_col, stamp, lower, upper, seed_salt, state_init) -> None\n\n"
"Write row at[i] whole for signs[i]: weight j = float32(lower + (upper - lower) * u) with u the top\n"
"53 bits of mix64(mix64(sign ^ seed_salt) ^ j * golden) over 2**53 (hashing.uniform_from_signs, in\n"
"the same double arithmetic), zeros in the other cells, the sign at key_col, stamp at stamp_col,\n"
"and every state cell = state_init. Every row number is checked before anything is written.");

static PyObject *k_init_rows(PyObject *self, PyObject *args)
{
    PyObject *rows, *state, *at, *signs;
    Py_ssize_t dim, key_col, stamp_col;
    unsigned long long stamp, seed_salt;
    double lower, upper;
    float state_init;
    if (!PyArg_ParseTuple(args, "OOOOnnnKddKf", &rows, &state, &at, &signs, &dim, &key_col, &stamp_col, &stamp,
                          &lower, &upper, &seed_salt, &state_init))
        return NULL;
    buf_set s = {0};
    float *w = take(&s, rows, "rows", K_FLOAT, 4, 2, 1, 0);
    if (PyErr_Occurred())
        goto fail;
    float *st = take(&s, state, "state", K_FLOAT, 4, 2, 1, 0);
    if (PyErr_Occurred())
        goto fail;
    const int64_t *g = take(&s, at, "at", K_INT, 8, 1, 0, 0);
    if (PyErr_Occurred())
        goto fail;
    const uint64_t *q = take(&s, signs, "signs", K_UINT, 8, 1, 0, 0);
    if (PyErr_Occurred())
        goto fail;
    const Py_ssize_t nrows = dim_of(&s, 0, 0), width = dim_of(&s, 0, 1), sw = dim_of(&s, 1, 1);
    const Py_ssize_t m = dim_of(&s, 2, 0);
    if (expect_len(dim_of(&s, 3, 0), m, "signs", "elements") < 0 ||
        expect_len(dim_of(&s, 1, 0), nrows, "state", "rows") < 0)
        goto fail;
    if (row_layout_args(width, dim, key_col, stamp_col) < 0)
        goto fail;
    if (stamp > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "stamp %llu does not fit a uint32", stamp);
        goto fail;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (g[i] < (int64_t)FIRST_ROW || g[i] >= (int64_t)nrows) {
            PyErr_Format(PyExc_ValueError, "at[%zd] = %lld is not a row of the table (%u..%zd)", i, (long long)g[i],
                         FIRST_ROW, nrows - 1);
            goto fail;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    const double span = upper - lower, scale = 1.0 / 9007199254740992.0; /* 2**53 */
    for (Py_ssize_t i = 0; i < m; i++) {
        float *row = w + (size_t)g[i] * (size_t)width;
        const uint64_t base = mix64(q[i] ^ seed_salt);
        for (Py_ssize_t j = 0; j < dim; j++) {
            const uint64_t hj = mix64(base ^ ((uint64_t)j * 0x9E3779B97F4A7C15ULL));
            const double u = (double)(hj >> 11) * scale;
            row[j] = (float)(lower + span * u);
        }
        memset(row + dim, 0, (size_t)(width - dim) * sizeof(float));
        memcpy(row + key_col, &q[i], sizeof q[i]);
        const uint32_t st32 = (uint32_t)stamp;
        memcpy(row + stamp_col, &st32, sizeof st32);
        float *srow = st + (size_t)g[i] * (size_t)sw;
        for (Py_ssize_t j = 0; j < sw; j++)
            srow[j] = state_init;
    }
    Py_END_ALLOW_THREADS
    release_all(&s);
    Py_RETURN_NONE;
fail:
    release_all(&s);
    return NULL;
}

PyDoc_STRVAR(partition_doc,
"partition(signs, grads, num_shards, salt, bounds, signs_out, grads_out) -> None\n\n"
"Stable counting sort of a batch by internal shard: signs_out[bounds[k]:bounds[k+1]] (uint64)\n"
"and grads_out[...] (float32 (n, dim)) are the signs and gradients of shard k in batch order\n"
"(bounds: int64 (num_shards + 1,)). Reading the batch once in order and writing one stream per\n"
"shard lets each shard's update then read its gradients in order.");

static PyObject *k_partition(PyObject *self, PyObject *args)
{
    PyObject *signs, *grads, *bounds, *signs_out, *grads_out;
    Py_ssize_t num_shards;
    unsigned long long salt;
    if (!PyArg_ParseTuple(args, "OOnKOOO", &signs, &grads, &num_shards, &salt, &bounds, &signs_out, &grads_out))
        return NULL;
    if (num_shards < 1 || (uint64_t)num_shards > ((uint64_t)1 << 32)) {
        PyErr_Format(PyExc_ValueError, "num_shards must be in [1, 2**32], got %zd", num_shards);
        return NULL;
    }
    buf_set s = {0};
    const uint64_t *q = take(&s, signs, "signs", K_UINT, 8, 1, 0, 0);
    if (PyErr_Occurred())
        goto fail;
    const Py_ssize_t n = dim_of(&s, 0, 0);
    const float *g = take(&s, grads, "grads", K_FLOAT, 4, 2, 0, 0);
    if (PyErr_Occurred() || expect_len(dim_of(&s, 1, 0), n, "grads", "rows") < 0)
        goto fail;
    const Py_ssize_t dim = dim_of(&s, 1, 1);
    int64_t *b = take(&s, bounds, "bounds", K_INT, 8, 1, 1, 0);
    if (PyErr_Occurred() || expect_len(dim_of(&s, 2, 0), num_shards + 1, "bounds", "elements") < 0)
        goto fail;
    uint64_t *qo = take(&s, signs_out, "signs_out", K_UINT, 8, 1, 1, 0);
    if (PyErr_Occurred() || expect_len(dim_of(&s, 3, 0), n, "signs_out", "elements") < 0)
        goto fail;
    float *go = take(&s, grads_out, "grads_out", K_FLOAT, 4, 2, 1, 0);
    if (PyErr_Occurred() || expect_len(dim_of(&s, 4, 0), n, "grads_out", "rows") < 0 ||
        expect_len(dim_of(&s, 4, 1), dim, "grads_out", "columns") < 0)
        goto fail;
    Py_BEGIN_ALLOW_THREADS
    const uint64_t ns = (uint64_t)num_shards;
    const size_t row_bytes = (size_t)dim * sizeof(float);
    memset(b, 0, (size_t)(num_shards + 1) * sizeof(int64_t));
    for (Py_ssize_t i = 0; i < n; i++)
        b[fastrange(mix64(q[i] ^ salt), ns) + 1]++;
    for (Py_ssize_t k = 0; k < num_shards; k++)
        b[k + 1] += b[k];
    /* b[k] is now shard k's start: use it as the cursor, then shift the ends back down */
    if (row_bytes == 64) { /* dim 16, the common case: a fixed-size copy the compiler inlines */
        for (Py_ssize_t i = 0; i < n; i++) {
            const int64_t at = b[fastrange(mix64(q[i] ^ salt), ns)]++;
            qo[at] = q[i];
            memcpy(go + (size_t)at * 16u, g + (size_t)i * 16u, 64);
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            const int64_t at = b[fastrange(mix64(q[i] ^ salt), ns)]++;
            qo[at] = q[i];
            memcpy(go + (size_t)at * (size_t)dim, g + (size_t)i * (size_t)dim, row_bytes);
        }
    }
    for (Py_ssize_t k = num_shards; k > 0; k--)
        b[k] = b[k - 1];
    b[0] = 0;
    Py_END_ALLOW_THREADS
    release_all(&s);
    Py_RETURN_NONE;
fail:
    release_all(&s);
    return NULL;
}

PyDoc_STRVAR(sign_hash_doc, "sign_hash(signs, salt, out) -> None\n\nout[i] = mix64(signs[i] ^ salt) (uint64).");

static PyObject *k_sign_hash(PyObject *self, PyObject *args)
{
    PyObject *signs, *out;
    unsigned long long salt;
    if (!PyArg_ParseTuple(args, "OKO", &signs, &salt, &out))
        return NULL;
    buf_set s = {0};
    const uint64_t *q = take(&s, signs, "signs", K_UINT, 8, 1, 0, 0);
    if (PyErr_Occurred())
        goto fail;
    uint64_t *h = take(&s, out, "out", K_UINT, 8, 1, 1, 0);
    if (PyErr_Occurred())
        goto fail;
    const Py_ssize_t n = dim_of(&s, 0, 0);
    if (expect_len(dim_of(&s, 1, 0), n, "out", "elements") < 0)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        h[i] = mix64(q[i] ^ salt);
    release_all(&s);
    Py_RETURN_NONE;
fail:
    release_all(&s);
    return NULL;
}

static PyMethodDef methods[] = {
    {"locate", (PyCFunction)(void (*)(void))k_locate, METH_VARARGS | METH_KEYWORDS, locate_doc},
    {"update", (PyCFunction)(void (*)(void))k_update, METH_VARARGS | METH_KEYWORDS, update_doc},
    {"replay", (PyCFunction)(void (*)(void))k_replay, METH_VARARGS | METH_KEYWORDS, replay_doc},
    {"partition", k_partition, METH_VARARGS, partition_doc},
    {"insert", k_insert, METH_VARARGS, insert_doc},
    {"init_rows", k_init_rows, METH_VARARGS, init_rows_doc},
    {"sign_hash", k_sign_hash, METH_VARARGS, sign_hash_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "Compiled probe-and-gather / probe-and-apply kernels of the embedding PS (see kernels.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    /* the interface kernels.py calls (kernels.ABI): 2 = the stamp is a cell of the row, 3 = replay,
     * 4 = replay's release_gil, 5 = insert and init_rows */
    if (PyModule_AddIntConstant(m, "PREFETCH_DISTANCE", DIST) < 0 || PyModule_AddIntConstant(m, "ABI", 5) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
