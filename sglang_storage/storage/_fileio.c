/* The file backend's hot paths, in C, with the GIL released.
 *
 * scan_files(path) lists the regular files of one directory (no link, no other kind)
 * with each one's size and allocated 512-byte blocks: the index rebuild's scan.
 *
 * read_requests(requests, layout) reads and verifies whole objects. requests is a list of
 * GetRequests (only their key.name, key.namespace, spec and buffers attributes are read:
 * a list or tuple of writable buffers for the payload); layout(namespace, spec) returns
 * (directory, head, tail) as bytes, called once per run of requests of one namespace and
 * spec. Each object's path is the directory, its fan ("xx/": the low byte of the name's
 * xxh32, as file._fan) and its name; the 512 bytes its header must hold, with the two
 * checksum fields (bytes 12-15 and 24-31) zero, are head, the name's length byte, the name
 * and tail, zero-filled (format.HeaderTemplate.expected). Building both here rather than in
 * Python saves about a microsecond per object on the calling thread, serial work that the
 * other core waits out. For each request it opens the path with openat2 (no
 * symbolic link anywhere on it, never blocking: a FIFO planted there must not hang the
 * reader), reads the header into its own buffer and the payload into the buffers (one
 * byte more than the object should have goes to a scratch byte, so trailing bytes are
 * seen), closes it, and, when exactly header + payload was read and the header is the
 * expected one, takes the payload's xxh3-64 while those bytes are still in this core's
 * cache and compares it with the header's. The GIL is released for the whole batch.
 * An object already in the page cache is read at once (preadv2 with RWF_NOWAIT; one over
 * 512 KiB in parts of 256 KiB, each hashed right after its read, so the hash finds its
 * bytes in this core's cache rather than in memory: 1 MiB warm gets about 25% faster); the
 * others of each window of up to 64 objects and about 4 MiB are all handed to the disk
 * first (readahead) and then read in order, so a cold batch keeps many disk reads in
 * flight instead of one, without asking for so much at once that the first read waits
 * behind all of it (64 objects of 1 MiB read back about 10% slower here).
 *
 * It returns (codes, details): codes is a bytes object, one code per request; details maps
 * the index of each item whose code is not VERIFIED to (got, inode, errno, header,
 * digest), header being the bytes read into the header (up to 512) and digest the
 * payload's checksum, or None when it was not taken (a header or size that is not the
 * expected one). The codes:
 *
 *   READ        0  a regular file whose bytes are not the expected object: the caller
 *                  says why (a header that differs, a size, a checksum mismatch)
 *   MISSING     1  no file (ENOENT)
 *   LINK        2  a symbolic link on the path (ELOOP, EXDEV or ENOTDIR)
 *   NOT_REGULAR 3  something other than a regular file; nothing was read
 *   FAILED      4  an open, stat or read failed with errno ``error``
 *   NO_OPENAT2  5  this kernel (or a seccomp filter) refuses openat2: the caller's
 *                  component-by-component open is needed; nothing was done
 *   VERIFIED    6  the expected header and payload: the buffers hold the payload
 *
 * write_objects(items, (file_mode, exact, dir_mode, dir_exact), sync) writes whole objects.
 * Each item is a tuple (directory, name, temporary path, buffers, expected): the object's
 * directory, its file name, a fresh temporary path and the 512-byte expected header as
 * above. For each, with the GIL released for the whole batch, it opens the directory (no
 * link on its path; a missing last component, a fan directory, is made), checks nothing
 * is at the name yet, fills the header's two checksums, creates the temporary file
 * exclusively (no link followed), locks it while it is written (what tells a cleanup it
 * is live), writes header and payload, fsyncs it when sync, and renames it into place.
 * It returns bytes, one code per item: STORED (0), or RETRY (1) for anything else (a file
 * or anything already at the name, a missing namespace directory, any error; a temporary
 * file is then removed), which the caller does again on its own path, the same work as
 * file.py's _put, which says what happened.
 *
 * Buffers of an item that is not VERIFIED may hold some of the file's bytes: the caller
 * clears them. It is the same work as file.py's _read_raw and _verify, which stay for
 * kernels without openat2 and builds without this module. xxhash.h (libxxhash-dev) is
 * compiled in, so the module needs no library at run time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

/* xxh3 compiled in (SSE2 or better, as the compiler targets): no library at run time.
 * On x86-64 an AVX2 build of its long-input loop is compiled in too, and taken where the
 * CPU has AVX2 (hash_avx2 below): 48 against 19 GB/s here on 256 KiB. That uses the
 * header's own dispatch hooks (XXH_DISPATCH_AVX2, as its xxh_x86dispatch.c does) and
 * internal functions, so only with the xxhash.h release it was written against. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__AVX2__)
#include <immintrin.h>
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#endif
#define XXH_INLINE_ALL
#include <xxhash.h>
#if defined(XXH_DISPATCH_AVX2) && XXH_VERSION_NUMBER == 801
#define HASH_AVX2 1
#endif

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#define RESOLVE_NO_SYMLINKS_ 0x04
#define MAX_IOV 1024
#define WINDOW 64 /* objects whose disk reads are in flight together, at most */
#define WINDOW_BYTES (4LL << 20) /* and bytes: once reached, the window's reads begin */
#define CHUNK (256LL << 10) /* cached objects over twice this are read and hashed in parts */
#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008
#endif

enum {
    READ = 0,
    MISSING = 1,
    LINK = 2,
    NOT_REGULAR = 3,
    FAILED = 4,
    NO_OPENAT2 = 5,
    VERIFIED = 6
};

struct open_how_ {
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};

#define HEADER_SIZE 512
/* The format's integers are little-endian, and the checksums are copied as they are. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "_fileio.c assumes a little-endian machine; the Python paths run elsewhere"
#endif
#define CRC_AT 12
#define DIGEST_AT 24

typedef struct {
    const char *path;
    const unsigned char *expected; /* HEADER_SIZE bytes */
    struct iovec *iov;             /* header, the payload's buffers, the scratch byte */
    Py_ssize_t count;
    const struct iovec *payload;   /* the payload's buffers, as read_all does not move them */
    Py_ssize_t buffers;
    long long payload_bytes;       /* the payload's length */
    int code;
    int error;
    long long got;
    unsigned long long inode;
    uint64_t digest;
    int digested;                  /* whether digest was taken */
    unsigned char header[HEADER_SIZE];
    unsigned char trailer;
} Item;

