/*
 * cryobox-volume: a named volume's mount in the guest, served by the host.
 *
 *   cryobox-volume PORT MOUNTPOINT [ro]
 *
 * A FUSE file system (libfuse 3, high-level API, one thread) whose every operation is
 * one request by path on its own virtio-serial port (PORT, /dev/virtio-ports/...), and
 * whose host end (cryobox/volume/serve.py) does it on the volume's folder. The protocol
 * is stateless: no handle, no lease, nothing the host must remember. So a memory
 * snapshot, a pause, a fork or a move to another host only ever cuts a request short,
 * and a new host end takes over at once.
 *
 * How a cut request is redone: a host end that connects first sends HELLO with a nonce.
 * This program answers SYNC with that nonce whenever it reads one, then sends its
 * request again. The host drops every byte before the SYNC it expects (a half-sent
 * request, answers to an end that is gone), so both ends agree on where frames start.
 * A request redone may have been done once already (its answer was lost): the volume
 * is the host's, and a rollback does not undo it (the docs say so).
 *
 * Reads come back through the read disk when the machine has it (serial
 * cryobox-volumes, read-only, a 2 MiB slot per volume port; cryobox/volume/read_disk.py):
 * the host writes the bytes there, then a header naming its HELLO's nonce, the
 * request's seq and the length, and answers with the length alone. This program reads
 * the slot with O_DIRECT and takes the bytes only when all three match: a machine
 * restored from a snapshot gets a new, empty read disk, so an answer it had received
 * but not taken yet is dropped and the request redone after the new host end's HELLO.
 * Without the disk, reads come back in the answer frame.
 *
 * Nothing is cached in the guest: direct I/O and no attribute, entry or negative
 * timeouts. A file another sandbox or the host rewrote while this one was paused reads
 * as it is now. Files belong to whoever looks (the host stores no guest user); their
 * mode bits are kept.
 *
 * Built by the image build (cryobox/image/build.py) with Debian's gcc, libfuse 3 linked
 * statically. The frame layout is in cryobox/volume/wire.py; keep the two in step.
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 35
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum op {
    OP_SYNC = 1,
    OP_GETATTR = 2,
    OP_READDIR = 3,
    OP_READ = 4,
    OP_WRITE = 5,
    OP_CREATE = 6,
    OP_OPEN = 7,
    OP_TRUNCATE = 8,
    OP_UNLINK = 9,
    OP_MKDIR = 10,
    OP_RMDIR = 11,
    OP_RENAME = 12,
    OP_SYMLINK = 13,
    OP_READLINK = 14,
    OP_CHMOD = 15,
    OP_UTIMENS = 16,
    OP_STATFS = 17,
    OP_FSYNC = 18,
    OP_LINK = 19,
};

#define HELLO_SEQ 0xffffffffu
#define NONCE_BYTES 16
#define MAX_WRITE (1024 * 1024)
#define MAX_ANSWER (16 * 1024 * 1024 + 64)
#define READ_ON_DISK 1u /* a READ's flag: answer through the read disk */
#define ON_DISK 1u      /* an answer's pad: the bytes are on the read disk */
#define READ_DISK_SERIAL "cryobox-volumes"
#define READ_DISK_BYTES (8u << 20)
#define READ_SLOT_BYTES (2u << 20)
#define READ_DATA_OFFSET 4096

/* Both frames are little-endian, as both ends are (x86-64). */
struct request {
    uint32_t length; /* bytes after this field */
    uint32_t seq;
    uint32_t op;
    uint32_t flags;
    uint64_t a;
    uint64_t b;
    uint16_t path_length;
    uint16_t path2_length;
    uint32_t pad;
} __attribute__((packed));

struct answer {
    uint32_t length; /* bytes after this field */
    uint32_t seq;
    int32_t error; /* 0 or a negative errno */
    uint32_t pad;
} __attribute__((packed));

/* What GETATTR answers: the host's lstat, as much as the guest needs. */
struct attributes {
    uint64_t mode, nlink, size, blocks;
    int64_t atime_ns, mtime_ns, ctime_ns;
} __attribute__((packed));

/* The head of a port's slot on the read disk. */
struct read_header {
    unsigned char nonce[NONCE_BYTES];
    uint32_t seq;
    uint32_t pad;
    uint64_t length;
} __attribute__((packed));

struct statfs_answer {
    uint64_t blocks, bfree, files, ffree;
} __attribute__((packed));

