/* cryobox-init: the guest's PID 1.
 *
 * It replaces tini and a shell restart loop, either of which a sandbox could end by
 * accident: `pkill -9 -f cryobox` killed the loop (its command line named cryobox), and
 * tini exits with its child, so the kernel panicked on init's exit and the VM was gone;
 * under a fork bomb the loop's `sleep` could not fork and the shell gave up. This
 * program never exits and never needs to fork to go on: it restarts the agent (a
 * failed fork is retried a second later), reaps every orphan, and takes no signal the
 * kernel does not force on it (none, for PID 1 in its own namespace).
 *
 * Before starting the agent it puts what sandboxes run out of harm's way:
 *  - itself and the agent's front are never chosen by the OOM killer
 *    (oom_score_adj -1000); the front sets the Python part and every command back to 0;
 *  - commands (and the agent's Python part, whose children they are) run in the cgroup
 *    /sys/fs/cgroup/commands, which the front enters each child into before it execs:
 *    a pids limit stops a fork bomb there, and a memory limit (the guest's RAM less a
 *    reserve for the front and the kernel) makes a memory hog meet the OOM killer
 *    there first; and the least CPU weight, so that the front gets the CPU it needs.
 * Every step that fails is said on the console and skipped: the agent starts anyway.
 * These limits guard against accidents and runaway programs: a command running as root
 * in the guest may move itself out of the cgroup or raise its limits (the guest is its
 * own; the host is protected by the VM, not by this).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CGROUP_ROOT "/sys/fs/cgroup"
#define COMMANDS CGROUP_ROOT "/commands"
#define FRONT "/run/cryobox/cryobox-agent"
#define PYTHON "/usr/bin/python3"
#define SYSTEM_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
/* The runtime cryobox carries into a root file system made from a container image
 * (cryobox/image/runtime.py): its Python, when there, is the agent's, whatever Python
 * the image has, and its programs (ip, resize2fs, setsid) the agent's. */
#define RUNTIME "/.cryobox"
#define RUNTIME_PYTHON RUNTIME "/bin/python3"
/* Processes and threads the commands may have at once (fewer in a small guest). */
#define COMMAND_PIDS 4096
#define MIB (1024LL * 1024)

static void say(const char *what, int err) {
    if (err)
        fprintf(stderr, "cryobox-init: %s: %s\n", what, strerror(err));
    else
        fprintf(stderr, "cryobox-init: %s\n", what);
}

static int write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    ssize_t n = write(fd, text, strlen(text));
    int err = n < 0 ? errno : 0;
    close(fd);
    return err;
}

/* The guest's RAM in bytes, from /proc/meminfo (0 when unknown). */
static long long mem_total(void) {
    FILE *f = fopen("/proc/meminfo", "re");
    long long kib = 0;
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemTotal: %lld kB", &kib) == 1)
            break;
    if (f)
        fclose(f);
    return kib * 1024;
}