/* Read into iov[0..count) from offset 0 until full, or until the file ends. */
static long long read_all(int fd, struct iovec *iov, Py_ssize_t count, int *error) {
    long long total = 0;
    Py_ssize_t first = 0;
    while (first < count) {
        int batch = (int)(count - first < MAX_IOV ? count - first : MAX_IOV);
        size_t asked = 0;
        for (int i = 0; i < batch; i++) {
            asked += iov[first + i].iov_len;
        }
        ssize_t got = preadv(fd, iov + first, batch, (off_t)total);
        if (got < 0) {
            if (errno == EINTR) {
                continue;
            }
            *error = errno;
            return -1;
        }
        total += got;
        /* Short means the file's end, unless Linux capped the call (MAX_RW_COUNT). */
        if (got == 0 || ((size_t)got < asked && got < 0x7FFFF000)) {
            break;
        }
        /* Step past what was read; a partly filled buffer continues where it stopped. */
        size_t left = (size_t)got;
        while (first < count && left >= iov[first].iov_len) {
            left -= iov[first].iov_len;
            first++;
        }
        if (left > 0) {
            iov[first].iov_base = (char *)iov[first].iov_base + left;
            iov[first].iov_len -= left;
        }
    }
    return total;
}

/* Whether the header read is the expected one in every byte but the two checksums. */
static int header_matches(const Item *item) {
    const unsigned char *got = item->header, *want = item->expected;
    return memcmp(got, want, CRC_AT) == 0 &&
           memcmp(got + CRC_AT + 4, want + CRC_AT + 4, DIGEST_AT - CRC_AT - 4) == 0 &&
           memcmp(got + DIGEST_AT + 8, want + DIGEST_AT + 8, HEADER_SIZE - DIGEST_AT - 8) == 0;
}

/* Whether the AVX2 xxh3 loop is used; set once, when the module loads. */
static int use_avx2 = 0;

#ifdef HASH_AVX2
/* XXH3_64bits and XXH3_64bits_update with the AVX2 loop: the same hash, bit for bit (the
 * short-input paths and the final stripes are scalar either way). */
static XXH_TARGET_AVX2 uint64_t hash_avx2(const void *input, size_t len) {
    if (len <= XXH3_MIDSIZE_MAX) {
        return XXH3_64bits(input, len);
    }
    return XXH3_hashLong_64b_internal(input, len, XXH3_kSecret, sizeof(XXH3_kSecret),
                                      XXH3_accumulate_512_avx2, XXH3_scrambleAcc_avx2);
}

static XXH_TARGET_AVX2 void update_avx2(XXH3_state_t *state, const void *input, size_t len) {
    (void)XXH3_update(state, (const xxh_u8 *)input, len, XXH3_accumulate_512_avx2,
                      XXH3_scrambleAcc_avx2);
}
#endif

/* The xxh3-64 of input[0..len), with the fastest loop this CPU runs. */
static uint64_t hash(const void *input, size_t len, int avx2) {
#ifdef HASH_AVX2
    if (avx2) {
        return hash_avx2(input, len);
    }
#endif
    (void)avx2;
    return XXH3_64bits(input, len);
}

/* XXH3_64bits_update with the fastest loop this CPU runs. */
static void hash_update(XXH3_state_t *state, const void *input, size_t len, int avx2) {
#ifdef HASH_AVX2
    if (avx2) {
        update_avx2(state, input, len);
        return;
    }
#endif
    (void)avx2;
    (void)XXH3_64bits_update(state, input, len);
}

/* The xxh3-64 of the concatenation of payload[0..n). */
static uint64_t digest_with(const struct iovec *payload, Py_ssize_t n, int avx2) {
    if (n == 1) {
        return hash(payload[0].iov_base, payload[0].iov_len, avx2);
    }
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    for (Py_ssize_t i = 0; i < n; i++) {
        hash_update(&state, payload[i].iov_base, payload[i].iov_len, avx2);
    }
    return XXH3_64bits_digest(&state);
}

static uint64_t digest_of(const struct iovec *payload, Py_ssize_t n) {
    return digest_with(payload, n, use_avx2);
}

/* Verify what was read; ``streamed`` is the payload's digest when the read took it
 * already (``have_streamed``), else it is taken here. */
static void verify_with(Item *item, int have_streamed, uint64_t streamed) {
    if (item->got != HEADER_SIZE + item->payload_bytes || !header_matches(item)) {
        return; /* READ: the caller says what differs */
    }
    uint64_t recorded;
    memcpy(&recorded, item->header + DIGEST_AT, sizeof(recorded));
    uint64_t digest = have_streamed ? streamed : digest_of(item->payload, item->buffers);
    item->digest = digest;
    item->digested = 1;
    if (digest == recorded) {
        item->code = VERIFIED;
    }
}

static void verify(Item *item) {
    verify_with(item, 0, 0);
}

/* Open ``item``'s path (no link on it, never blocking) and check it is a regular file:
 * its descriptor, or -1 with the item's code set. */
static int open_one(Item *item, long long *size) {
    struct open_how_ how = {(uint64_t)(O_RDONLY | O_NONBLOCK | O_CLOEXEC), 0,
                            RESOLVE_NO_SYMLINKS_};
    long fd;
    do {
        fd = syscall(SYS_openat2, AT_FDCWD, item->path, &how, sizeof(how));
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        int code = errno;
        if (code == ENOENT) {
            item->code = MISSING;
        } else if (code == ELOOP || code == EXDEV || code == ENOTDIR) {
            item->code = LINK;
        } else if (code == ENOSYS || code == EPERM) {
            item->code = NO_OPENAT2;
        } else {
            item->code = FAILED;
            item->error = code;
        }
        return -1;
    }
    struct stat status;
    if (fstat((int)fd, &status) != 0) {
        item->code = FAILED;
        item->error = errno;
    } else {
        item->inode = (unsigned long long)status.st_ino;
        if (S_ISREG(status.st_mode)) {
            *size = (long long)status.st_size;
            return (int)fd;
        }
        item->code = NOT_REGULAR;
    }
    close((int)fd);
    return -1;
}

