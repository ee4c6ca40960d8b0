/*
 * cryobox-agent: the compiled front of the guest agent.
 *
 * It owns the virtio-serial port and serves the requests on the path of every restore
 * and fork itself: ping, sys.refresh (clock, entropy, identity) and plain commands
 * (exec without a terminal, with their stdin, kill and flow control). Every other
 * request (files, watches, commands with a terminal) goes to the Python agent
 * (cryobox/guest/agent.py, started by this program with a socket pair as its port), and
 * its frames come back through here. Same wire protocol (protocol.py), same answers.
 *
 * Why: under TCG a restored QEMU translates every guest instruction it runs for the
 * first time, and translation is most of a fork's CPU. The Python agent's interpreter
 * and modules were a third of the guest code a fork translated before its first answer
 * and a quarter before its first command (2026-12-01). This program runs a few KiB.
 *
 * One thread, one epoll loop. The port's behaviour is the Python Channel's: while no
 * host is connected reads report end-of-file and writes are refused (EAGAIN with
 * POLLHUP); then reading stops, a hello is queued and writes are tried every 50 ms.
 * Output a command makes while the host is away is dropped past 16 MiB, answers never;
 * a connected host that reads slowly holds commands' output back (HIGH/LOW).
 *
 * Built by the image build (cryobox/image/build.py) with Debian's gcc, jansson linked
 * statically (the guest needs no package of its own for it).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <jansson.h>
#include <poll.h>
#include <pwd.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PORT_NAME "org.cryobox.agent.0"
#define RUN_DIR "/run/cryobox"
#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define MAGIC "CBX1"
#define PREFIX_SIZE 12
#define MAX_HEADER (64 * 1024)
#define MAX_PAYLOAD (1024 * 1024)
#define READ_SIZE (64 * 1024)
#define RETRY_MS 50
#define HIGH (4u << 20)
#define LOW (1u << 20)
#define MAX_QUEUED_OUTPUT (16u << 20)
#define HELPER_RESTART_MS 1000
/* Starts of the Python agent that may end before its hello before the port opens anyway
 * (commands and pings served, its requests failed): never an agent that does not answer. */
#define HELPER_TRIES_BEFORE_PORT 3

/* Error kinds: protocol.py's vocabulary. */
#define BAD_FRAME "bad_frame"
#define INVALID "invalid"
#define NOT_FOUND "not_found"
#define COMMAND_NOT_FOUND "command_not_found"
#define PERMISSION "permission"
#define INTERNAL "internal"

/* The error kind of a failed system call, as agent.py's ERRNO_KINDS names it. */
static const char *errno_kind(int err) {
    switch (err) {
    case ENOENT:
        return NOT_FOUND;
    case EEXIST:
        return "exists";
    case EACCES:
    case EPERM:
        return PERMISSION;
    case EISDIR:
        return "is_directory";
    case ENOTDIR:
        return "not_directory";
    case ENOTEMPTY:
        return "not_empty";
    case ENOSPC:
    case EDQUOT:
        return "no_space";
    default:
        return INTERNAL;
    }
}