static int port = -1;
static int read_only = 0;
static uint32_t next_seq = 1;
static unsigned char *answer_body;
/* The read disk (-1: the machine has none) and this port's slot's offset on it, the
 * nonce of the HELLO last read, the buffer the slot is read into (aligned for
 * O_DIRECT), and where the last answer's bytes are (the body or that buffer). */
static int read_disk = -1;
static off_t read_slot;
static unsigned char nonce[NONCE_BYTES];
static unsigned char *slot_buffer;
static const unsigned char *answer_data;

static int write_all(const struct iovec *parts, int count) {
    struct iovec local[6];
    memcpy(local, parts, sizeof(struct iovec) * count);
    struct iovec *v = local;
    while (count > 0) {
        ssize_t n = writev(port, v, count);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        while (count > 0 && (size_t)n >= v->iov_len) {
            n -= v->iov_len;
            v++;
            count--;
        }
        if (count > 0) {
            v->iov_base = (char *)v->iov_base + n;
            v->iov_len -= n;
        }
    }
    return 0;
}

/* Read exactly size bytes; -1 when the host end went away (end of file) or failed. */
static int read_all(void *buffer, size_t size) {
    size_t done = 0;
    while (done < size) {
        ssize_t n = read(port, (char *)buffer + done, size - done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        done += n;
    }
    return 0;
}

static void pause_briefly(void) {
    struct timespec wait = {0, 50 * 1000 * 1000};
    nanosleep(&wait, NULL);
}

static void send_sync(const unsigned char *nonce) {
    struct request sync = {.length = sizeof(sync) - 4 + NONCE_BYTES, .op = OP_SYNC};
    struct iovec parts[2] = {{&sync, sizeof(sync)}, {(void *)nonce, NONCE_BYTES}};
    write_all(parts, 2);
}

/*
 * One request and its answer: the answer's body lands in answer_body (its size in
 * *size). Redone after every HELLO until answered; never fails for the host's sake.
 */
static int call(uint32_t op, uint32_t flags, uint64_t a, uint64_t b, const char *path,
                const char *path2, const void *data, size_t data_size, size_t *size) {
    struct request head = {
        .seq = next_seq++,
        .op = op,
        .flags = flags,
        .a = a,
        .b = b,
        .path_length = (uint16_t)strlen(path),
        .path2_length = path2 ? (uint16_t)strlen(path2) : 0,
    };
    if (next_seq == HELLO_SEQ)
        next_seq = 1;
    head.length = sizeof(head) - 4 + head.path_length + head.path2_length + data_size;
    struct iovec parts[4] = {
        {&head, sizeof(head)},
        {(void *)path, head.path_length},
        {(void *)(path2 ? path2 : ""), head.path2_length},
        {(void *)data, data_size},
    };
    int send = 1;
    for (;;) {
        if (send) {
            if (write_all(parts, 4) < 0)
                pause_briefly();
            send = 0;
        }
        struct answer got;
        if (read_all(&got, sizeof(got)) < 0) { /* no host: wait for the next one's HELLO */
            pause_briefly();
            continue;
        }
        size_t body = got.length >= sizeof(got) - 4 ? got.length - (sizeof(got) - 4) : 0;
        if (body > MAX_ANSWER) { /* more than this program takes: read past it, fail */
            int drained = 0;
            for (size_t left = body; left > 0;) {
                size_t piece = left < MAX_ANSWER ? left : MAX_ANSWER;
                if (read_all(answer_body, piece) < 0) {
                    drained = -1;
                    break;
                }
                left -= piece;
            }
            if (drained == 0 && got.seq == head.seq)
                return -EIO;
            continue;
        }
        if (read_all(answer_body, body) < 0) {
            pause_briefly();
            continue;
        }
        if (got.seq == HELLO_SEQ && body == NONCE_BYTES) {
            memcpy(nonce, answer_body, NONCE_BYTES);
            send_sync(answer_body);
            send = 1;
            continue;
        }
        if (got.seq != head.seq)
            continue; /* an answer to a request redone since */
        answer_data = answer_body;
        if (got.pad == ON_DISK) {
            uint64_t length;
            if (read_disk < 0 || body != sizeof(length))
                return -EIO;
            memcpy(&length, answer_body, sizeof(length));
            if (length > MAX_WRITE)
                return -EIO;
            size_t span = READ_DATA_OFFSET + (((size_t)length + 4095) & ~(size_t)4095);
            ssize_t n = pread(read_disk, slot_buffer, span, read_slot);
            if (n != (ssize_t)span)
                return -EIO;
            const struct read_header *at = (const struct read_header *)slot_buffer;
            if (memcmp(at->nonce, nonce, NONCE_BYTES) != 0 || at->seq != head.seq ||
                at->length != length)
                continue; /* received before a restore: redone after the next HELLO */
            answer_data = slot_buffer + READ_DATA_OFFSET;
            body = (size_t)length;
        }
        if (size)
            *size = body;
        return got.error;
    }
}

static const char *inside(const char *path) {
    return path[0] == '/' ? path + 1 : path; /* "" is the volume's root */
}

static void to_stat(const struct attributes *at, struct stat *st) {
    memset(st, 0, sizeof(*st));
    struct fuse_context *who = fuse_get_context();
    st->st_mode = (mode_t)at->mode;
    st->st_nlink = (nlink_t)at->nlink;
    st->st_size = (off_t)at->size;
    st->st_blocks = (blkcnt_t)at->blocks;
    st->st_blksize = 4096;
    st->st_uid = who ? who->uid : 0;
    st->st_gid = who ? who->gid : 0;
    st->st_atim.tv_sec = at->atime_ns / 1000000000;
    st->st_atim.tv_nsec = at->atime_ns % 1000000000;
    st->st_mtim.tv_sec = at->mtime_ns / 1000000000;
    st->st_mtim.tv_nsec = at->mtime_ns % 1000000000;
    st->st_ctim.tv_sec = at->ctime_ns / 1000000000;
    st->st_ctim.tv_nsec = at->ctime_ns % 1000000000;
}

static int v_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
    size_t size = 0;
    int error = call(OP_GETATTR, 0, 0, 0, inside(path), NULL, NULL, 0, &size);
    if (error)
        return error;
    if (size < sizeof(struct attributes))
        return -EIO;
    to_stat((const struct attributes *)answer_body, st);
    return 0;
}

