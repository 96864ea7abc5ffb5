/* The file backend's hot system calls, in C, with the GIL released.
 *
 * scan_files(path) lists the regular files of one directory (no link, no other kind)
 * with each one's size and allocated 512-byte blocks: the index rebuild's scan.
 *
 * read_files(items) takes a list of (path, buffers): an absolute path as bytes and a
 * list of writable buffers. For each it opens the path with openat2 (no symbolic link
 * anywhere on it, never blocking: a FIFO planted there must not hang the reader), reads
 * it into the buffers in order until they are full or the file ends, and closes it, with
 * the GIL released for the whole batch. It returns one (code, got, inode, error) tuple per
 * item, in order:
 *
 *   READ        0  a regular file; got bytes were read (inode is its inode number)
 *   MISSING     1  no file (ENOENT)
 *   LINK        2  a symbolic link on the path (ELOOP, EXDEV or ENOTDIR)
 *   NOT_REGULAR 3  something other than a regular file; nothing was read
 *   FAILED      4  an open, stat or read failed with errno ``error``
 *   NO_OPENAT2  5  this kernel (or a seccomp filter) refuses openat2: the caller's
 *                  component-by-component open is needed; nothing was done
 *
 * It is the same work as file.py's _read_raw, which stays for kernels without openat2.
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
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#define RESOLVE_NO_SYMLINKS_ 0x04
#define MAX_IOV 1024

enum { READ = 0, MISSING = 1, LINK = 2, NOT_REGULAR = 3, FAILED = 4, NO_OPENAT2 = 5 };

struct open_how_ {
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};

typedef struct {
    const char *path;
    struct iovec *iov;
    Py_ssize_t count;
    int code;
    int error;
    long long got;
    unsigned long long inode;
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

static void read_one(Item *item) {
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
        return;
    }
    struct stat status;
    if (fstat((int)fd, &status) != 0) {
        item->code = FAILED;
        item->error = errno;
    } else {
        item->inode = (unsigned long long)status.st_ino;
        if (!S_ISREG(status.st_mode)) {
            item->code = NOT_REGULAR;
        } else {
            int error = 0;
            long long got = read_all((int)fd, item->iov, item->count, &error);
            if (got < 0) {
                item->code = FAILED;
                item->error = error;
            } else {
                item->code = READ;
                item->got = got;
            }
        }
    }
    close((int)fd);
}

static PyObject *read_files(PyObject *self, PyObject *items_arg) {
    (void)self;
    if (!PyList_CheckExact(items_arg)) {
        PyErr_SetString(PyExc_TypeError, "read_files: items must be a list of (path, buffers)");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items_arg);
    Item *items = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Item));
    Py_ssize_t views_total = 0;
    PyObject *result = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t held = 0;
    struct iovec *iov = NULL;
    if (items == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(items_arg, i);
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2 ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(entry, 0)) ||
            !PyList_CheckExact(PyTuple_GET_ITEM(entry, 1))) {
            PyErr_Format(PyExc_TypeError,
                         "read_files: item %zd must be a tuple (bytes path, list of buffers)", i);
            goto done;
        }
        views_total += PyList_GET_SIZE(PyTuple_GET_ITEM(entry, 1));
    }
    views = PyMem_Calloc(views_total > 0 ? (size_t)views_total : 1, sizeof(Py_buffer));
    iov = PyMem_Calloc(views_total > 0 ? (size_t)views_total : 1, sizeof(struct iovec));
    if (views == NULL || iov == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(items_arg, i);
        PyObject *path = PyTuple_GET_ITEM(entry, 0);
        PyObject *buffers = PyTuple_GET_ITEM(entry, 1);
        if ((Py_ssize_t)strlen(PyBytes_AS_STRING(path)) != PyBytes_GET_SIZE(path)) {
            PyErr_Format(PyExc_ValueError, "read_files: path %zd holds a NUL byte", i);
            goto done;
        }
        items[i].path = PyBytes_AS_STRING(path);
        items[i].iov = iov + held;
        items[i].count = PyList_GET_SIZE(buffers);
        for (Py_ssize_t j = 0; j < items[i].count; j++) {
            if (PyObject_GetBuffer(PyList_GET_ITEM(buffers, j), &views[held],
                                   PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
                goto done;
            }
            iov[held].iov_base = views[held].buf;
            iov[held].iov_len = (size_t)views[held].len;
            held++;
        }
    }
    /* The items' paths stay alive: items_arg holds them, and the caller holds items_arg. */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        read_one(&items[i]);
        if (items[i].code == NO_OPENAT2) {
            for (Py_ssize_t k = i + 1; k < n; k++) {
                items[k].code = NO_OPENAT2;
            }
            break;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = Py_BuildValue("(iLKi)", items[i].code, items[i].got, items[i].inode,
                                      items[i].error);
        if (row == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, row);
    }
done:
    for (Py_ssize_t k = 0; k < held; k++) {
        PyBuffer_Release(&views[k]);
    }
    PyMem_Free(views);
    PyMem_Free(iov);
    PyMem_Free(items);
    return result;
}

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

static PyMethodDef methods[] = {
    {"read_files", read_files, METH_O,
     "read_files(items) -> list[tuple[int, int, int, int]]: open (openat2, no links, "
     "non-blocking), read and close each (path, buffers) item; (code, got, inode, errno) "
     "per item."},
    {"scan_files", scan_files, METH_O,
     "scan_files(path) -> tuple[list[str], list[int], list[int]]: the regular files of "
     "directory path (no link followed), with each one's size and 512-byte blocks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fileio", "The file backend's hot system calls, in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fileio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "READ", READ) < 0 ||
        PyModule_AddIntConstant(m, "MISSING", MISSING) < 0 ||
        PyModule_AddIntConstant(m, "LINK", LINK) < 0 ||
        PyModule_AddIntConstant(m, "NOT_REGULAR", NOT_REGULAR) < 0 ||
        PyModule_AddIntConstant(m, "FAILED", FAILED) < 0 ||
        PyModule_AddIntConstant(m, "NO_OPENAT2", NO_OPENAT2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