static void die(const char *what) {
    fprintf(stderr, "cryobox-agent: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void *xmalloc(size_t size) {
    void *p = malloc(size ? size : 1);
    if (!p) {
        fputs("cryobox-agent: out of memory\n", stderr);
        exit(1);
    }
    return p;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ------------------------------------------------------------------ event sources */

enum kind { PORT, HELPER, HELPER_EXIT, CMD_OUT, CMD_ERR, CMD_IN, CMD_EXIT };

struct source {
    enum kind kind;
    int fd;
    uint32_t events; /* registered with epoll; 0: not registered */
    struct command *cmd;
};

static int ep = -1;

/* Register exactly ``events`` for the source: removed when none (a hung-up fd would
 * otherwise report EPOLLHUP at every turn of the loop). */
static void watch_events(struct source *src, uint32_t events) {
    if (src->fd < 0 || events == src->events)
        return;
    struct epoll_event ev = {.events = events, .data.ptr = src};
    int op = !src->events ? EPOLL_CTL_ADD : !events ? EPOLL_CTL_DEL : EPOLL_CTL_MOD;
    if (epoll_ctl(ep, op, src->fd, &ev) != 0)
        die("epoll_ctl");
    src->events = events;
}

static void close_source(struct source *src) {
    watch_events(src, 0);
    if (src->fd >= 0)
        close(src->fd);
    src->fd = -1;
}

/* ------------------------------------------------------------------ frames */

struct frame_out {
    struct frame_out *next;
    char *data;
    size_t len, off;
    bool droppable;
};

struct queue {
    struct frame_out *head, *tail;
    size_t queued;        /* bytes not yet written */
    size_t queued_output; /* of which droppable */
};

static void queue_push(struct queue *q, char *data, size_t len, bool droppable) {
    struct frame_out *f = xmalloc(sizeof *f);
    *f = (struct frame_out){.data = data, .len = len, .droppable = droppable};
    if (q->tail)
        q->tail->next = f;
    else
        q->head = f;
    q->tail = f;
    q->queued += len;
    if (droppable)
        q->queued_output += len;
}

static void queue_pop(struct queue *q) {
    struct frame_out *f = q->head;
    q->head = f->next;
    if (!q->head)
        q->tail = NULL;
    q->queued -= f->len - f->off;
    if (f->droppable)
        q->queued_output -= f->len;
    free(f->data);
    free(f);
}

static void queue_clear(struct queue *q) {
    while (q->head)
        queue_pop(q);
}

static void put_u32(char *at, uint32_t value) {
    at[0] = (char)(value >> 24);
    at[1] = (char)(value >> 16);
    at[2] = (char)(value >> 8);
    at[3] = (char)value;
}

static uint32_t get_u32(const unsigned char *at) {
    return (uint32_t)at[0] << 24 | (uint32_t)at[1] << 16 | (uint32_t)at[2] << 8 | at[3];
}

/* A frame of ``header`` (stolen) and ``payload``; NULL when over a bound. */
static char *encode(json_t *header, const char *payload, size_t payload_len, size_t *len) {
    char *raw = json_dumps(header, JSON_COMPACT | JSON_ENCODE_ANY);
    json_decref(header);
    if (!raw)
        return NULL;
    size_t header_len = strlen(raw);
    if (header_len > MAX_HEADER || payload_len > MAX_PAYLOAD) {
        free(raw);
        return NULL;
    }
    *len = PREFIX_SIZE + header_len + payload_len;
    char *data = xmalloc(*len);
    memcpy(data, MAGIC, 4);
    put_u32(data + 4, (uint32_t)header_len);
    put_u32(data + 8, (uint32_t)payload_len);
    memcpy(data + PREFIX_SIZE, raw, header_len);
    if (payload_len)
        memcpy(data + PREFIX_SIZE + header_len, payload, payload_len);
    free(raw);
    return data;
}

/* The incremental decoder of protocol.Decoder: garbage is skipped to the next magic.
 * Bytes not yet decoded are buf[start, end): a frame taken only moves ``start`` (many
 * small frames in one read cost no copy each), and a feed compacts. */
struct decoder {
    unsigned char *buf;
    size_t start, end, cap;
};

struct frame_in {
    bool garbage;   /* not a frame: bytes skipped (see error) */
    json_t *header; /* NULL for a frame whose header jansson does not take */
    char error[200];
    const char *raw; /* the whole frame as received */
    size_t raw_len;
    const char *payload;
    size_t payload_len;
};

static void decoder_reset(struct decoder *d) {
    d->start = d->end = 0;
}

static void decoder_feed(struct decoder *d, const char *data, size_t len) {
    size_t kept = d->end - d->start;
    if (d->start) {
        memmove(d->buf, d->buf + d->start, kept);
        d->start = 0;
        d->end = kept;
    }
    if (kept + len > d->cap) {
        d->cap = (kept + len) * 2;
        d->buf = realloc(d->buf, d->cap);
        if (!d->buf)
            die("realloc");
    }
    memcpy(d->buf + d->end, data, len);
    d->end += len;
}

static void decoder_drop(struct decoder *d, size_t n) {
    d->start += n;
    if (d->start == d->end)
        decoder_reset(d);
}

/* Where the next possible frame starts in ``b`` (``len`` bytes), from ``from`` on. */
static size_t find_magic(const unsigned char *b, size_t len, size_t from) {
    for (size_t i = from; i + 4 <= len; i++)
        if (memcmp(b + i, MAGIC, 4) == 0)
            return i;
    /* keep a tail that could begin a magic split across reads */
    for (size_t keep = 3; keep > 0; keep--)
        if (len >= keep && len - keep >= from && memcmp(b + len - keep, MAGIC, keep) == 0)
            return len - keep;
    return len;
}

/* The next frame or error in ``out`` (consumed bytes: *used); false when more is needed. */
static bool decoder_next(struct decoder *d, struct frame_in *out, size_t *used) {
    const unsigned char *b = d->buf + d->start;
    size_t len = d->end - d->start;
    *out = (struct frame_in){0};
    *used = 0;
    if (!len)
        return false;
    bool bad_magic = memcmp(b, MAGIC, len < 4 ? len : 4) != 0;
    uint32_t header_len = 0, payload_len = 0;
    if (!bad_magic) {
        if (len < PREFIX_SIZE)
            return false;
        header_len = get_u32(b + 4);
        payload_len = get_u32(b + 8);
    }
    if (bad_magic || header_len > MAX_HEADER || payload_len > MAX_PAYLOAD) {
        size_t skip = find_magic(b, len, 1);
        if (bad_magic)
            snprintf(out->error, sizeof out->error, "bad magic: skipped %zu bytes", skip);
        else
            snprintf(out->error, sizeof out->error,
                     "frame lengths %u/%u exceed %d/%d: skipped %zu bytes", header_len, payload_len,
                     MAX_HEADER, MAX_PAYLOAD, skip);
        *used = skip;
        out->garbage = true;
        return true;
    }
    size_t frame_len = PREFIX_SIZE + (size_t)header_len + payload_len;
    if (len < frame_len)
        return false;
    /* A header jansson refuses (not JSON, or JSON beyond RFC 8259 that Python's json
     * reads: NaN, lone surrogates, huge integers) is left for the Python agent, whose
     * answer, or error, is the protocol's. */
    json_error_t err;
    json_t *header = json_loadb((const char *)b + PREFIX_SIZE, header_len, JSON_ALLOW_NUL, &err);
    if (header && !json_is_object(header)) {
        json_decref(header);
        header = NULL;
    }
    out->header = header;
    out->raw = (const char *)b;
    out->raw_len = frame_len;
    out->payload = (const char *)b + PREFIX_SIZE + header_len;
    out->payload_len = payload_len;
    *used = frame_len;
    return true;
}

/* ------------------------------------------------------------------ the port */

static struct source port = {.kind = PORT, .fd = -1};
static struct queue outbox;
static struct decoder port_in;
static bool away, reading, writer;
static int64_t retry_at, read_again_at; /* CLOCK_MONOTONIC ms; 0: none */
static int64_t read_ns;                 /* when the last read brought bytes */

static void port_events(void) {
    watch_events(&port, (reading ? EPOLLIN : 0) | (writer ? EPOLLOUT : 0));
}

static void start_reading(void) {
    read_again_at = 0;
    reading = true;
    port_events();
}

static void room_changed(void);
static void send_frame(char *data, size_t len, bool droppable);

static void send_json(json_t *header, const char *payload, size_t payload_len, bool droppable) {
    size_t len;
    char *data = encode(header, payload, payload_len, &len);
    if (!data) {
        fputs("cryobox-agent: a frame over its bounds was not sent\n", stderr);
        return;
    }
    send_frame(data, len, droppable);
}

static void send_hello(void) {
    send_json(json_pack("{s:n,s:s,s:i}", "id", "event", "hello", "pid", (int)getpid()), NULL, 0,
              false);
}

/* Cut ``text`` before a UTF-8 sequence that a bounded snprintf left incomplete: jansson
 * refuses invalid UTF-8, and a refused answer would leave its request unanswered. */
static void trim_utf8(char *text) {
    size_t len = strlen(text), lead = len;
    while (lead > 0 && len - lead < 4 && ((unsigned char)text[lead - 1] & 0xC0) == 0x80)
        lead--;
    if (lead == 0)
        return;
    unsigned char first = (unsigned char)text[lead - 1];
    size_t need = first >= 0xF0 ? 4 : first >= 0xE0 ? 3 : first >= 0xC0 ? 2 : 1;
    if (len - (lead - 1) < need)
        text[lead - 1] = 0;
}

static void send_error(json_t *id, const char *kind, const char *message) {
    char text[1024];
    snprintf(text, sizeof text, "%s", message);
    trim_utf8(text);
    json_t *header = json_pack("{s:O,s:b,s:{s:s,s:s}}", "id", id ? id : json_null(), "ok", 0,
                               "error", "kind", kind, "message", text);
    if (!header) /* never no answer */
        header = json_pack("{s:O,s:b,s:{s:s,s:s}}", "id", id ? id : json_null(), "ok", 0, "error",
                           "kind", INTERNAL, "message", "an error it could not say");
    send_json(header, NULL, 0, false);
}

static bool host_away(void) {
    struct pollfd p = {.fd = port.fd, .events = POLLOUT};
    return poll(&p, 1, 0) > 0 && (p.revents & POLLHUP);
}

static void try_later(void) {
    away = true;
    writer = false; /* POLLHUP would wake a writer at once, again and again */
    port_events();
    if (!retry_at)
        retry_at = now_ms() + RETRY_MS;
}

static void wrote(size_t written) {
    outbox.queued -= written;
    if (!reading) {
        if (away)
            start_reading();
        else if (!read_again_at)
            read_again_at = now_ms() + RETRY_MS;
    }
    away = false;
    room_changed();
}

static void flush_port(void) {
    retry_at = 0;
    if (port.fd < 0)
        return;
    while (outbox.head) {
        struct frame_out *f = outbox.head;
        ssize_t n = write(port.fd, f->data + f->off, f->len - f->off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN) {
            if (host_away()) {
                try_later();
            } else { /* the host is slow to read: wait for room */
                writer = true;
                port_events();
            }
            return;
        }
        if (n <= 0) { /* an error, or nothing queued by the driver: not a loop */
            try_later();
            return;
        }
        f->off += (size_t)n;
        wrote((size_t)n);
        if (f->off == f->len)
            queue_pop(&outbox);
    }
    writer = false;
    port_events();
}

static void send_frame(char *data, size_t len, bool droppable) {
    if (droppable && outbox.queued_output + len > MAX_QUEUED_OUTPUT) {
        free(data);
        return;
    }
    queue_push(&outbox, data, len, droppable);
    if (!writer && !retry_at)
        flush_port();
}

/* Whether output should wait: more than HIGH bytes queued for a connected host. */
static bool crowded(void) {
    return outbox.queued > HIGH && !away;
}

static void host_left(void) {
    decoder_reset(&port_in);
    reading = false;
    port_events();
    if (outbox.head && outbox.head->off > 0)
        queue_pop(&outbox); /* the rest of a frame cut off mid-write is garbage to a new host */
    send_hello();
}

/* ------------------------------------------------------------------ the helper */

/* The Python agent: started with a socket pair as its port; its frames are relayed. */
static struct source helper = {.kind = HELPER, .fd = -1};
static struct source helper_exit = {.kind = HELPER_EXIT, .fd = -1};
static pid_t helper_pid;
static struct queue to_helper;
static struct decoder helper_in;
static bool helper_ready;       /* it said hello: the system is set up */
static int helper_failures;     /* exits before its first hello */
static int64_t helper_start_at; /* when to start it again (0: running or not needed) */
static int64_t helper_started;
/* Requests the helper has not answered yet (failed if it dies). */
static int64_t *pending;
static size_t n_pending, cap_pending;
static char **helper_argv;

static void pending_add(int64_t id) {
    if (n_pending == cap_pending) {
        cap_pending = cap_pending ? cap_pending * 2 : 16;
        pending = realloc(pending, cap_pending * sizeof *pending);
        if (!pending)
            die("realloc");
    }
    pending[n_pending++] = id;
}

static bool pending_remove(int64_t id) {
    for (size_t i = 0; i < n_pending; i++)
        if (pending[i] == id) {
            pending[i] = pending[--n_pending];
            return true;
        }
    return false;
}

/* Read the Python part's frames while the port has room: while the host is away too, for
 * what is not droppable (a file read would otherwise pile up here whole; behind its
 * socket it waits, as it does on the port). */
static void helper_events(void) {
    bool read_more = !crowded() && outbox.queued - outbox.queued_output <= HIGH;
    watch_events(&helper, (read_more ? EPOLLIN : 0) | (to_helper.head ? EPOLLOUT : 0));
}

/* A child about to exec a command or the Python part: into the commands' cgroup, where
 * a pids and a memory limit hold (made by cryobox-init, guest/init.c), and back within
 * the OOM killer's reach (init and this front are kept out of it). Async-signal-safe:
 * it runs between clone and exec. Where the cgroup is missing, nothing changes. */
static void enter_commands(void) {
    static const char *const writes[][2] = {
        {"/sys/fs/cgroup/commands/cgroup.procs", "0"},
        {"/proc/self/oom_score_adj", "0"},
    };
    for (size_t i = 0; i < sizeof writes / sizeof writes[0]; i++) {
        int fd = open(writes[i][0], O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            if (write(fd, writes[i][1], 1) < 0) { /* not confined: the command runs anyway */
            }
            close(fd);
        }
    }
}

/* Start the Python part; when the guest cannot (no descriptors or processes left), try
 * again a second later: the front goes on serving meanwhile. */
static void start_helper(void) {
    int pair[2] = {-1, -1};
    pid_t pid = -1;
    int exited = -1;
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, pair) == 0)
        pid = fork();
    if (pid > 0)
        exited = (int)syscall(SYS_pidfd_open, pid, 0);
    if (pid < 0 || (pid > 0 && exited < 0)) {
        fprintf(stderr, "cryobox-agent: cannot start the Python agent: %s\n", strerror(errno));
        if (pid > 0) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
        }
        if (pair[0] >= 0) {
            close(pair[0]);
            close(pair[1]);
        }
        helper_start_at = now_ms() + HELPER_RESTART_MS;
        return;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() == 1)
            _exit(1);
        signal(SIGPIPE, SIG_DFL);
        enter_commands();
        if (pair[1] == 3)
            fcntl(3, F_SETFD, 0);
        else
            dup2(pair[1], 3); /* dup2 clears close-on-exec */
        execv(helper_argv[0], helper_argv);
        fprintf(stderr, "cryobox-agent: cannot start %s: %s\n", helper_argv[0], strerror(errno));
        _exit(127);
    }
    close(pair[1]);
    helper_pid = pid;
    helper.fd = pair[0];
    helper.events = 0;
    helper_exit.fd = exited;
    helper_exit.events = 0;
    watch_events(&helper_exit, EPOLLIN);
    helper_started = now_ms();
    helper_start_at = 0;
    helper_events();
}

