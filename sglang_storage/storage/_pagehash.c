/* The SHA-256 page-key chain of sglang_storage.storage.keys, in C.
 *
 * page_keys(ids, page_size, prior) is keys.page_hashes for plain ids (a list, tuple or
 * integer array of non-negative int64 ids), from the ids to the hex keys in one call;
 * it returns None for anything else, which the Python side checks and reports.
 *
 * chain(data, stride, prior) hashes the bytes-like ``data`` in ``stride``-byte pages (the
 * last may be shorter), each page's digest taken over the previous page's 32-byte digest
 * (for the first page: ``prior``, 0 or 32 bytes) followed by the page's bytes, and returns
 * the digests as 64-character lowercase hex strings. It is the same computation as the
 * module's pure-Python ``_chain``; the GIL is released while hashing.
 *
 * OpenSSL's SHA-256 (the implementation SGLang's own native hash links) is called through
 * its low-level SHA256_CTX functions: in OpenSSL 3 the one-shot SHA256() looks the digest
 * up by name on every call, which costs more than hashing a small page.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/sha.h>

#define DIGEST 32
#define STACK_PAGE 4096

static const char HEX[] = "0123456789abcdef";
static const unsigned char WIDE_TAG[1] = {0xff};

static PyObject *hex_list(const unsigned char *digests, Py_ssize_t pages);

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer data, prior;
    Py_ssize_t stride;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*ny*:chain", &data, &stride, &prior)) {
        return NULL;
    }
    PyObject *keys = NULL;
    unsigned char *digests = NULL;
    unsigned char *scratch = NULL;
    unsigned char stack[DIGEST + STACK_PAGE];
    if (stride < 1) {
        PyErr_Format(PyExc_ValueError, "chain: stride must be >= 1, got %zd", stride);
        goto done;
    }
    if (prior.len != 0 && prior.len != DIGEST) {
        PyErr_Format(PyExc_ValueError, "chain: prior must be 0 or 32 bytes, got %zd", prior.len);
        goto done;
    }
    Py_ssize_t pages = data.len / stride + (data.len % stride != 0);
    digests = PyMem_RawMalloc(pages > 0 ? (size_t)pages * DIGEST : 1);
    if (stride > STACK_PAGE) {
        scratch = PyMem_RawMalloc((size_t)stride + DIGEST);
    } else {
        scratch = stack;
    }
    if (digests == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const unsigned char *bytes = data.buf;
    Py_BEGIN_ALLOW_THREADS
    size_t head = (size_t)prior.len;
    memcpy(scratch, prior.buf, head);
    for (Py_ssize_t k = 0; k < pages; k++) {
        Py_ssize_t start = k * stride;
        Py_ssize_t size = data.len - start < stride ? data.len - start : stride;
        memcpy(scratch + head, bytes + start, (size_t)size);
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, scratch, head + (size_t)size);
        SHA256_Final(digests + (size_t)k * DIGEST, &ctx);
        memcpy(scratch, digests + (size_t)k * DIGEST, DIGEST);
        head = DIGEST;
    }
    Py_END_ALLOW_THREADS
    keys = hex_list(digests, pages);
done:
    if (scratch != NULL && scratch != stack) {
        PyMem_RawFree(scratch);
    }
    PyMem_RawFree(digests);
    PyBuffer_Release(&data);
    PyBuffer_Release(&prior);
    return keys;
}

/* Token ids as 64-bit words: either borrowed from an 8-byte integer buffer (``view`` holds
 * it) or copied into ``owned``. */
typedef struct {
    const uint64_t *words;
    Py_ssize_t count;
    uint64_t *owned;
    Py_buffer view;
    int has_view;
} Ids;

static void release_ids(Ids *ids) {
    PyMem_RawFree(ids->owned);
    ids->owned = NULL;
    if (ids->has_view) {
        PyBuffer_Release(&ids->view);
        ids->has_view = 0;
    }
}