/* The answer: entries of (u32 mode, u16 name length, name). */
static int v_readdir(const char *path, void *buffer, fuse_fill_dir_t fill, off_t offset,
                     struct fuse_file_info *fi, enum fuse_readdir_flags flags) {
    size_t size = 0;
    int error = call(OP_READDIR, 0, 0, 0, inside(path), NULL, NULL, 0, &size);
    if (error)
        return error;
    fill(buffer, ".", NULL, 0, 0);
    fill(buffer, "..", NULL, 0, 0);
    size_t at = 0;
    char name[256];
    while (at + 6 <= size) {
        uint32_t mode;
        uint16_t length;
        memcpy(&mode, answer_body + at, 4);
        memcpy(&length, answer_body + at + 4, 2);
        at += 6;
        if (length == 0 || length > 255 || at + length > size)
            return -EIO;
        memcpy(name, answer_body + at, length);
        name[length] = 0;
        at += length;
        struct stat st = {.st_mode = mode};
        fill(buffer, name, &st, 0, 0);
    }
    return 0;
}

static int v_open(const char *path, struct fuse_file_info *fi) {
    int access = fi->flags & O_ACCMODE;
    if (read_only && (access != O_RDONLY || (fi->flags & O_TRUNC)))
        return -EROFS;
    fi->direct_io = 1;
    return call(OP_OPEN, (uint32_t)fi->flags, 0, 0, inside(path), NULL, NULL, 0, NULL);
}

static int v_create(const char *path, mode_t mode, struct fuse_file_info *fi) {
    if (read_only)
        return -EROFS;
    fi->direct_io = 1;
    return call(OP_CREATE, (uint32_t)fi->flags, mode, 0, inside(path), NULL, NULL, 0, NULL);
}

static int v_read(const char *path, char *buffer, size_t size, off_t offset,
                  struct fuse_file_info *fi) {
    size_t got = 0;
    uint32_t flags = read_disk >= 0 && size <= MAX_WRITE ? READ_ON_DISK : 0;
    int error = call(OP_READ, flags, (uint64_t)offset, size, inside(path), NULL, NULL, 0, &got);
    if (error)
        return error;
    if (got > size)
        return -EIO;
    memcpy(buffer, answer_data, got);
    return (int)got;
}

static int v_write(const char *path, const char *data, size_t size, off_t offset,
                   struct fuse_file_info *fi) {
    if (read_only)
        return -EROFS;
    size_t got = 0;
    int error = call(OP_WRITE, 0, (uint64_t)offset, 0, inside(path), NULL, data, size, &got);
    if (error)
        return error;
    return (int)size;
}