static void flush_helper(void) {
    while (to_helper.head) {
        struct frame_out *f = to_helper.head;
        ssize_t n = write(helper.fd, f->data + f->off, f->len - f->off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno != EAGAIN) { /* it is gone: its exit says the rest */
            watch_events(&helper, 0);
            return;
        }
        if (n < 0)
            break; /* waits for EPOLLOUT */
        f->off += (size_t)n;
        to_helper.queued -= (size_t)n;
        if (f->off == f->len)
            queue_pop(&to_helper);
    }
    helper_events();
}

/* A frame as received, to queue (the decoder's buffer is reused). */
static char *copy_raw(const struct frame_in *frame) {
    char *copy = xmalloc(frame->raw_len);
    memcpy(copy, frame->raw, frame->raw_len);
    return copy;
}

/* Hand a request to the Python agent; ``id`` (when known) is failed if it dies first. */
static void to_helper_frame(const struct frame_in *frame, json_t *id) {
    queue_push(&to_helper, copy_raw(frame), frame->raw_len, false);
    if (json_is_integer(id))
        pending_add(json_integer_value(id));
    if (helper.fd >= 0)
        flush_helper();
}

static void open_port(void);

/* A frame the helper sent: its hello is ours to say, the rest goes to the host. */
static void from_helper_frame(const struct frame_in *frame) {
    if (frame->garbage) {
        fprintf(stderr, "cryobox-agent: the Python agent sent a bad frame: %s\n", frame->error);
        return;
    }
    if (!frame->header) {
        /* A whole frame whose header jansson refuses with its integers as integers (one
         * past 2**63: Python's json writes and reads it): the host's to read, as sent.
         * Dropped, its request went unanswered until the host's timeout. Read again
         * with its numbers as reals for its id, no longer pending once answered (or the
         * Python agent's death later would answer it a second time). */
        json_error_t err;
        size_t header_len = (size_t)(frame->payload - frame->raw) - PREFIX_SIZE;
        json_t *lenient = json_loadb(frame->raw + PREFIX_SIZE, header_len,
                                     JSON_ALLOW_NUL | JSON_DECODE_INT_AS_REAL, &err);
        if (!json_is_object(lenient)) {
            fprintf(stderr, "cryobox-agent: the Python agent sent a bad frame: %s\n",
                    lenient ? "its header is not an object" : err.text);
            json_decref(lenient);
            return;
        }
        json_t *id = json_object_get(lenient, "id");
        if (json_is_number(id) && json_object_get(lenient, "ok"))
            pending_remove((int64_t)json_number_value(id));
        json_decref(lenient);
        send_frame(copy_raw(frame), frame->raw_len, false);
        return;
    }
    json_t *id = json_object_get(frame->header, "id");
    const char *event = json_string_value(json_object_get(frame->header, "event"));
    if (json_is_null(id) && event && strcmp(event, "hello") == 0) {
        if (!helper_ready) {
            helper_ready = true;
            open_port();
        }
        return;
    }
    if (json_is_integer(id) && json_object_get(frame->header, "ok"))
        pending_remove(json_integer_value(id));
    bool droppable = event && (!strcmp(event, "stdout") || !strcmp(event, "stderr"));
    send_frame(copy_raw(frame), frame->raw_len, droppable);
}

static void relay_from_helper(const char *data, size_t len) {
    decoder_feed(&helper_in, data, len);
    struct frame_in frame;
    size_t used;
    while (decoder_next(&helper_in, &frame, &used)) {
        from_helper_frame(&frame);
        json_decref(frame.header);
        decoder_drop(&helper_in, used);
    }
}

static void on_helper_readable(void) {
    char buf[READ_SIZE];
    ssize_t n = read(helper.fd, buf, sizeof buf);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (n <= 0) { /* it is ending: its exit says the rest */
        watch_events(&helper, 0);
        return;
    }
    relay_from_helper(buf, (size_t)n);
    helper_events();
}

static void on_helper_exit(void) {
    int status = 0;
    waitpid(helper_pid, &status, 0);
    /* what it answered before it died is answered, not failed */
    char buf[READ_SIZE];
    ssize_t n;
    while (helper.fd >= 0 && (n = read(helper.fd, buf, sizeof buf)) > 0)
        relay_from_helper(buf, (size_t)n);
    fprintf(stderr, "cryobox-agent: the Python agent exited (status %d), starting it again\n",
            status);
    close_source(&helper_exit);
    close_source(&helper);
    queue_clear(&to_helper);
    decoder_reset(&helper_in);
    for (size_t i = 0; i < n_pending; i++) {
        json_t *id = json_integer(pending[i]);
        send_error(id, INTERNAL,
                   "the guest agent restarted (its Python part, which served this request, died)");
        json_decref(id);
    }
    n_pending = 0;
    if (!helper_ready && ++helper_failures == HELPER_TRIES_BEFORE_PORT) {
        fprintf(stderr, "cryobox-agent: the Python agent never started: serving without it\n");
        helper_ready = true;
        open_port();
    }
    int64_t soonest = helper_started + HELPER_RESTART_MS;
    helper_start_at = soonest > now_ms() ? soonest : now_ms();
}

/* The port's room changed: output held back may go on. */
static void command_room(void);
static void room_changed(void) {
    if (outbox.queued <= LOW) {
        command_room();
        if (helper.fd >= 0)
            helper_events();
    }
}

/* ------------------------------------------------------------------ files and identity */