static int own_words(Ids *ids, Py_ssize_t n) {
    ids->owned = PyMem_RawMalloc(n > 0 ? (size_t)n * sizeof(uint64_t) : 1);
    if (ids->owned == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ids->words = ids->owned;
    ids->count = n;
    return 0;
}

/* Read ``source`` as ids: an exact list or tuple of exact ints in [0, 2**63), or a
 * C-contiguous integer buffer (array.array). Returns 1 with ``ids`` filled, 0 when the
 * source is not of that form (a negative id, a bool, another type: the caller's checked
 * path decides), -1 with an exception set. An 8-byte buffer's negative or too large ids
 * are found while hashing (``top`` in page_keys), not here. */
static int read_ids(PyObject *source, Ids *ids) {
    memset(ids, 0, sizeof(*ids));
    if (PyList_CheckExact(source) || PyTuple_CheckExact(source)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(source);
        PyObject **items = PySequence_Fast_ITEMS(source);
        if (own_words(ids, n) < 0) {
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int overflow = 0;
            long long value = PyLong_CheckExact(items[i])
                ? PyLong_AsLongLongAndOverflow(items[i], &overflow) : -1;
            if (overflow != 0 || value < 0) {
                release_ids(ids);
                return 0;
            }
            ids->owned[i] = (uint64_t)value;
        }
        return 1;
    }
    if (!PyObject_CheckBuffer(source)) {
        return 0;
    }
    if (PyObject_GetBuffer(source, &ids->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        return 0;
    }
    ids->has_view = 1;
    const char *format = ids->view.format == NULL ? "B" : ids->view.format;
    if (format[0] == '@') {
        format++;
    }
    char code = format[0];
    Py_ssize_t size = ids->view.itemsize;
    if (code == '\0' || format[1] != '\0' || size < 1 || strchr("bBhHiIlLqQ", code) == NULL) {
        release_ids(ids);
        return 0;
    }
    Py_ssize_t n = ids->view.len / size;
    if (size == 8) {  /* q, Q and (LP64) l, L: read in place */
        ids->words = ids->view.buf;
        ids->count = n;
        return 1;
    }
    if (own_words(ids, n) < 0) {
        release_ids(ids);
        return -1;
    }
    int negative = 0;
#define WIDEN(type)                                                         \
    do {                                                                    \
        const type *src = ids->view.buf;                                    \
        for (Py_ssize_t i = 0; i < n; i++) {                                \
            negative |= (int64_t)src[i] < 0;                                \
            ids->owned[i] = (uint64_t)(int64_t)src[i];                      \
        }                                                                   \
    } while (0)
    switch (code) {
    case 'b': WIDEN(signed char); break;
    case 'B': WIDEN(unsigned char); break;
    case 'h': WIDEN(short); break;
    case 'H': WIDEN(unsigned short); break;
    case 'i': WIDEN(int); break;
    case 'I': WIDEN(unsigned int); break;
    case 'l': WIDEN(long); break;
    default: WIDEN(unsigned long); break;  /* 'L' of 4 bytes */
    }
#undef WIDEN
    if (negative) {
        release_ids(ids);
        return 0;
    }
    return 1;
}

/* The low size (4 or 8) bytes of value at ``at``, little-endian. */
static inline void put_le(unsigned char *at, uint64_t value, int size) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (size == 4) {
        uint32_t low = (uint32_t)value;
        memcpy(at, &low, 4);
    } else {
        memcpy(at, &value, 8);
    }
#else
    for (int i = 0; i < size; i++) {
        at[i] = (unsigned char)(value >> (8 * i));
    }
#endif
}

static PyObject *hex_list(const unsigned char *digests, Py_ssize_t pages) {
    PyObject *keys = PyList_New(pages);
    if (keys == NULL) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < pages; k++) {
        PyObject *key = PyUnicode_New(2 * DIGEST, 127);
        if (key == NULL) {
            Py_DECREF(keys);
            return NULL;
        }
        Py_UCS1 *out = PyUnicode_1BYTE_DATA(key);
        const unsigned char *digest = digests + (size_t)k * DIGEST;
        for (int i = 0; i < DIGEST; i++) {
            out[2 * i] = (Py_UCS1)HEX[digest[i] >> 4];
            out[2 * i + 1] = (Py_UCS1)HEX[digest[i] & 0x0f];
        }
        PyList_SET_ITEM(keys, k, key);
    }
    return keys;
}