/* The bytes an item's read takes at most: header, payload and the scratch byte. */
static long long room_of(const Item *item, long long size) {
    long long room = HEADER_SIZE + item->payload_bytes + 1;
    return size < room ? size : room;
}

/* Whether preadv2 takes RWF_NOWAIT here; only ever goes from 1 to 0 (a benign race). */
static int nowait_works = 1;

/* The payload bytes of one read's iovecs ``part[0..n)``, which start at file offset
 * ``offset``, added to ``state``: the bytes between the header and the scratch byte. */
static void hash_payload(XXH3_state_t *state, const Item *item, const struct iovec *part,
                         int n, long long offset) {
    long long end = HEADER_SIZE + item->payload_bytes;
    for (int k = 0; k < n; k++) {
        long long from = offset, to = offset + (long long)part[k].iov_len;
        long long lo = from < HEADER_SIZE ? HEADER_SIZE : from;
        long long hi = to > end ? end : to;
        if (lo < hi) {
            hash_update(state, (const char *)part[k].iov_base + (lo - from), (size_t)(hi - lo),
                        use_avx2);
        }
        offset = to;
    }
}

/* read_cached for a large object: RWF_NOWAIT reads of at most CHUNK bytes, each part's
 * payload hashed right after its read, while it is still in this core's cache (a whole
 * object hashed after its read would come back from memory). 1 when done, 0 when some of
 * it is not cached (the blocking read then reads it all again). */
static int read_cached_in_chunks(Item *item, int fd, long long room) {
    struct iovec part[MAX_IOV];
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    long long offset = 0;
    Py_ssize_t index = 0; /* the next bytes: item->iov[index], from ``within`` on */
    size_t within = 0;
    while (offset < room) {
        long long want = room - offset < CHUNK ? room - offset : CHUNK;
        long long asked = 0;
        int n = 0;
        while (asked < want && index < item->count && n < MAX_IOV) {
            size_t take = item->iov[index].iov_len - within;
            if ((long long)take > want - asked) {
                take = (size_t)(want - asked);
            }
            part[n].iov_base = (char *)item->iov[index].iov_base + within;
            part[n].iov_len = take;
            n++;
            asked += (long long)take;
            within += take;
            if (within == item->iov[index].iov_len) {
                index++;
                within = 0;
            }
        }
        ssize_t got = preadv2(fd, part, n, (off_t)offset, RWF_NOWAIT);
        if (got < 0) {
            if (errno == EOPNOTSUPP || errno == EINVAL || errno == ENOSYS) {
                nowait_works = 0;
            }
            return 0;
        }
        if (got != asked) {
            return 0; /* partly cached, or changed under the read */
        }
        hash_payload(&state, item, part, n, offset);
        offset += asked;
    }
    item->code = READ;
    item->got = offset;
    verify_with(item, 1, XXH3_64bits_digest(&state));
    return 1;
}

/* Read the whole object in one preadv2 that takes only what is in the page cache and
 * verify it: 1 when done, 0 when (some of) it must come from the disk. The iovecs are
 * left as they were (preadv2 does not move them). */
static int read_cached(Item *item, int fd, long long size) {
    if (!nowait_works || item->count > MAX_IOV) {
        return 0;
    }
    long long room = room_of(item, size);
    if (room > 2 * CHUNK) {
        return read_cached_in_chunks(item, fd, room);
    }
    ssize_t got = preadv2(fd, item->iov, (int)item->count, 0, RWF_NOWAIT);
    if (got < 0) {
        if (errno == EOPNOTSUPP || errno == EINVAL || errno == ENOSYS) {
            nowait_works = 0;
        }
        return 0; /* EAGAIN: not cached; any other error, the blocking read reports */
    }
    if (got != room) {
        return 0; /* partly cached */
    }
    item->code = READ;
    item->got = got;
    verify(item);
    return 1;
}

/* Read the object from the disk (blocking) and verify it. */
static void read_blocking(Item *item, int fd) {
    int error = 0;
    long long got = read_all(fd, item->iov, item->count, &error);
    if (got < 0) {
        item->code = FAILED;
        item->error = error;
    } else {
        item->code = READ;
        item->got = got;
        verify(item);
    }
}

/* Read and verify every item. Objects in the page cache are read and verified at once;
 * the others of a window (WINDOW objects, or fewer once WINDOW_BYTES are asked for) are
 * first all asked of the disk (readahead), then read in order, so the disk works on many
 * at a time instead of one. */
static void read_items(Item *items, Py_ssize_t n) {
    int fds[WINDOW];
    int refused = 0;
    Py_ssize_t end;
    for (Py_ssize_t start = 0; start < n; start = end) {
        end = n - start < WINDOW ? n : start + WINDOW;
        long long asked = 0;
        for (Py_ssize_t i = start; i < end; i++) {
            if (asked >= WINDOW_BYTES) {
                end = i;
                break;
            }
            Item *item = &items[i];
            long long size = 0;
            fds[i - start] = -1;
            if (refused) {
                item->code = NO_OPENAT2;
                continue;
            }
            int fd = open_one(item, &size);
            if (fd < 0) {
                refused = item->code == NO_OPENAT2;
                continue;
            }
            if (read_cached(item, fd, size)) {
                close(fd);
                continue;
            }
            (void)readahead(fd, 0, (size_t)room_of(item, size));
            asked += room_of(item, size);
            fds[i - start] = fd;
        }
        for (Py_ssize_t i = start; i < end; i++) {
            if (fds[i - start] >= 0) {
                read_blocking(&items[i], fds[i - start]);
                close(fds[i - start]);
            }
        }
    }
}