/* Replace a small file's text in place (not truncated to zero first: ext4 flushes a
 * file truncated to zero when it is closed, ~10 ms under emulation). */
static int rewrite(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    size_t len = strlen(text);
    int rc = write(fd, text, len) == (ssize_t)len ? 0 : -1;
    struct stat st;
    if (rc == 0 && fstat(fd, &st) == 0 && (size_t)st.st_size > len)
        rc = ftruncate(fd, (off_t)len);
    int saved = errno;
    close(fd);
    errno = saved;
    return rc;
}

static void read_stripped(const char *path, char *out, size_t size) {
    out[0] = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, out, size - 1);
    close(fd);
    if (n < 0)
        n = 0;
    out[n] = 0;
    while (n > 0 && (out[n - 1] == '\n' || out[n - 1] == ' '))
        out[--n] = 0;
}

/* A template's command defaults (protocol.py's COMMAND_DEFAULTS: its Dockerfile's ENV,
 * USER and WORKDIR), as agent.py's command_defaults() reads them: read again only when
 * the file changes, and ignored unless it is a JSON object whose "env" is an object of
 * strings and whose "user" and "workdir" are strings. */
#define COMMAND_DEFAULTS "/etc/cryobox/defaults.json"
static json_t *defaults;

/* The file, or the one CRYOBOX_COMMAND_DEFAULTS names (the host's unit tests). */
static const char *defaults_path(void) {
    const char *path = getenv("CRYOBOX_COMMAND_DEFAULTS");
    return path && *path ? path : COMMAND_DEFAULTS;
}

static struct stat defaults_seen;

static bool valid_defaults(json_t *value) {
    if (!json_is_object(value))
        return false;
    json_t *env = json_object_get(value, "env");
    if (env && !json_is_object(env))
        return false;
    const char *key;
    json_t *item;
    json_object_foreach(env, key, item) {
        if (!json_is_string(item))
            return false;
    }
    json_t *user = json_object_get(value, "user"), *workdir = json_object_get(value, "workdir");
    return (!user || json_is_string(user)) && (!workdir || json_is_string(workdir));
}

static json_t *command_defaults(void) {
    struct stat st;
    if (stat(defaults_path(), &st) != 0) {
        json_decref(defaults);
        defaults = NULL;
        memset(&defaults_seen, 0, sizeof defaults_seen);
        return NULL;
    }
    if (defaults_seen.st_ino == st.st_ino && defaults_seen.st_size == st.st_size &&
        defaults_seen.st_mtim.tv_sec == st.st_mtim.tv_sec &&
        defaults_seen.st_mtim.tv_nsec == st.st_mtim.tv_nsec)
        return defaults;
    defaults_seen = st;
    json_decref(defaults);
    defaults = st.st_size <= (1 << 20) ? json_load_file(defaults_path(), 0, NULL) : NULL;
    if (defaults && !valid_defaults(defaults)) {
        json_decref(defaults);
        defaults = NULL;
    }
    return defaults;
}

/* A non-empty string of the defaults, or NULL. */
static const char *default_text(json_t *found, const char *name) {
    json_t *value = json_object_get(found, name);
    return json_is_string(value) && *json_string_value(value) ? json_string_value(value) : NULL;
}

/* The fork identity every later command gets (also read by the Python agent). */
static char fork_id[32], forked_from[256];

static void read_fork_identity(void) {
    char text[512];
    fork_id[0] = forked_from[0] = 0;
    read_stripped(RUN_DIR "/fork", text, sizeof text);
    char *line = strtok(text, "\n");
    for (; line; line = strtok(NULL, "\n")) {
        if (!strncmp(line, "fork_id=", 8))
            snprintf(fork_id, sizeof fork_id, "%s", line + 8);
        else if (!strncmp(line, "forked_from=", 12))
            snprintf(forked_from, sizeof forked_from, "%s", line + 12);
    }
}

static bool boot_id_mounted(void) {
    FILE *mounts = fopen("/proc/self/mounts", "re");
    if (!mounts)
        return false;
    char line[1024];
    bool found = false;
    while (!found && fgets(line, sizeof line, mounts))
        found = strstr(line, " /proc/sys/kernel/random/boot_id ") != NULL;
    fclose(mounts);
    return found;
}

/* Whether our file is mounted over the kernel's boot_id (asked once, at start: a
 * restore's refresh then reads no mount table). */
static bool boot_id_is_ours;

/* The kernel's boot_id is read-only: the Python agent mounts a file over it at boot. */
static int set_boot_id(const char *boot_id) {
    char text[128];
    snprintf(text, sizeof text, "%s\n", boot_id);
    if (rewrite(RUN_DIR "/boot_id", text) != 0)
        return -1;
    if (!boot_id_is_ours) {
        umount2("/proc/sys/kernel/random/boot_id", MNT_DETACH);
        boot_id_is_ours =
            mount(RUN_DIR "/boot_id", "/proc/sys/kernel/random/boot_id", NULL, MS_BIND, NULL) == 0;
    }
    return 0;
}

static void random_hex(char *out, size_t bytes) {
    unsigned char raw[32];
    if (getrandom(raw, bytes, 0) != (ssize_t)bytes)
        memset(raw, 0, sizeof raw);
    for (size_t i = 0; i < bytes; i++)
        sprintf(out + 2 * i, "%02x", raw[i]);
}

/* ------------------------------------------------------------------ ping and refresh */

static json_t *ping(void) {
    char boot_id[128], host[256] = "";
    read_stripped("/proc/sys/kernel/random/boot_id", boot_id, sizeof boot_id);
    gethostname(host, sizeof host - 1);
    return json_pack("{s:I,s:s,s:s,s:i}", "time_ns", (json_int_t)now_ns(CLOCK_REALTIME), "boot_id",
                     boot_id, "hostname", host, "pid", (int)getpid());
}

/* Whether a JSON string holds a NUL (C would cut it there; Python refuses it). */
static bool has_nul(json_t *text) {
    return json_is_string(text) && strlen(json_string_value(text)) != json_string_length(text);
}

/* ``str(value)`` as Python says it, for environment values that are not strings. */
static char *python_str(json_t *value) {
    if (json_is_string(value))
        return strdup(json_string_value(value));
    if (json_is_true(value))
        return strdup("True");
    if (json_is_false(value))
        return strdup("False");
    if (json_is_null(value))
        return strdup("None");
    return json_dumps(value, JSON_COMPACT | JSON_ENCODE_ANY);
}

/* Whether Python takes ``value`` for false (``value or default``). */
static bool python_falsy(json_t *value) {
    return !value || json_is_null(value) || json_is_false(value) ||
           (json_is_integer(value) && !json_integer_value(value)) ||
           (json_is_real(value) && json_real_value(value) == 0.0) ||
           (json_is_string(value) && !json_string_length(value)) ||
           (json_is_array(value) && !json_array_size(value)) ||
           (json_is_object(value) && !json_object_size(value));
}

/* ``int(value)`` as Python takes it: an integer, a number (truncated) or a string of
 * digits; false for anything else. */
static bool python_int(json_t *value, int64_t *out) {
    if (json_is_integer(value)) {
        *out = json_integer_value(value);
        return true;
    }
    if (json_is_real(value)) {
        double number = json_real_value(value);
        if (!(number > -9.2e18 && number < 9.2e18))
            return false;
        *out = (int64_t)number;
        return true;
    }
    if (json_is_string(value)) {
        char *end;
        const char *text = json_string_value(value);
        errno = 0;
        long long number = strtoll(text, &end, 10);
        while (*end == ' ' || *end == '\n' || *end == '\t')
            end++;
        if (errno || end == text || *end)
            return false;
        *out = number;
        return true;
    }
    return false;
}

/* An argument that should have been an integer, named in the error (INVALID). */
static void not_an_integer(const char *name, json_t *value, char *failed, size_t size) {
    char *said = json_dumps(value, JSON_COMPACT | JSON_ENCODE_ANY);
    snprintf(failed, size, "bad arguments: %s must be an integer, not %.200s", name,
             said ? said : "?");
    free(said);
}

/* Make a restored guest current: clock, entropy, and (for a new sandbox) identity.
 * NULL when it failed: ``kind`` and ``failed`` say why. */
