/* Whole-object reads of the file backend, a batch per call, in C.
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

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
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

static PyMethodDef methods[] = {
    {"read_files", read_files, METH_O,
     "read_files(items) -> list[tuple[int, int, int, int]]: open (openat2, no links, "
     "non-blocking), read and close each (path, buffers) item; (code, got, inode, errno) "
     "per item."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_objread", "Whole-object reads of the file backend, in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__objread(void) {
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