/* The caller's buffers of a batch, held (PyObject_GetBuffer) while the GIL is released,
 * and the iovecs that point into them (with the slots between, for headers and the like). */
typedef struct {
    Py_buffer *views;
    Py_ssize_t held;
    struct iovec *iov;
} Held;

/* Room for ``total`` iovecs; -1 with MemoryError set. */
static int held_alloc(Held *held, Py_ssize_t total) {
    size_t room = total > 0 ? (size_t)total : 1;
    held->views = PyMem_Calloc(room, sizeof(Py_buffer));
    held->iov = PyMem_Calloc(room, sizeof(struct iovec));
    held->held = 0;
    if (held->views == NULL || held->iov == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Hold each buffer of ``buffers`` (a list or tuple) as iov[*slot...]; adds their bytes to
 * ``*bytes``. -1 with the buffer error set. */
static int held_take(Held *held, Py_ssize_t *slot, PyObject *buffers, int flags,
                     long long *bytes) {
    PyObject **items = PySequence_Fast_ITEMS(buffers);
    Py_ssize_t count = PySequence_Fast_GET_SIZE(buffers);
    for (Py_ssize_t j = 0; j < count; j++) {
        Py_buffer *view = &held->views[held->held];
        if (PyObject_GetBuffer(items[j], view, flags | PyBUF_C_CONTIGUOUS) != 0) {
            return -1;
        }
        held->held++;
        held->iov[*slot].iov_base = view->buf;
        held->iov[*slot].iov_len = (size_t)view->len;
        *bytes += view->len;
        (*slot)++;
    }
    return 0;
}

static void held_release(Held *held) {
    for (Py_ssize_t k = 0; k < held->held; k++) {
        PyBuffer_Release(&held->views[k]);
    }
    PyMem_Free(held->views);
    PyMem_Free(held->iov);
}

/* The number of buffers in ``buffers`` (a list or tuple), or -1 with TypeError set. */
static Py_ssize_t buffer_count(PyObject *buffers, Py_ssize_t i) {
    if (PyList_CheckExact(buffers)) {
        return PyList_GET_SIZE(buffers);
    }
    if (PyTuple_CheckExact(buffers)) {
        return PyTuple_GET_SIZE(buffers);
    }
    PyErr_Format(PyExc_TypeError, "item %zd's buffers must be a list or tuple", i);
    return -1;
}

static PyObject *details_of(const Item *items, Py_ssize_t n, PyObject **codes_out) {
    PyObject *codes = PyBytes_FromStringAndSize(NULL, n);
    PyObject *details = PyDict_New();
    if (codes == NULL || details == NULL) {
        Py_XDECREF(codes);
        Py_XDECREF(details);
        return NULL;
    }
    char *code_bytes = PyBytes_AS_STRING(codes);
    for (Py_ssize_t i = 0; i < n; i++) {
        const Item *item = &items[i];
        code_bytes[i] = (char)item->code;
        if (item->code == VERIFIED) {
            continue;
        }
        Py_ssize_t header_got = item->got < HEADER_SIZE ? (item->got < 0 ? 0 : item->got)
                                                        : HEADER_SIZE;
        PyObject *key = PyLong_FromSsize_t(i);
        PyObject *digest = item->digested ? PyLong_FromUnsignedLongLong(item->digest) : Py_None;
        if (!item->digested) {
            Py_INCREF(Py_None);
        }
        PyObject *row = digest == NULL ? NULL
                                       : Py_BuildValue("(LKiy#O)", item->got, item->inode,
                                                       item->error, (const char *)item->header,
                                                       header_got, digest);
        Py_XDECREF(digest);
        if (key == NULL || row == NULL || PyDict_SetItem(details, key, row) != 0) {
            Py_XDECREF(key);
            Py_XDECREF(row);
            Py_DECREF(codes);
            Py_DECREF(details);
            return NULL;
        }
        Py_DECREF(key);
        Py_DECREF(row);
    }
    *codes_out = codes;
    return details;
}

/* One request's parts, looked up with the GIL held before the batch is read. */
typedef struct {
    PyObject *buffers;   /* borrowed: the request holds it */
    const char *name;    /* the key's name, UTF-8 (the str holds it) */
    Py_ssize_t name_len;
    Py_ssize_t group;    /* which layout (in ``groups``) its namespace and spec have */
} Source;

static PyObject *s_key, *s_spec, *s_buffers, *s_namespace, *s_name;

/* ``attribute`` of ``owner`` as a borrowed reference: ``owner`` (a frozen request or key,
 * alive for the whole call) holds it. NULL with the error set. */
static PyObject *borrowed_attr(PyObject *owner, PyObject *attribute) {
    PyObject *value = PyObject_GetAttr(owner, attribute);
    Py_XDECREF(value);
    return value;
}

/* What ``layout(namespace, spec)`` gave, checked: (directory, head, tail), all bytes,
 * the header's parts at most HEADER_SIZE bytes. -1 with TypeError or ValueError set. */
static int check_layout(PyObject *group) {
    if (!PyTuple_CheckExact(group) || PyTuple_GET_SIZE(group) != 3 ||
        !PyBytes_CheckExact(PyTuple_GET_ITEM(group, 0)) ||
        !PyBytes_CheckExact(PyTuple_GET_ITEM(group, 1)) ||
        !PyBytes_CheckExact(PyTuple_GET_ITEM(group, 2))) {
        PyErr_SetString(PyExc_TypeError,
                        "read_requests: layout must return (directory, head, tail), all bytes");
        return -1;
    }
    PyObject *directory = PyTuple_GET_ITEM(group, 0);
    if ((Py_ssize_t)strlen(PyBytes_AS_STRING(directory)) != PyBytes_GET_SIZE(directory)) {
        PyErr_SetString(PyExc_ValueError, "read_requests: a directory holds a NUL byte");
        return -1;
    }
    if (PyBytes_GET_SIZE(PyTuple_GET_ITEM(group, 1)) + PyBytes_GET_SIZE(PyTuple_GET_ITEM(group, 2)) >
        HEADER_SIZE) {
        PyErr_SetString(PyExc_ValueError, "read_requests: head and tail exceed a header");
        return -1;
    }
    return 0;
}

/* The header the object called ``name`` must have, checksums zero: head, the name's
 * length byte, the name, tail, zeros to HEADER_SIZE; all zeros (which no stored header
 * is) when that does not fit, as format.HeaderTemplate.expected. */
static void expected_header(unsigned char *out, PyObject *group, const char *name,
                            Py_ssize_t name_len) {
    PyObject *head = PyTuple_GET_ITEM(group, 1), *tail = PyTuple_GET_ITEM(group, 2);
    Py_ssize_t head_len = PyBytes_GET_SIZE(head), tail_len = PyBytes_GET_SIZE(tail);
    memset(out, 0, HEADER_SIZE);
    if (name_len > 255 || head_len + 1 + name_len + tail_len > HEADER_SIZE) {
        return;
    }
    memcpy(out, PyBytes_AS_STRING(head), (size_t)head_len);
    out[head_len] = (unsigned char)name_len;
    memcpy(out + head_len + 1, name, (size_t)name_len);
    memcpy(out + head_len + 1 + name_len, PyBytes_AS_STRING(tail), (size_t)tail_len);
}

static PyObject *read_requests(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *requests, *layout;
    if (!PyArg_ParseTuple(args, "O!O:read_requests", &PyList_Type, &requests, &layout)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(requests);
    size_t room = n > 0 ? (size_t)n : 1;
    Item *items = PyMem_Calloc(room, sizeof(Item));
    Source *sources = PyMem_Calloc(room, sizeof(Source));
    unsigned char *expected = PyMem_Malloc(room * HEADER_SIZE);
    PyObject *groups = PyList_New(0);
    char *paths = NULL;
    Py_ssize_t views_total = 0;
    size_t paths_bytes = 0;
    PyObject *result = NULL;
    Held held = {NULL, 0, NULL};
    struct iovec *pristine = NULL;
    PyObject *last_namespace = NULL, *last_spec = NULL;
    if (items == NULL || sources == NULL || expected == NULL || groups == NULL) {
        if (groups != NULL) {
            PyErr_NoMemory();
        }
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *request = PyList_GET_ITEM(requests, i);
        Source *source = &sources[i];
        PyObject *key = borrowed_attr(request, s_key);
        PyObject *spec = key == NULL ? NULL : borrowed_attr(request, s_spec);
        PyObject *buffers = spec == NULL ? NULL : borrowed_attr(request, s_buffers);
        PyObject *name = buffers == NULL ? NULL : borrowed_attr(key, s_name);
        PyObject *namespace = name == NULL ? NULL : borrowed_attr(key, s_namespace);
        if (namespace == NULL) {
            goto done;
        }
        if (!PyUnicode_Check(name)) {
            PyErr_Format(PyExc_TypeError, "read_requests: request %zd's key name is not a str", i);
            goto done;
        }
        source->name = PyUnicode_AsUTF8AndSize(name, &source->name_len);
        if (source->name == NULL) {
            goto done;
        }
        if ((Py_ssize_t)strlen(source->name) != source->name_len) {
            PyErr_Format(PyExc_ValueError, "read_requests: request %zd's key name holds a NUL", i);
            goto done;
        }
        Py_ssize_t count = buffer_count(buffers, i);
        if (count < 0) {
            goto done;
        }
        if (namespace != last_namespace || spec != last_spec) {
            PyObject *group = PyObject_CallFunctionObjArgs(layout, namespace, spec, NULL);
            if (group == NULL) {
                goto done;
            }
            int bad = check_layout(group) != 0 || PyList_Append(groups, group) != 0;
            Py_DECREF(group);
            if (bad) {
                goto done;
            }
            last_namespace = namespace;
            last_spec = spec;
        }
        source->group = PyList_GET_SIZE(groups) - 1;
        source->buffers = buffers;
        views_total += count + 2;
        /* directory, the fan ("xx/"), the name and its NUL */
        paths_bytes += (size_t)PyBytes_GET_SIZE(
                           PyTuple_GET_ITEM(PyList_GET_ITEM(groups, source->group), 0)) +
                       3 + (size_t)source->name_len + 1;
    }
    paths = PyMem_Malloc(paths_bytes > 0 ? paths_bytes : 1);
    if (paths == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (held_alloc(&held, views_total) != 0) {
        goto done;
    }
    struct iovec *iov = held.iov;
    pristine = PyMem_Calloc(views_total > 0 ? (size_t)views_total : 1, sizeof(struct iovec));
    if (pristine == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    static const char hex[] = "0123456789abcdef";
    char *at = paths;
    Py_ssize_t slot = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const Source *source = &sources[i];
        PyObject *group = PyList_GET_ITEM(groups, source->group);
        PyObject *directory = PyTuple_GET_ITEM(group, 0);
        Item *item = &items[i];
        /* The path: directory, the fan (the low byte of the name's xxh32, as file._fan),
         * then the name. */
        unsigned fan = XXH32(source->name, (size_t)source->name_len, 0) & 0xFFu;
        item->path = at;
        memcpy(at, PyBytes_AS_STRING(directory), (size_t)PyBytes_GET_SIZE(directory));
        at += PyBytes_GET_SIZE(directory);
        *at++ = hex[fan >> 4];
        *at++ = hex[fan & 0xFu];
        *at++ = '/';
        memcpy(at, source->name, (size_t)source->name_len);
        at += source->name_len;
        *at++ = '\0';
        expected_header(expected + (size_t)i * HEADER_SIZE, group, source->name,
                        source->name_len);
        item->expected = expected + (size_t)i * HEADER_SIZE;
        Py_ssize_t count = PySequence_Fast_GET_SIZE(source->buffers);
        item->iov = iov + slot;
        item->count = count + 2;
        item->payload = pristine + slot + 1;
        item->buffers = count;
        iov[slot].iov_base = item->header;
        iov[slot].iov_len = HEADER_SIZE;
        slot++;
        if (held_take(&held, &slot, source->buffers, PyBUF_WRITABLE, &item->payload_bytes) != 0) {
            goto done;
        }
        iov[slot].iov_base = &item->trailer;
        iov[slot].iov_len = 1;
        slot++;
    }
    memcpy(pristine, iov, (size_t)views_total * sizeof(struct iovec));
    /* Paths and headers are this call's; the buffers are held (held_take). */
    Py_BEGIN_ALLOW_THREADS
    read_items(items, n);
    Py_END_ALLOW_THREADS
    PyObject *codes = NULL;
    PyObject *details = details_of(items, n, &codes);
    if (details != NULL) {
        result = PyTuple_Pack(2, codes, details);
        Py_DECREF(codes);
        Py_DECREF(details);
    }
done:
    held_release(&held);
    PyMem_Free(pristine);
    PyMem_Free(paths);
    Py_XDECREF(groups);
    PyMem_Free(expected);
    PyMem_Free(sources);
    PyMem_Free(items);
    return result;
}

/* ------------------------------------------------------------------ writes */

enum { STORED = 0, RETRY = 1 };

typedef struct {
    const char *dir;
    const char *name;
    const char *tmp;
    struct iovec *iov; /* header, then the payload's buffers */
    Py_ssize_t count;
    unsigned char header[HEADER_SIZE];
    int code;
} Write;

/* Write iov[0..count) whole (writev writes less only when interrupted or out of room). */
static int write_all(int fd, struct iovec *iov, Py_ssize_t count) {
    Py_ssize_t first = 0;
    while (first < count) {
        int batch = (int)(count - first < MAX_IOV ? count - first : MAX_IOV);
        ssize_t put = writev(fd, iov + first, batch);
        if (put < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        size_t left = (size_t)put;
        while (first < count && left >= iov[first].iov_len) {
            left -= iov[first].iov_len;
            first++;
        }
        if (left > 0) {
            iov[first].iov_base = (char *)iov[first].iov_base + left;
            iov[first].iov_len -= left;
        }
    }
    return 0;
}

static long open_no_links(const char *path, uint64_t flags, uint64_t mode) {
    struct open_how_ how = {flags | O_CLOEXEC, mode, RESOLVE_NO_SYMLINKS_};
    long fd;
    do {
        fd = syscall(SYS_openat2, AT_FDCWD, path, &how, sizeof(how));
    } while (fd < 0 && errno == EINTR);
    return fd;
}

/* The object's directory, made if only its last component is missing (a fan directory
 * under an existing namespace: ``dir_mode``, exactly when ``dir_exact``); -1 if it is
 * not there or cannot be opened or made. */
static long open_dir(const char *dir, int dir_mode, int dir_exact) {
    long fd = open_no_links(dir, O_RDONLY | O_DIRECTORY, 0);
    if (fd >= 0 || errno != ENOENT) {
        return fd;
    }
    const char *slash = strrchr(dir, '/');
    char parent[PATH_MAX];
    size_t length = slash == NULL ? 0 : (size_t)(slash - dir);
    if (length == 0 || length >= sizeof(parent)) {
        return -1;
    }
    memcpy(parent, dir, length);
    parent[length] = '\0';
    long parent_fd = open_no_links(parent, O_RDONLY | O_DIRECTORY, 0);
    if (parent_fd < 0) {
        return -1;
    }
    int created = mkdirat((int)parent_fd, slash + 1, (mode_t)dir_mode) == 0;
    if (!created && errno != EEXIST) {
        close((int)parent_fd);
        return -1;
    }
    fd = openat((int)parent_fd, slash + 1, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    close((int)parent_fd);
    if (fd >= 0 && created && dir_exact && fchmod((int)fd, (mode_t)dir_mode) != 0) {
        close((int)fd);
        return -1;
    }
    return fd;
}

/* The header (the expected one with its checksums filled in), then the object written to
 * its temporary file (locked while it is written), fsync'ed if asked, and renamed into
 * place. Anything unusual (no directory, a file already there, any error) is RETRY:
 * the caller's own path then does that object and says what happened. */
static void write_one(Write *item, const int *modes, int sync) {
    int mode = modes[0], exact = modes[1];
    long dir_fd = open_dir(item->dir, modes[2], modes[3]);
    if (dir_fd < 0) {
        return;
    }
    struct stat status;
    if (fstatat((int)dir_fd, item->name, &status, AT_SYMLINK_NOFOLLOW) == 0 || errno != ENOENT) {
        close((int)dir_fd); /* something is there: the caller checks what */
        return;
    }
    uint64_t digest = digest_of(item->iov + 1, item->count - 1);
    memcpy(item->header + DIGEST_AT, &digest, sizeof(digest));
    uint32_t crc = XXH32(item->header, HEADER_SIZE, 0);
    memcpy(item->header + CRC_AT, &crc, sizeof(crc));
    long fd = open_no_links(item->tmp, O_WRONLY | O_CREAT | O_EXCL, (uint64_t)mode);
    if (fd < 0) {
        close((int)dir_fd);
        return;
    }
    int ok = 1;
    /* Locked from its creation until it has its final name: the lock says it is live
     * (a filesystem without locks has none to take). A checker that opened it between
     * the create and the lock has removed it. */
    if (flock((int)fd, LOCK_EX | LOCK_NB) != 0 && errno != EOPNOTSUPP && errno != ENOLCK &&
        errno != EINVAL && errno != ENOSYS) {
        ok = 0;
    }
    if (ok && (fstat((int)fd, &status) != 0 || status.st_nlink == 0)) {
        ok = 0;
    }
    ok = ok && (!exact || fchmod((int)fd, (mode_t)mode) == 0);
    ok = ok && write_all((int)fd, item->iov, item->count) == 0;
    ok = ok && (!sync || fsync((int)fd) == 0);
    ok = ok && renameat(AT_FDCWD, item->tmp, (int)dir_fd, item->name) == 0;
    if (!ok) {
        unlink(item->tmp);
    }
    close((int)fd);
    close((int)dir_fd);
    if (ok) {
        item->code = STORED;
    }
}

static PyObject *write_objects(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *items_arg;
    int modes[4], sync; /* file mode, exact, directory mode, exact */
    if (!PyArg_ParseTuple(args, "O!(ipip)p:write_objects", &PyList_Type, &items_arg, &modes[0],
                          &modes[1], &modes[2], &modes[3], &sync)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items_arg);
    Write *items = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Write));
    Py_ssize_t views_total = 0;
    Held held = {NULL, 0, NULL};
    PyObject *result = NULL;
    if (items == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(items_arg, i);
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5 ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(entry, 0)) ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(entry, 1)) ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(entry, 2)) ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(entry, 4))) {
            PyErr_Format(PyExc_TypeError,
                         "write_objects: item %zd must be a tuple (bytes directory, bytes name, "
                         "bytes temporary path, buffers, bytes expected header)",
                         i);
            goto done;
        }
        for (int k = 0; k < 3; k++) {
            PyObject *text = PyTuple_GET_ITEM(entry, k);
            if ((Py_ssize_t)strlen(PyBytes_AS_STRING(text)) != PyBytes_GET_SIZE(text)) {
                PyErr_Format(PyExc_ValueError, "write_objects: item %zd holds a NUL byte", i);
                goto done;
            }
        }
        if (PyBytes_GET_SIZE(PyTuple_GET_ITEM(entry, 4)) != HEADER_SIZE) {
            PyErr_Format(PyExc_ValueError, "write_objects: item %zd's header is not %d bytes", i,
                         HEADER_SIZE);
            goto done;
        }
        Py_ssize_t count = buffer_count(PyTuple_GET_ITEM(entry, 3), i);
        if (count < 0) {
            goto done;
        }
        views_total += count + 1;
    }
    if (held_alloc(&held, views_total) != 0) {
        goto done;
    }
    struct iovec *iov = held.iov;
    Py_ssize_t slot = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(items_arg, i);
        PyObject *buffers = PyTuple_GET_ITEM(entry, 3);
        Py_ssize_t count = PySequence_Fast_GET_SIZE(buffers);
        long long payload = 0;
        Write *item = &items[i];
        item->dir = PyBytes_AS_STRING(PyTuple_GET_ITEM(entry, 0));
        item->name = PyBytes_AS_STRING(PyTuple_GET_ITEM(entry, 1));
        item->tmp = PyBytes_AS_STRING(PyTuple_GET_ITEM(entry, 2));
        memcpy(item->header, PyBytes_AS_STRING(PyTuple_GET_ITEM(entry, 4)), HEADER_SIZE);
        item->code = RETRY;
        item->iov = iov + slot;
        item->count = count + 1;
        iov[slot].iov_base = item->header;
        iov[slot].iov_len = HEADER_SIZE;
        slot++;
        if (held_take(&held, &slot, buffers, PyBUF_SIMPLE, &payload) != 0) {
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        write_one(&items[i], modes, sync);
    }
    Py_END_ALLOW_THREADS
    result = PyBytes_FromStringAndSize(NULL, n);
    if (result != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyBytes_AS_STRING(result)[i] = (char)items[i].code;
        }
    }