static json_t *refresh(json_t *args, const char *payload, size_t payload_len, const char **kind,
                       char *failed, size_t size) {
    json_t *time_ns = json_object_get(args, "time_ns");
    json_t *fork = json_object_get(args, "fork_id");
    int64_t ns, fork_number = 0;
    *kind = INVALID;
    if (time_ns && !python_int(time_ns, &ns)) {
        not_an_integer("time_ns", time_ns, failed, size);
        return NULL;
    }
    if (fork && !python_int(fork, &fork_number)) {
        not_an_integer("fork_id", fork, failed, size);
        return NULL;
    }
    *kind = INTERNAL;
    if (time_ns) {
        struct timespec ts = {.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
        clock_settime(CLOCK_REALTIME, &ts);
    }
    if (payload_len) {
        int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, payload, payload_len) < 0) {
            *kind = errno_kind(errno);
            snprintf(failed, size, "%s: /dev/urandom", strerror(errno));
            if (fd >= 0)
                close(fd);
            return NULL;
        }
        close(fd);
    }
    if (json_object_get(args, "hostname")) {
        char text[300], random_id[33];
        char *hostname = python_str(json_object_get(args, "hostname"));
        json_t *given = json_object_get(args, "machine_id");
        char *machine_id = python_falsy(given) ? NULL : python_str(given);
        if (!machine_id) {
            random_hex(random_id, 16);
            machine_id = strdup(random_id);
        }
        sethostname(hostname, strlen(hostname));
        snprintf(text, sizeof text, "%s\n", hostname);
        rewrite("/etc/hostname", text);
        snprintf(text, sizeof text, "%s\n", machine_id);
        rewrite("/etc/machine-id", text);
        free(hostname);
        free(machine_id);
    }
    if (json_object_get(args, "boot_id")) {
        char *boot_id = python_str(json_object_get(args, "boot_id"));
        int rc = set_boot_id(boot_id);
        free(boot_id);
        if (rc != 0) {
            *kind = errno_kind(errno);
            snprintf(failed, size, "%s: %s/boot_id", strerror(errno), RUN_DIR);
            return NULL;
        }
    }
    if (fork) {
        json_t *from_json = json_object_get(args, "forked_from");
        char *from = from_json ? python_str(from_json) : strdup("");
        char text[400];
        snprintf(fork_id, sizeof fork_id, "%" PRId64, fork_number);
        snprintf(forked_from, sizeof forked_from, "%s", from);
        free(from);
        snprintf(text, sizeof text, "fork_id=%s\nforked_from=%s\n", fork_id, forked_from);
        if (rewrite(RUN_DIR "/fork", text) != 0) {
            *kind = errno_kind(errno);
            snprintf(failed, size, "%s: %s/fork", strerror(errno), RUN_DIR);
            return NULL;
        }
    }
    double spent_ms = (double)(now_ns(CLOCK_MONOTONIC) - read_ns) / 1e6;
    return json_pack("{s:I,s:i,s:f}", "time_ns", (json_int_t)now_ns(CLOCK_REALTIME), "pid",
                     (int)getpid(), "spent_ms", spent_ms);
}

/* ------------------------------------------------------------------ commands */

struct stdin_write {
    struct stdin_write *next;
    char *data;
    size_t len, off;
    int64_t request; /* answered once written */
    bool eof;
};

struct command {
    struct command *next;
    int64_t rid;
    pid_t pid;
    struct source out, err, in, exited;
    bool paused, held;
    bool had_stdin, stdin_closed;
    struct stdin_write *writes, *last_write;
    int64_t deadline; /* CLOCK_MONOTONIC ms; 0: none */
    bool timed_out;
};

static struct command *commands;

static struct command *find_command(json_t *id) {
    if (!json_is_integer(id))
        return NULL;
    for (struct command *c = commands; c; c = c->next)
        if (c->rid == json_integer_value(id))
            return c;
    return NULL;
}

/* Read the outputs exactly while neither the host nor a crowded port holds them. */
static void follow(struct command *c) {
    bool on = !c->paused && !c->held;
    watch_events(&c->out, on ? EPOLLIN : 0);
    watch_events(&c->err, on ? EPOLLIN : 0);
}

static void command_room(void) {
    for (struct command *c = commands; c; c = c->next)
        if (c->held) {
            c->held = false;
            follow(c);
        }
}

/* An output event of ``src`` (droppable: see send_frame). */
static void send_output(struct command *c, const struct source *src, const char *data, size_t len) {
    const char *stream = src == &c->out ? "stdout" : "stderr";
    send_json(json_pack("{s:I,s:s}", "id", (json_int_t)c->rid, "event", stream), data, len, true);
}

/* Forward what a pipe holds now; close it at its end. A crowded port holds the command. */
static void read_output(struct command *c, struct source *src) {
    char buf[READ_SIZE];
    ssize_t n = read(src->fd, buf, sizeof buf);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (n <= 0) {
        close_source(src);
        return;
    }
    send_output(c, src, buf, (size_t)n);
    if (!c->held && crowded()) {
        c->held = true;
        follow(c);
    }
}

static void answer(json_t *id, json_t *result);

static void answer_stdin(struct stdin_write *w, const char *error) {
    json_t *id = json_integer(w->request);
    if (error)
        send_error(id, INVALID, error);
    else
        answer(id, NULL);
    json_decref(id);
}

static void fail_stdin(struct command *c, const char *why) {
    while (c->writes) {
        struct stdin_write *w = c->writes;
        c->writes = w->next;
        answer_stdin(w, why);
        free(w->data);
        free(w);
    }
    c->last_write = NULL;
    close_source(&c->in);
    c->stdin_closed = true;
}

static void flush_stdin(struct command *c) {
    while (c->writes) {
        struct stdin_write *w = c->writes;
        while (w->off < w->len) {
            ssize_t n = write(c->in.fd, w->data + w->off, w->len - w->off);
            if (n < 0 && errno == EINTR)
                continue;
            if (n < 0 && errno == EAGAIN) {
                watch_events(&c->in, EPOLLOUT);
                return;
            }
            if (n < 0) {
                fail_stdin(c, "the command closed its stdin");
                return;
            }
            w->off += (size_t)n;
        }
        c->writes = w->next;
        if (!c->writes)
            c->last_write = NULL;
        if (w->eof) {
            close_source(&c->in);
            c->stdin_closed = true;
        }
        answer_stdin(w, NULL);
        free(w->data);
        free(w);
        if (c->stdin_closed) {
            fail_stdin(c, "the command closed its stdin");
            return;
        }
    }
    watch_events(&c->in, 0);
}

/* Send what a pipe holds, to its end or to what is there now: a process the command
 * left in the background may hold it open (``server &`` must not hang the call). */
static void drain(struct command *c, struct source *src) {
    char buf[READ_SIZE];
    while (src->fd >= 0) {
        ssize_t n = read(src->fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            close_source(src);
            return;
        }
        send_output(c, src, buf, (size_t)n);
    }
}

/* Commands that ended during this turn of the loop: freed after it (its batch of
 * events may still name them). */
static struct command *ended;

static void finish_command(struct command *c, int status) {
    drain(c, &c->out);
    drain(c, &c->err);
    close_source(&c->exited);
    fail_stdin(c, "the command closed its stdin");
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    json_t *sig = WIFSIGNALED(status) ? json_integer(WTERMSIG(status)) : json_null();
    send_json(json_pack("{s:I,s:b,s:{s:i,s:o,s:b,s:i}}", "id", (json_int_t)c->rid, "ok", 1,
                        "result", "exit_code", code, "signal", sig, "timed_out", c->timed_out,
                        "pid", (int)c->pid),
              NULL, 0, false);
    for (struct command **at = &commands; *at; at = &(*at)->next)
        if (*at == c) {
            *at = c->next;
            break;
        }
    c->next = ended;
    ended = c;
}

static void kill_group(pid_t pid, int sig) {
    kill(-pid, sig);
}

struct env {
    char **vars;
    size_t n, cap;
};