static int v_truncate(const char *path, off_t size, struct fuse_file_info *fi) {
    if (read_only)
        return -EROFS;
    return call(OP_TRUNCATE, 0, (uint64_t)size, 0, inside(path), NULL, NULL, 0, NULL);
}

static int v_unlink(const char *path) {
    if (read_only)
        return -EROFS;
    return call(OP_UNLINK, 0, 0, 0, inside(path), NULL, NULL, 0, NULL);
}

static int v_mkdir(const char *path, mode_t mode) {
    if (read_only)
        return -EROFS;
    return call(OP_MKDIR, 0, mode, 0, inside(path), NULL, NULL, 0, NULL);
}

static int v_rmdir(const char *path) {
    if (read_only)
        return -EROFS;
    return call(OP_RMDIR, 0, 0, 0, inside(path), NULL, NULL, 0, NULL);
}

static int v_rename(const char *from, const char *to, unsigned int flags) {
    if (read_only)
        return -EROFS;
    return call(OP_RENAME, flags, 0, 0, inside(from), inside(to), NULL, 0, NULL);
}

static int v_symlink(const char *target, const char *path) {
    if (read_only)
        return -EROFS;
    /* The target is stored as given: the guest resolves it, the host never follows it. */
    return call(OP_SYMLINK, 0, 0, 0, inside(path), target, NULL, 0, NULL);
}

static int v_link(const char *from, const char *to) {
    if (read_only)
        return -EROFS;
    return call(OP_LINK, 0, 0, 0, inside(from), inside(to), NULL, 0, NULL);
}

static int v_readlink(const char *path, char *buffer, size_t size) {
    size_t got = 0;
    int error = call(OP_READLINK, 0, 0, 0, inside(path), NULL, NULL, 0, &got);
    if (error)
        return error;
    if (size == 0)
        return -EINVAL;
    if (got >= size)
        got = size - 1;
    memcpy(buffer, answer_body, got);
    buffer[got] = 0;
    return 0;
}

static int v_chmod(const char *path, mode_t mode, struct fuse_file_info *fi) {
    if (read_only)
        return -EROFS;
    return call(OP_CHMOD, 0, mode, 0, inside(path), NULL, NULL, 0, NULL);
}

static int v_chown(const char *path, uid_t uid, gid_t gid, struct fuse_file_info *fi) {
    return read_only ? -EROFS : 0; /* files belong to whoever looks: nothing to change */
}

static int64_t ns_of(const struct timespec *t, int64_t now) {
    if (t->tv_nsec == UTIME_NOW)
        return now;
    if (t->tv_nsec == UTIME_OMIT)
        return INT64_MIN;
    return (int64_t)t->tv_sec * 1000000000 + t->tv_nsec;
}

static int v_utimens(const char *path, const struct timespec times[2], struct fuse_file_info *fi) {
    if (read_only)
        return -EROFS;
    struct timespec clock;
    clock_gettime(CLOCK_REALTIME, &clock);
    int64_t now = (int64_t)clock.tv_sec * 1000000000 + clock.tv_nsec;
    int64_t atime = times ? ns_of(&times[0], now) : now;
    int64_t mtime = times ? ns_of(&times[1], now) : now;
    return call(OP_UTIMENS, 0, (uint64_t)atime, (uint64_t)mtime, inside(path), NULL, NULL, 0, NULL);
}

static int v_statfs(const char *path, struct statvfs *st) {
    size_t size = 0;
    int error = call(OP_STATFS, 0, 0, 0, "", NULL, NULL, 0, &size);
    if (error)
        return error;
    if (size < sizeof(struct statfs_answer))
        return -EIO;
    const struct statfs_answer *got = (const struct statfs_answer *)answer_body;
    memset(st, 0, sizeof(*st));
    st->f_bsize = st->f_frsize = 4096;
    st->f_blocks = got->blocks;
    st->f_bfree = st->f_bavail = got->bfree;
    st->f_files = got->files;
    st->f_ffree = st->f_favail = got->ffree;
    st->f_namemax = 255;
    return 0;
}

static int v_fsync(const char *path, int datasync, struct fuse_file_info *fi) {
    if (read_only)
        return 0;
    return call(OP_FSYNC, 0, 0, 0, inside(path), NULL, NULL, 0, NULL);
}

static int v_flush(const char *path, struct fuse_file_info *fi) {
    return 0; /* every write reached the host before it returned */
}