/* page_keys(ids, page_size, prior) -> list[str] | None: SGLang's key of every page of
 * ids (uint32 words, or the wide tag and uint64 words for a page with an id above
 * 2**32 - 1), the first chained on prior; None when ids are not of read_ids' form. */
static PyObject *page_keys(PyObject *self, PyObject *args) {
    PyObject *source;
    Py_ssize_t page_size;
    Py_buffer prior;
    (void)self;
    if (!PyArg_ParseTuple(args, "Ony*:page_keys", &source, &page_size, &prior)) {
        return NULL;
    }
    PyObject *result = NULL;
    Ids ids;
    memset(&ids, 0, sizeof(ids));
    unsigned char *digests = NULL;
    unsigned char *page_bytes = NULL;
    if (page_size < 1) {
        PyErr_Format(PyExc_ValueError, "page_keys: page_size must be >= 1, got %zd", page_size);
        goto done;
    }
    if (prior.len != 0 && prior.len != DIGEST) {
        PyErr_Format(PyExc_ValueError, "page_keys: prior must be 0 or 32 bytes, got %zd",
                     prior.len);
        goto done;
    }
    int read = read_ids(source, &ids);
    if (read < 0) {
        goto done;
    }
    if (read == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t n = ids.count;
    Py_ssize_t pages = n / page_size + (n % page_size != 0);
    Py_ssize_t widest = n < page_size ? n : page_size;
    digests = PyMem_RawMalloc(pages > 0 ? (size_t)pages * DIGEST : 1);
    page_bytes = PyMem_RawMalloc(widest > 0 ? 4 * (size_t)widest : 1);
    if (digests == NULL || page_bytes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t top = 0; /* every id's bits, or'ed: bit 63 set means an id is not in [0, 2**63) */
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *previous = prior.buf;
    size_t head = (size_t)prior.len;
    for (Py_ssize_t k = 0; k < pages; k++) {
        Py_ssize_t start = k * page_size;
        Py_ssize_t size = n - start < page_size ? n - start : page_size;
        const uint64_t *page = ids.words + start;
        uint64_t high = 0;
        for (Py_ssize_t i = 0; i < size; i++) {
            high |= page[i];
            put_le(page_bytes + 4 * (size_t)i, page[i], 4);
        }
        top |= high;
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, previous, head);
        if ((high >> 32) == 0) {
            SHA256_Update(&ctx, page_bytes, 4 * (size_t)size);
        } else { /* some id does not fit uint32: the wide tag, then uint64 words */
            unsigned char word[8];
            SHA256_Update(&ctx, WIDE_TAG, 1);
            for (Py_ssize_t i = 0; i < size; i++) {
                put_le(word, page[i], 8);
                SHA256_Update(&ctx, word, 8);
            }
        }
        SHA256_Final(digests + (size_t)k * DIGEST, &ctx);
        previous = digests + (size_t)k * DIGEST;
        head = DIGEST;
    }
    Py_END_ALLOW_THREADS
    if (top >> 63) {
        result = Py_NewRef(Py_None); /* a negative (or too large) id in an 8-byte buffer */
        goto done;
    }
    result = hex_list(digests, pages);
done:
    PyMem_RawFree(page_bytes);
    PyMem_RawFree(digests);
    release_ids(&ids);
    PyBuffer_Release(&prior);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(data, stride, prior) -> list[str]: the hex SHA-256 key chain of data's "
     "stride-byte pages, the first chained on prior (0 or 32 bytes)."},
    {"page_keys", page_keys, METH_VARARGS,
     "page_keys(ids, page_size, prior) -> list[str] | None: SGLang's key of every page of "
     "ids (a list, tuple or integer buffer of non-negative ids), the first chained on "
     "prior (0 or 32 bytes); None when ids are not all plain non-negative int64 ids."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pagehash",
    "The SHA-256 page-key chain of sglang_storage.storage.keys, in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pagehash(void) { return PyModule_Create(&module); }