static void env_set(struct env *e, const char *key, const char *value) {
    size_t klen = strlen(key);
    char *var = xmalloc(klen + strlen(value) + 2);
    sprintf(var, "%s=%s", key, value);
    for (size_t i = 0; i < e->n; i++)
        if (!strncmp(e->vars[i], key, klen) && e->vars[i][klen] == '=') {
            free(e->vars[i]);
            e->vars[i] = var;
            return;
        }
    if (e->n + 2 > e->cap) {
        e->cap = e->cap ? e->cap * 2 : 16;
        e->vars = realloc(e->vars, e->cap * sizeof *e->vars);
        if (!e->vars)
            die("realloc");
    }
    e->vars[e->n++] = var;
    e->vars[e->n] = NULL;
}

static const char *env_get(const struct env *e, const char *key) {
    size_t klen = strlen(key);
    for (size_t i = 0; i < e->n; i++)
        if (!strncmp(e->vars[i], key, klen) && e->vars[i][klen] == '=')
            return e->vars[i] + klen + 1;
    return NULL;
}

static void env_free(struct env *e) {
    for (size_t i = 0; i < e->n; i++)
        free(e->vars[i]);
    free(e->vars);
}

/* A user as a command needs it: the lookup (NSS, the files read and parsed) runs once
 * per user until /etc/passwd or /etc/group change, so that a fork's first command runs
 * none of that code for its QEMU to translate. */
struct user {
    char name[64], home[256], shell[256];
    uid_t uid;
    gid_t gid;
    gid_t groups[256];
    int n_groups;
};

#define USERS_KEPT 8
static struct user users[USERS_KEPT];
static int n_users;
static struct stat users_passwd, users_group;

static bool same_file(const struct stat *a, const struct stat *b) {
    return a->st_ino == b->st_ino && a->st_size == b->st_size &&
           a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec;
}

/* NULL when there is no such user (or too long a name to keep). */
static const struct user *find_user(const char *name) {
    struct stat passwd = {0}, group = {0};
    stat("/etc/passwd", &passwd);
    stat("/etc/group", &group);
    if (!same_file(&passwd, &users_passwd) || !same_file(&group, &users_group)) {
        n_users = 0;
        users_passwd = passwd;
        users_group = group;
    }
    for (int i = 0; i < n_users; i++)
        if (!strcmp(users[i].name, name))
            return &users[i];
    struct passwd *entry = getpwnam(name);
    if (!entry || strlen(name) >= sizeof users[0].name)
        return NULL;
    struct user *u = &users[n_users < USERS_KEPT ? n_users++ : USERS_KEPT - 1];
    snprintf(u->name, sizeof u->name, "%s", name);
    snprintf(u->home, sizeof u->home, "%s", entry->pw_dir);
    snprintf(u->shell, sizeof u->shell, "%s",
             entry->pw_shell && *entry->pw_shell ? entry->pw_shell : "/bin/sh");
    u->uid = entry->pw_uid;
    u->gid = entry->pw_gid;
    u->n_groups = 256;
    if (getgrouplist(name, entry->pw_gid, u->groups, &u->n_groups) < 0)
        u->n_groups = 256; /* more than 256: the first 256 */
    return u;
}

/* What a command's child reports through its error pipe when it could not start. */
struct spawn_failure {
    int stage; /* 1: the working directory, 2: the program */
    int err;
};

struct spawn {
    char *const *argv;
    char **envp;
    const char *cwd;
    char **candidates; /* the program's paths to try, in order */
    bool as_user;
    const struct user *entry;
    int stdin_fd, out_fd, err_fd, report_fd;
};

/* The child, between clone and exec, on a stack of its own and the agent's memory:
 * async-signal-safe calls only. */
static int child(void *arg) {
    const struct spawn *s = arg;
    struct spawn_failure failure = {0, 0};
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    enter_commands();
    if (dup2(s->stdin_fd, 0) < 0 || dup2(s->out_fd, 1) < 0 || dup2(s->err_fd, 2) < 0)
        goto failed;
    /* Python's order (_posixsubprocess): the directory is entered before the user changes */
    if (chdir(s->cwd) != 0) {
        failure.stage = 1;
        goto failed;
    }
    setsid();
    if (s->as_user && (setgroups((size_t)s->entry->n_groups, s->entry->groups) != 0 ||
                       setgid(s->entry->gid) != 0 || setuid(s->entry->uid) != 0))
        goto failed;
    failure.stage = 2;
    int saved = ENOENT;
    for (char **path = s->candidates; *path; path++) {
        execve(*path, s->argv, s->envp);
        if (errno == EACCES)
            saved = EACCES;
        else if (errno != ENOENT && errno != ENOTDIR)
            saved = errno;
        if (saved != ENOENT && saved != EACCES)
            break;
    }
    errno = saved;
failed:
    failure.err = errno;
    if (write(s->report_fd, &failure, sizeof failure) < 0)
        _exit(126);
    _exit(127);
}

/* The paths execvpe would try for ``program`` along ``path`` (Python's rules). */
static char **candidates(const char *program, const char *path) {
    size_t n = 2;
    for (const char *p = path; *p; p++)
        n += *p == ':';
    char **out = xmalloc(n * sizeof *out);
    size_t i = 0;
    if (strchr(program, '/')) {
        out[i++] = strdup(program);
    } else {
        const char *start = path;
        for (;;) {
            const char *end = strchrnul(start, ':');
            size_t len = (size_t)(end - start);
            char *full = xmalloc(len + strlen(program) + 2);
            if (len)
                sprintf(full, "%.*s/%s", (int)len, start, program);
            else
                sprintf(full, "%s", program);
            out[i++] = full;
            if (!*end)
                break;
            start = end + 1;
        }
    }
    out[i] = NULL;
    return out;
}

static void free_strings(char **list) {
    for (char **p = list; p && *p; p++)
        free(*p);
    free(list);
}

/* Start a plain command (no terminal) in a session of its own; NULL and an error
 * (kind, message) when it could not start. */