done:
    held_release(&held);
    PyMem_Free(items);
    return result;
}

/* ------------------------------------------------------------------ scans */

typedef struct {
    char *names;          /* every name, each NUL-terminated, back to back */
    size_t names_used, names_size;
    long long *sizes;
    long long *blocks;
    Py_ssize_t count, room;
} Listing;

static int listing_add(Listing *listing, const char *name, long long size, long long blocks) {
    size_t length = strlen(name) + 1;
    if (listing->names_used + length > listing->names_size) {
        size_t grown = listing->names_size ? 2 * listing->names_size : 4096;
        while (grown < listing->names_used + length) {
            grown *= 2;
        }
        char *names = realloc(listing->names, grown);
        if (names == NULL) {
            return -1;
        }
        listing->names = names;
        listing->names_size = grown;
    }
    if (listing->count == listing->room) {
        Py_ssize_t room = listing->room ? 2 * listing->room : 256;
        long long *sizes = realloc(listing->sizes, (size_t)room * sizeof(long long));
        if (sizes == NULL) {
            return -1;
        }
        listing->sizes = sizes;
        long long *blocks_ = realloc(listing->blocks, (size_t)room * sizeof(long long));
        if (blocks_ == NULL) {
            return -1;
        }
        listing->blocks = blocks_;
        listing->room = room;
    }
    memcpy(listing->names + listing->names_used, name, length);
    listing->names_used += length;
    listing->sizes[listing->count] = size;
    listing->blocks[listing->count] = blocks;
    listing->count++;
    return 0;
}