/* The commands' cgroup with its limits (see the header). */
static void confine_commands(void) {
    int err;
    mkdir(CGROUP_ROOT, 0755);
    if (mount("cgroup2", CGROUP_ROOT, "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0 &&
        errno != EBUSY) {
        say("cannot mount the cgroup file system; commands run unconfined", errno);
        return;
    }
    static const char *const controllers[] = {"+pids", "+memory", "+cpu"};
    for (size_t i = 0; i < sizeof controllers / sizeof controllers[0]; i++)
        if ((err = write_file(CGROUP_ROOT "/cgroup.subtree_control", controllers[i])))
            say(controllers[i], err);
    if (mkdir(COMMANDS, 0755) != 0 && errno != EEXIST) {
        say("cannot make " COMMANDS, errno);
        return;
    }
    /* At most 4,096, and never the whole guest's: the kernel's own limit (threads-max,
     * the RAM / 128 KiB: 2,048 at 256 MiB) less 256 for init, the front and the kernel. */
    long long pids = COMMAND_PIDS, threads = 0;
    FILE *f = fopen("/proc/sys/kernel/threads-max", "re");
    if (f && fscanf(f, "%lld", &threads) == 1 && threads - 256 < pids)
        pids = threads - 256 > 64 ? threads - 256 : 64;
    if (f)
        fclose(f);
    char limit_pids[32];
    snprintf(limit_pids, sizeof limit_pids, "%lld", pids);
    if ((err = write_file(COMMANDS "/pids.max", limit_pids)))
        say("cannot limit the commands' processes", err);
    /* The least CPU weight: commands (a fork bomb's thousands of processes included)
     * share what the front, this program and the kernel leave; the front still
     * answers the host's pings. */
    if ((err = write_file(COMMANDS "/cpu.weight", "1")))
        say("cannot lower the commands' CPU weight", err);
    long long total = mem_total();
    if (total > 0) {
        /* An eighth of the RAM, between 32 and 128 MiB, stays for the front, this
         * program and the kernel. */
        long long reserve = total / 8;
        reserve = reserve < 32 * MIB ? 32 * MIB : reserve > 128 * MIB ? 128 * MIB : reserve;
        char limit[32];
        snprintf(limit, sizeof limit, "%lld", total - reserve);
        if ((err = write_file(COMMANDS "/memory.max", limit)))
            say("cannot limit the commands' memory", err);
    }
}

/* The agent: its front (which starts the Python part), or the Python part alone in an
 * image without a front (then entered into the commands' cgroup here, as the front
 * would). Runs in the child; never returns. */
static void exec_agent(void) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    setsid();
    if (chdir("/") != 0)
        _exit(126);
    /* With the runtime, its programs first: the image's own `ip` may be busybox's, which
     * lacks what the agent asks of iproute2's. Commands get their PATH from the agent. */
    bool carried = access(RUNTIME_PYTHON, X_OK) == 0;
    setenv("PATH", carried ? RUNTIME "/bin:" SYSTEM_PATH : SYSTEM_PATH, 1);
    setenv("PYTHONPATH", "/run/cryobox/lib", 1);
    setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
    setenv("HOME", "/root", 1);
    setenv("LANG", "C.UTF-8", 1);
    const char *python = carried ? RUNTIME_PYTHON : PYTHON;
    if (access(FRONT, X_OK) == 0) {
        execl(FRONT, FRONT, python, "-m", "cryobox.guest.agent", "--fd", "3", (char *)NULL);
    } else {
        write_file(COMMANDS "/cgroup.procs", "0");
        write_file("/proc/self/oom_score_adj", "0");
        execl(python, python, "-m", "cryobox.guest.agent", (char *)NULL);
    }
    say("cannot start the guest agent", errno);
    _exit(127);
}

/* Reap every child that has ended, without waiting. */
static void reap(void) {
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

/* A second, reaping as it goes: the orphans that end meanwhile (a fork bomb's) must not
 * fill the process table while the agent is away, or no fork would succeed again. */
static void pause_a_second(void) {
    for (int i = 0; i < 10; i++) {
        reap();
        struct timespec tenth = {0, 100 * 1000 * 1000};
        while (nanosleep(&tenth, &tenth) != 0 && errno == EINTR) {
        }
    }
    reap();
}

int main(void) {
    int err;
    if (getpid() != 1)
        say("not PID 1: the agent is started, but orphans are not reaped here", 0);
    if ((err = write_file("/proc/self/oom_score_adj", "-1000")))
        say("cannot keep the OOM killer off init", err);
    confine_commands();
    for (;;) {
        pid_t agent = fork();
        if (agent < 0) {
            say("cannot start the guest agent, trying again in a second", errno);
            pause_a_second();
            continue;
        }
        if (agent == 0)
            exec_agent();
        int status = 0;
        for (;;) {
            pid_t ended = waitpid(-1, &status, 0);
            if (ended == agent)
                break;
            if (ended < 0 && errno == ECHILD)
                break; /* cannot happen while the agent lives; never spin */
        }
        if (WIFSIGNALED(status))
            fprintf(stderr, "cryobox: guest agent killed by signal %d, restarting\n",
                    WTERMSIG(status));
        else
            fprintf(stderr, "cryobox: guest agent exited with status %d, restarting\n",
                    WEXITSTATUS(status));
        pause_a_second();
    }
}