static struct command *start_command(int64_t rid, json_t *args, const char **kind, char *message,
                                     size_t size) {
    json_t *shell = json_object_get(args, "shell");
    json_t *argv_json = json_object_get(args, "argv");
    size_t argc = 0;
    char **argv = NULL;
    struct command *c = NULL;
    struct env env = {0};
    char **paths = NULL;
    int fds[7] = {-1, -1, -1, -1, -1, -1, -1}; /* stdin r/w, out r/w, err r/w, devnull */
    int report[2] = {-1, -1};
    *kind = INVALID;
    bool nul = has_nul(shell) || has_nul(json_object_get(args, "cwd")) ||
               has_nul(json_object_get(args, "user"));
    for (size_t i = 0; json_is_array(argv_json) && i < json_array_size(argv_json); i++)
        nul = nul || has_nul(json_array_get(argv_json, i));
    if (nul) {
        snprintf(message, size, "bad arguments: embedded null byte");
        return NULL;
    }
    if (shell && !json_is_null(shell)) {
        if (!json_is_string(shell)) {
            snprintf(message, size, "exec needs argv (a list of strings) or shell (a string)");
            return NULL;
        }
        argv = xmalloc(4 * sizeof *argv);
        argv[0] = strdup("/bin/sh");
        argv[1] = strdup("-c");
        argv[2] = strdup(json_string_value(shell));
        argv[3] = NULL;
    } else {
        argc = json_is_array(argv_json) ? json_array_size(argv_json) : 0;
        bool strings = argc > 0;
        for (size_t i = 0; i < argc; i++)
            strings = strings && json_is_string(json_array_get(argv_json, i));
        if (!strings) {
            snprintf(message, size, "exec needs argv (a list of strings) or shell (a string)");
            return NULL;
        }
        argv = xmalloc((argc + 1) * sizeof *argv);
        for (size_t i = 0; i < argc; i++)
            argv[i] = strdup(json_string_value(json_array_get(argv_json, i)));
        argv[argc] = NULL;
    }
    json_t *user_json = json_object_get(args, "user");
    const char *user = json_is_string(user_json) && *json_string_value(user_json)
                           ? json_string_value(user_json)
                           : NULL;
    if (user_json && !json_is_null(user_json) && !json_is_string(user_json)) {
        snprintf(message, size, "bad arguments: user must be a string");
        goto fail;
    }
    json_t *preset = command_defaults();
    if (!user)
        user = default_text(preset, "user");
    const char *name = user ? user : "root";
    const struct user *entry = find_user(name);
    if (!entry) {
        *kind = NOT_FOUND;
        snprintf(message, size, "no such user in the guest: %s", name);
        goto fail;
    }
    struct spawn s = {.argv = argv, .as_user = user != NULL, .entry = entry};
    env_set(&env, "PATH", DEFAULT_PATH);
    env_set(&env, "HOME", entry->home);
    env_set(&env, "USER", name);
    env_set(&env, "LOGNAME", name);
    env_set(&env, "SHELL", entry->shell);
    env_set(&env, "LANG", "C.UTF-8");
    env_set(&env, "TERM", "xterm-256color");
    const char *preset_key;
    json_t *preset_value;
    json_object_foreach(json_object_get(preset, "env"), preset_key, preset_value) {
        env_set(&env, preset_key, json_string_value(preset_value));
    }
    read_fork_identity(); /* the Python part may have served the refresh */
    if (fork_id[0]) {
        env_set(&env, "CRYOBOX_FORK_ID", fork_id);
        env_set(&env, "CRYOBOX_FORKED_FROM", forked_from);
    }
    json_t *extra = json_object_get(args, "env");
    if (extra && !json_is_null(extra) && !json_is_object(extra)) {
        snprintf(message, size, "bad arguments: env must be an object");
        goto fail;
    }
    const char *key;
    size_t key_len;
    json_t *value;
    json_object_keylen_foreach(extra, key, key_len, value) {
        if (strlen(key) != key_len || !*key || strchr(key, '=') || has_nul(value)) {
            snprintf(message, size, "bad arguments: illegal environment variable name or value");
            goto fail;
        }
        char *text = python_str(value);
        env_set(&env, key, text ? text : "");
        free(text);
    }
    json_t *cwd_json = json_object_get(args, "cwd");
    const char *workdir = default_text(preset, "workdir");
    const char *cwd = json_is_string(cwd_json) && *json_string_value(cwd_json)
                          ? json_string_value(cwd_json)
                          : (workdir ? workdir : env_get(&env, "HOME"));
    json_t *timeout = json_object_get(args, "timeout");
    if (timeout && !json_is_null(timeout) && !json_is_number(timeout)) {
        snprintf(message, size, "bad arguments: timeout must be a number");
        goto fail;
    }
    const char *path = env_get(&env, "PATH");
    paths = candidates(argv[0], path ? path : "/bin:/usr/bin");
    bool with_stdin = json_is_true(json_object_get(args, "stdin"));
    if ((with_stdin && pipe2(fds, O_CLOEXEC) != 0) || pipe2(fds + 2, O_CLOEXEC) != 0 ||
        pipe2(fds + 4, O_CLOEXEC) != 0 || pipe2(report, O_CLOEXEC) != 0)
        goto os_fail;
    if (!with_stdin && (fds[6] = open("/dev/null", O_RDONLY | O_CLOEXEC)) < 0)
        goto os_fail;
    s.envp = env.vars;
    s.cwd = cwd;
    s.candidates = paths;
    s.stdin_fd = with_stdin ? fds[0] : fds[6];
    s.out_fd = fds[3];
    s.err_fd = fds[5];
    s.report_fd = report[1];
    /* vfork's way (the agent's memory shared until exec) with the child on its own
     * stack, as glibc's posix_spawn: no copy of the page tables, nothing of ours clobbered */
    static char child_stack[64 * 1024] __attribute__((aligned(16)));
    pid_t pid =
        clone(child, child_stack + sizeof child_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &s);
    if (pid < 0)
        goto os_fail;
    close(report[1]);
    report[1] = -1;
    struct spawn_failure failure;
    ssize_t got = read(report[0], &failure, sizeof failure);
    if (got == (ssize_t)sizeof failure) {
        waitpid(pid, NULL, 0);
        const char *what = argv[0];
        if (failure.stage == 1 && failure.err == ENOENT) {
            *kind = NOT_FOUND;
            snprintf(message, size, "no such working directory: %s", cwd);
        } else if (failure.err == ENOENT) {
            *kind = COMMAND_NOT_FOUND;
            snprintf(message, size, "command not found: %s", what);
        } else if (failure.err == EACCES || failure.err == EPERM) {
            *kind = PERMISSION;
            snprintf(message, size, "permission denied: %s", what);
        } else {
            *kind = errno_kind(failure.err);
            snprintf(message, size, "%s: %s", strerror(failure.err),
                     failure.stage == 1 ? cwd : what);
        }
        goto fail;
    }
    c = xmalloc(sizeof *c);
    *c = (struct command){.rid = rid, .pid = pid, .had_stdin = with_stdin};
    c->out = (struct source){.kind = CMD_OUT, .fd = fds[2], .cmd = c};
    c->err = (struct source){.kind = CMD_ERR, .fd = fds[4], .cmd = c};
    c->in = (struct source){.kind = CMD_IN, .fd = with_stdin ? fds[1] : -1, .cmd = c};
    c->exited =
        (struct source){.kind = CMD_EXIT, .fd = (int)syscall(SYS_pidfd_open, pid, 0), .cmd = c};
    fds[1] = fds[2] = fds[4] = -1;
    if (c->exited.fd < 0) { /* out of descriptors: this command fails, not the agent */
        int saved = errno;
        kill(-pid, SIGKILL);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        close(c->out.fd);
        close(c->err.fd);
        if (c->in.fd >= 0)
            close(c->in.fd);
        free(c);
        errno = saved;
        goto os_fail;
    }
    fcntl(c->out.fd, F_SETFL, O_NONBLOCK);
    fcntl(c->err.fd, F_SETFL, O_NONBLOCK);
    if (c->in.fd >= 0)
        fcntl(c->in.fd, F_SETFL, O_NONBLOCK);
    if (json_is_number(timeout) && json_number_value(timeout) < 1e9) { /* else: never */
        double seconds = json_number_value(timeout);
        c->deadline = now_ms() + (int64_t)(seconds > 0 ? seconds * 1000 : 0);
    }
    c->next = commands;
    commands = c;
    watch_events(&c->exited, EPOLLIN);
    follow(c);
    goto done;
os_fail:
    *kind = INTERNAL;
    snprintf(message, size, "%s", strerror(errno));
fail:
    c = NULL;
done:
    for (int i = 0; i < 7; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    if (report[0] >= 0)
        close(report[0]);
    if (report[1] >= 0)
        close(report[1]);
    free_strings(argv);
    free_strings(paths);
    env_free(&env);
    return c;
}

static void on_command_exit(struct command *c) {
    int status = 0;
    pid_t reaped = waitpid(c->pid, &status, WNOHANG);
    if (reaped == 0)
        return;
    if (reaped < 0) /* not ours to reap any more: its pidfd must not wake us again */
        status = W_EXITCODE(255, 0);
    finish_command(c, status);
}

/* ------------------------------------------------------------------ requests */

static void answer(json_t *id, json_t *result) {
    send_json(
        json_pack("{s:O,s:b,s:o}", "id", id, "ok", 1, "result", result ? result : json_object()),
        NULL, 0, false);
}

static bool is_op(const char *op, const char *name) {
    return !strcmp(op, name);
}

static void on_request(const struct frame_in *frame) {
    json_t *id = json_object_get(frame->header, "id");
    const char *op = json_string_value(json_object_get(frame->header, "op"));
    if (!json_is_integer(id) || !op) {
        send_error(json_is_integer(id) ? id : NULL, BAD_FRAME,
                   "a request needs an integer id and an op");
        return;
    }
    json_t *args = json_object_get(frame->header, "args");
    json_t *empty = json_object();
    if (python_falsy(args))
        args = empty;
    char message[512];
    const char *kind;
    struct command *c;
    if (!json_is_object(args)) {
        to_helper_frame(frame, id); /* it answers as it always did */
    } else if (is_op(op, "ping")) {
        answer(id, ping());
    } else if (is_op(op, "sys.refresh")) {
        json_t *result =
            refresh(args, frame->payload, frame->payload_len, &kind, message, sizeof message);
        if (result)
            answer(id, result);
        else
            send_error(id, kind, message);
    } else if (is_op(op, "exec") && python_falsy(json_object_get(args, "pty"))) {
        c = start_command(json_integer_value(id), args, &kind, message, sizeof message);
        if (!c)
            send_error(id, kind, message);
        else
            send_json(json_pack("{s:O,s:s,s:i,s:O}", "id", id, "event", "started", "pid",
                                (int)c->pid, "exec_id", id),
                      NULL, 0, false);
    } else if ((c = find_command(
                    json_object_get(args, is_op(op, "flow") ? "target" : "exec_id"))) &&
               (is_op(op, "exec.stdin") || is_op(op, "exec.kill") || is_op(op, "exec.resize") ||
                is_op(op, "flow"))) {
        if (is_op(op, "exec.kill")) {
            json_t *sig = json_object_get(args, "signal");
            int64_t number = SIGKILL;
            if (sig && (!python_int(sig, &number) || number < 0 || number > 64))
                send_error(id, INVALID, "bad arguments: signal must be a signal number");
            else if (kill(-c->pid, (int)number) != 0 && errno != ESRCH && errno != EPERM)
                send_error(id, INTERNAL, strerror(errno));
            else
                answer(id, NULL);
        } else if (is_op(op, "exec.resize")) {
            send_error(id, INVALID, "the command was started without a terminal (pty)");
        } else if (is_op(op, "flow")) {
            json_t *paused = json_object_get(args, "paused");
            if (!json_is_boolean(paused)) {
                send_error(id, INVALID, "flow needs an integer target and a boolean paused");
            } else {
                c->paused = json_is_true(paused);
                follow(c);
                answer(id, NULL);
            }
        } else if (!c->had_stdin) {
            send_error(id, INVALID, "the command was started without stdin");
        } else if (c->stdin_closed && !frame->payload_len) {
            answer(id, NULL); /* nothing to write: Python's closed stdin says nothing either */
        } else if (c->stdin_closed) {
            send_error(id, INVALID, "the command closed its stdin");
        } else {
            struct stdin_write *w = xmalloc(sizeof *w);
            *w = (struct stdin_write){.request = json_integer_value(id),
                                      .eof = json_is_true(json_object_get(args, "eof")),
                                      .len = frame->payload_len};
            w->data = xmalloc(frame->payload_len);
            memcpy(w->data, frame->payload, frame->payload_len);
            if (c->last_write)
                c->last_write->next = w;
            else
                c->writes = w;
            c->last_write = w;
            flush_stdin(c);
        }
    } else {
        to_helper_frame(frame, id);
    }
    json_decref(empty);
}

static void on_port_readable(void) {
    char buf[READ_SIZE];
    ssize_t n = read(port.fd, buf, sizeof buf);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (n < 0) {
        reading = false;
        port_events();
        read_again_at = now_ms() + RETRY_MS;
        return;
    }
    if (n == 0) {
        host_left();
        return;
    }
    read_ns = now_ns(CLOCK_MONOTONIC);
    decoder_feed(&port_in, buf, (size_t)n);
    struct frame_in frame;
    size_t used;
    while (decoder_next(&port_in, &frame, &used)) {
        if (frame.garbage)
            send_error(NULL, BAD_FRAME, frame.error);
        else if (frame.header)
            on_request(&frame);
        else
            to_helper_frame(&frame, NULL);
        json_decref(frame.header);
        decoder_drop(&port_in, used);
    }
}

/* ------------------------------------------------------------------ start */

/* The port's device: its name read from sysfs (there is no udev to link it). */
static int find_port(void) {
    for (int tries = 0; tries < 500; tries++) {
        DIR *dir = opendir("/sys/class/virtio-ports");
        struct dirent *entry;
        while (dir && (entry = readdir(dir))) {
            if (entry->d_name[0] == '.')
                continue;
            char path[512], name[256];
            snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", entry->d_name);
            read_stripped(path, name, sizeof name);
            if (!strcmp(name, PORT_NAME)) {
                snprintf(path, sizeof path, "/dev/%s", entry->d_name);
                closedir(dir);
                int fd = open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC);
                if (fd < 0)
                    die(path);
                return fd;
            }
        }
        if (dir)
            closedir(dir);
        usleep(10000);
    }
    fprintf(stderr, "cryobox-agent: virtio port %s not found\n", PORT_NAME);
    exit(1);
}