static void *v_init(struct fuse_conn_info *conn, struct fuse_config *cfg) {
    cfg->direct_io = 1;
    cfg->kernel_cache = 0;
    cfg->attr_timeout = 0;
    cfg->entry_timeout = 0;
    cfg->negative_timeout = 0;
    cfg->hard_remove = 1; /* no .fuse_hidden files other sandboxes would see */
    cfg->use_ino = 0;
    conn->max_write = MAX_WRITE;
    conn->want &= ~FUSE_CAP_WRITEBACK_CACHE;
    return NULL;
}

static const struct fuse_operations operations = {
    .init = v_init,
    .getattr = v_getattr,
    .readdir = v_readdir,
    .open = v_open,
    .create = v_create,
    .read = v_read,
    .write = v_write,
    .truncate = v_truncate,
    .unlink = v_unlink,
    .mkdir = v_mkdir,
    .rmdir = v_rmdir,
    .rename = v_rename,
    .symlink = v_symlink,
    .link = v_link,
    .readlink = v_readlink,
    .chmod = v_chmod,
    .chown = v_chown,
    .utimens = v_utimens,
    .statfs = v_statfs,
    .fsync = v_fsync,
    .flush = v_flush,
};

/* Open the read disk (O_DIRECT: no guest page cache to go stale) and find this port's
 * slot on it, its number the port name's (org.cryobox.volume.N). Nothing when the
 * machine has no read disk. */
static void open_read_disk(const char *port_path) {
    const char *dot = strrchr(port_path, '.');
    char *end;
    long slot = dot ? strtol(dot + 1, &end, 10) : -1;
    if (!dot || *end || slot < 0 || (unsigned long)slot >= READ_DISK_BYTES / READ_SLOT_BYTES)
        return;
    DIR *blocks = opendir("/sys/block");
    if (!blocks)
        return;
    struct dirent *entry;
    while (read_disk < 0 && (entry = readdir(blocks))) {
        char path[300], serial[64] = {0};
        if (entry->d_name[0] == '.')
            continue;
        snprintf(path, sizeof(path), "/sys/block/%s/serial", entry->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        ssize_t n = read(fd, serial, sizeof(serial) - 1);
        close(fd);
        while (n > 0 && (serial[n - 1] == '\n' || serial[n - 1] == ' '))
            serial[--n] = 0;
        if (n <= 0 || strcmp(serial, READ_DISK_SERIAL) != 0)
            continue;
        snprintf(path, sizeof(path), "/dev/%s", entry->d_name);
        read_disk = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    }
    closedir(blocks);
    if (read_disk < 0)
        return;
    if (posix_memalign((void **)&slot_buffer, 4096, READ_DATA_OFFSET + MAX_WRITE) != 0) {
        close(read_disk);
        read_disk = -1;
        return;
    }
    read_slot = (off_t)slot * READ_SLOT_BYTES;
}

int main(int argc, char **argv) {
    if (argc < 3 || argc > 4 || (argc == 4 && strcmp(argv[3], "ro") != 0)) {
        fprintf(stderr, "usage: cryobox-volume PORT MOUNTPOINT [ro]\n");
        return 2;
    }
    read_only = argc == 4;
    answer_body = malloc(MAX_ANSWER);
    port = open(argv[1], O_RDWR | O_CLOEXEC);
    if (!answer_body || port < 0) {
        perror(argv[1]);
        return 1;
    }
    open_read_disk(argv[1]);
    char *fuse_argv[] = {
        argv[0],
        "-o",
        read_only ? "ro,default_permissions,allow_other,fsname=cryobox-volume,subtype=cryobox"
                  : "allow_other,default_permissions,fsname=cryobox-volume,subtype=cryobox",
        NULL,
    };
    struct fuse_args args = FUSE_ARGS_INIT(3, fuse_argv);
    struct fuse *fs = fuse_new(&args, &operations, sizeof(operations), NULL);
    if (!fs)
        return 1;
    if (fuse_mount(fs, argv[2]) != 0) {
        fuse_destroy(fs);
        return 1;
    }
    /* Mounted: the parent returns (its caller, the agent, knows the mount is there) and
     * this process serves on, out of the OOM killer's way (a guest short of memory must
     * not cut its volume off). */
    if (fuse_daemonize(0) != 0) {
        fuse_unmount(fs);
        fuse_destroy(fs);
        return 1;
    }
    int adjust = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (adjust >= 0) {
        if (write(adjust, "-1000", 5) < 0) { /* not fatal */
        }
        close(adjust);
    }
    int result = fuse_loop(fs);
    fuse_unmount(fs);
    fuse_destroy(fs);
    return result ? 1 : 0;
}