/* Fill ``listing`` with the regular files of ``path``; 0, or an errno. */
static int list_dir(const char *path, Listing *listing) {
    int dir_fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd < 0) {
        return errno;
    }
    DIR *dir = fdopendir(dir_fd);
    if (dir == NULL) {
        int code = errno;
        close(dir_fd);
        return code;
    }
    int code = 0;
    for (;;) {
        errno = 0;
        struct dirent *entry = readdir(dir);
        if (entry == NULL) {
            code = errno;
            break;
        }
        const char *name = entry->d_name;
        if (name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0'))) {
            continue;
        }
        if (entry->d_type != DT_REG && entry->d_type != DT_UNKNOWN) {
            continue;
        }
        struct stat status;
        if (fstatat(dir_fd, name, &status, AT_SYMLINK_NOFOLLOW) != 0) {
            if (errno == ENOENT) {
                continue; /* removed since the listing: no file */
            }
            code = errno;
            break;
        }
        if (!S_ISREG(status.st_mode)) {
            continue;
        }
        if (listing_add(listing, name, (long long)status.st_size, (long long)status.st_blocks)) {
            code = ENOMEM;
            break;
        }
    }
    closedir(dir);
    return code;
}

static PyObject *scan_files(PyObject *self, PyObject *path_arg) {
    (void)self;
    if (!PyBytes_CheckExact(path_arg)) {
        PyErr_SetString(PyExc_TypeError, "scan_files: path must be bytes");
        return NULL;
    }
    const char *path = PyBytes_AS_STRING(path_arg);
    if ((Py_ssize_t)strlen(path) != PyBytes_GET_SIZE(path_arg)) {
        PyErr_SetString(PyExc_ValueError, "scan_files: path holds a NUL byte");
        return NULL;
    }
    Listing listing;
    memset(&listing, 0, sizeof(listing));
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = list_dir(path, &listing);
    Py_END_ALLOW_THREADS
    PyObject *names = NULL, *sizes = NULL, *blocks = NULL, *result = NULL;
    if (code != 0) {
        errno = code;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path_arg);
        goto done;
    }
    names = PyList_New(listing.count);
    sizes = PyList_New(listing.count);
    blocks = PyList_New(listing.count);
    if (names == NULL || sizes == NULL || blocks == NULL) {
        goto done;
    }
    const char *name = listing.names;
    for (Py_ssize_t i = 0; i < listing.count; i++) {
        size_t length = strlen(name);
        PyObject *text = PyUnicode_DecodeFSDefaultAndSize(name, (Py_ssize_t)length);
        PyObject *size = PyLong_FromLongLong(listing.sizes[i]);
        PyObject *block = PyLong_FromLongLong(listing.blocks[i]);
        if (text == NULL || size == NULL || block == NULL) {
            Py_XDECREF(text);
            Py_XDECREF(size);
            Py_XDECREF(block);
            goto done;
        }
        PyList_SET_ITEM(names, i, text);
        PyList_SET_ITEM(sizes, i, size);
        PyList_SET_ITEM(blocks, i, block);
        name += length + 1;
    }
    result = PyTuple_Pack(3, names, sizes, blocks);