static void open_port(void) {
    /* The host's tests serve it a socket in place of the port (tests/unit/agent_pair.py). */
    const char *given = getenv("CRYOBOX_AGENT_PORT_FD");
    if (given) {
        port.fd = atoi(given);
        fcntl(port.fd, F_SETFL, O_NONBLOCK);
    } else {
        port.fd = find_port();
    }
    boot_id_is_ours = boot_id_mounted();
    start_reading();
    /* said at every start: a connected host learns by the new pid that the agent restarted */
    send_hello();
    char uptime[64];
    read_stripped("/proc/uptime", uptime, sizeof uptime);
    *strchrnul(uptime, ' ') = 0;
    fprintf(stderr, "cryobox-agent: ready (uptime %s s)\n", uptime);
}

static int next_timeout(void) {
    int64_t soonest = 0;
    int64_t times[] = {retry_at, read_again_at, helper_start_at};
    for (size_t i = 0; i < sizeof times / sizeof *times; i++)
        if (times[i] && (!soonest || times[i] < soonest))
            soonest = times[i];
    for (struct command *c = commands; c; c = c->next)
        if (c->deadline && !c->timed_out && (!soonest || c->deadline < soonest))
            soonest = c->deadline;
    if (!soonest)
        return -1;
    int64_t wait = soonest - now_ms();
    return wait < 0 ? 0 : (int)(wait > 60000 ? 60000 : wait);
}

static void run_timers(void) {
    int64_t now = now_ms();
    if (retry_at && retry_at <= now)
        flush_port();
    if (read_again_at && read_again_at <= now)
        start_reading();
    if (helper_start_at && helper_start_at <= now)
        start_helper();
    for (struct command *c = commands; c; c = c->next)
        if (c->deadline && !c->timed_out && c->deadline <= now) {
            c->timed_out = true;
            kill_group(c->pid, SIGKILL);
        }
}

static void dispatch(struct source *src, uint32_t events) {
    struct command *c = src->cmd;
    switch (src->kind) {
    case PORT:
        if ((events & (EPOLLOUT | EPOLLHUP | EPOLLERR)) && writer)
            flush_port();
        if ((events & (EPOLLIN | EPOLLHUP | EPOLLERR)) && reading && port.fd >= 0)
            on_port_readable();
        break;
    case HELPER:
        if (events & EPOLLOUT)
            flush_helper();
        if (helper.fd >= 0 && (events & (EPOLLIN | EPOLLHUP | EPOLLERR)))
            on_helper_readable();
        break;
    case HELPER_EXIT:
        on_helper_exit();
        break;
    case CMD_OUT:
    case CMD_ERR:
        read_output(c, src);
        break;
    case CMD_IN:
        flush_stdin(c);
        break;
    case CMD_EXIT:
        on_command_exit(c);
        break;
    }
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fputs("usage: cryobox-agent PYTHON-AGENT-COMMAND...\n", stderr);
        return 2;
    }
    helper_argv = argv + 1;
    /* 0, 1 and 2 taken, so that no pipe of a command gets one of their numbers */
    for (int fd = 0; fd < 3; fd++)
        if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) != fd)
            die("/dev/null");
    const char *given = getenv("CRYOBOX_AGENT_PORT_FD");
    if (given) /* before the Python part is started: it must not hold the host's socket */
        fcntl(atoi(given), F_SETFD, FD_CLOEXEC);
    signal(SIGPIPE, SIG_IGN);
    signal(SIGCHLD, SIG_DFL);
    ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0)
        die("epoll_create1");
    start_helper(); /* the port opens once it has set the system up (its hello) */
    struct epoll_event events[64];
    for (;;) {
        int n = epoll_wait(ep, events, 64, next_timeout());
        if (n < 0 && errno != EINTR)
            die("epoll_wait");
        /* A source closed by an earlier event of this batch is skipped (its fd is -1);
         * ended commands are freed only after the batch. */
        for (int i = 0; i < n; i++) {
            struct source *src = events[i].data.ptr;
            if (src->fd >= 0)
                dispatch(src, events[i].events);
        }
        run_timers();
        while (ended) {
            struct command *c = ended;
            ended = c->next;
            free(c);
        }
    }
}