done:
    Py_XDECREF(names);
    Py_XDECREF(sizes);
    Py_XDECREF(blocks);
    free(listing.names);
    free(listing.sizes);
    free(listing.blocks);
    return result;
}

/* Whether this build and CPU run the AVX2 xxh3 loop. */
static int avx2_available(void) {
#ifdef HASH_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static PyObject *digest(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *buffers;
    int avx2;
    if (!PyArg_ParseTuple(args, "Op:digest", &buffers, &avx2)) {
        return NULL;
    }
    if (avx2 && !avx2_available()) {
        PyErr_SetString(PyExc_ValueError, "digest: no AVX2 loop in this build or on this CPU");
        return NULL;
    }
    if (!PyList_CheckExact(buffers) && !PyTuple_CheckExact(buffers)) {
        PyErr_SetString(PyExc_TypeError, "digest: buffers must be a list or tuple");
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(buffers);
    Held held = {NULL, 0, NULL};
    PyObject *result = NULL;
    Py_ssize_t slot = 0;
    long long total = 0;
    if (held_alloc(&held, count) == 0 && held_take(&held, &slot, buffers, PyBUF_SIMPLE, &total) == 0) {
        uint64_t value;
        Py_BEGIN_ALLOW_THREADS
        value = digest_with(held.iov, count, avx2);
        Py_END_ALLOW_THREADS
        result = PyLong_FromUnsignedLongLong(value);
    }
    held_release(&held);
    return result;
}

static PyMethodDef methods[] = {
    {"digest", digest, METH_VARARGS,
     "digest(buffers, avx2) -> int: the xxh3-64 of the buffers' concatenation, as reads and "
     "writes take it, with the AVX2 loop or without (ValueError where there is none; "
     "AVX2 says whether reads and writes use it)."},
    {"read_requests", read_requests, METH_VARARGS,
     "read_requests(requests, layout) -> tuple[bytes, dict[int, tuple[int, int, int, bytes, "
     "int | None]]]: open (openat2, no links, non-blocking), read, close and verify the "
     "object of each GetRequest, its path and expected header built from layout(namespace, "
     "spec) -> (directory, head, tail); a code per request, and (got, inode, errno, header, "
     "digest) of each one not VERIFIED."},
    {"write_objects", write_objects, METH_VARARGS,
     "write_objects(items, (file_mode, exact, dir_mode, dir_exact), sync) -> bytes: write "
     "each (directory, name, temporary path, buffers, expected header) item as a whole "
     "object through its locked temporary file (fsync'ed when sync), renamed into place, "
     "making a missing last directory; a code per item, STORED or RETRY (anything "
     "unusual: the caller's own path does it)."},
    {"scan_files", scan_files, METH_O,
     "scan_files(path) -> tuple[list[str], list[int], list[int]]: the regular files of "
     "directory path (no link followed), with each one's size and 512-byte blocks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fileio", "The file backend's hot path (reads, verification, scans), in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fileio(void) {
    s_key = PyUnicode_InternFromString("key");
    s_spec = PyUnicode_InternFromString("spec");
    s_buffers = PyUnicode_InternFromString("buffers");
    s_namespace = PyUnicode_InternFromString("namespace");
    s_name = PyUnicode_InternFromString("name");
    if (s_key == NULL || s_spec == NULL || s_buffers == NULL || s_namespace == NULL ||
        s_name == NULL) {
        return NULL;
    }
    use_avx2 = avx2_available();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "READ", READ) < 0 ||
        PyModule_AddIntConstant(m, "MISSING", MISSING) < 0 ||
        PyModule_AddIntConstant(m, "LINK", LINK) < 0 ||
        PyModule_AddIntConstant(m, "NOT_REGULAR", NOT_REGULAR) < 0 ||
        PyModule_AddIntConstant(m, "FAILED", FAILED) < 0 ||
        PyModule_AddIntConstant(m, "NO_OPENAT2", NO_OPENAT2) < 0 ||
        PyModule_AddIntConstant(m, "VERIFIED", VERIFIED) < 0 ||
        PyModule_AddIntConstant(m, "STORED", STORED) < 0 ||
        PyModule_AddIntConstant(m, "RETRY", RETRY) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0 ||
        PyModule_AddObjectRef(m, "AVX2", use_avx2 ? Py_True : Py_False) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
