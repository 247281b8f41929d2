/* The delay proxy of bench/delay_proxy.py in C, for `make bench-hosts`: the same command
 * line, the same behaviour, a small fraction of the CPU. The proxies stand in for a network
 * but share the machine's cores with the hosts they connect, so their own CPU is taken
 * from the across-hosts side; a network costs the hosts none (docs/benchmarks.md).
 *
 *     delay_proxy --delay-ms 2 127.0.0.1:5432=10.231.0.30:5432 [more links]
 *
 * Every chunk read from one side is written to the other `delay` later, in order; reading
 * never waits for the delay (latency, not a bandwidth cap). An EOF is passed on after the
 * delay as a half-close; a reset or a refused target closes both sides at once. One thread,
 * epoll, its wait bounded by the earliest chunk due (epoll_pwait2: nanoseconds, and no timer
 * to arm: a few system calls a chunk, which are what a proxy costs). bench/hosts_net.py builds it with
 * the system's C compiler and falls back to the Python proxy where there is none.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CHUNK 65536
#define MAX_LINKS 64

enum kind { LISTENER, ENDPOINT };
enum chunk_kind { DATA, END };

struct chunk {
    struct chunk *next;
    int64_t due_ns;
    enum chunk_kind kind;
    size_t len, off;
    char data[];
};

struct conn;

/* One socket of a proxied connection and what waits to be written to it. */
struct endpoint {
    enum kind kind;
    int fd;
    struct conn *conn;
    struct endpoint *peer;
    struct chunk *head, *tail; /* due to be written to fd, in order */
    int reading, write_blocked, write_shut, connecting;
};

struct conn {
    struct endpoint client, server;
    struct conn *prev, *next;
};

struct listener {
    enum kind kind;
    int fd;
    struct sockaddr_in target;
};

static int epfd;
static int64_t delay_ns;
static struct conn *conns;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static int parse_address(const char *text, struct sockaddr_in *out) {
    char host[256];
    const char *colon = strrchr(text, ':');
    if (!colon || (size_t)(colon - text) >= sizeof host) return -1;
    memcpy(host, text, colon - text);
    host[colon - text] = 0;
    memset(out, 0, sizeof *out);
    out->sin_family = AF_INET;
    out->sin_port = htons((uint16_t)atoi(colon + 1));
    return inet_pton(AF_INET, host, &out->sin_addr) == 1 ? 0 : -1;
}

static void watch(struct endpoint *e, int op) {
    struct epoll_event ev = {0};
    ev.events = (e->reading ? EPOLLIN : 0) | (e->write_blocked || e->connecting ? EPOLLOUT : 0);
    ev.data.ptr = e;
    if (epoll_ctl(epfd, op, e->fd, &ev) < 0 && errno != ENOENT) die("epoll_ctl");
}

static void free_chunks(struct endpoint *e) {
    while (e->head) {
        struct chunk *c = e->head;
        e->head = c->next;
        free(c);
    }
    e->tail = NULL;
}

/* Reads and drops what the kernel holds: a socket closed with unread data sends a reset,
 * where the Python proxy (whose streams had read it) closes with an EOF. */
static void drain(int fd) {
    static char sink[CHUNK];
    while (read(fd, sink, sizeof sink) > 0) {
    }
}

static void conn_close(struct conn *c) {
    free_chunks(&c->client);
    free_chunks(&c->server);
    drain(c->client.fd);
    drain(c->server.fd);
    close(c->client.fd); /* closing removes them from the epoll set */
    close(c->server.fd);
    if (c->prev) c->prev->next = c->next; else conns = c->next;
    if (c->next) c->next->prev = c->prev;
    free(c);
}

static void enqueue(struct endpoint *to, enum chunk_kind kind, const char *data, size_t len) {
    struct chunk *c = malloc(sizeof *c + len);
    if (!c) die("malloc");
    c->next = NULL;
    c->due_ns = now_ns() + delay_ns;
    c->kind = kind;
    c->len = len;
    c->off = 0;
    if (len) memcpy(c->data, data, len);
    if (to->tail) to->tail->next = c; else to->head = c;
    to->tail = c;
}

/* Reads what is there; returns 0 when the connection was closed. */
static int endpoint_read(struct endpoint *e) {
    static char buffer[CHUNK];
    ssize_t n = read(e->fd, buffer, sizeof buffer);
    if (n > 0) {
        enqueue(e->peer, DATA, buffer, (size_t)n);
        return 1;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return 1;
    if (n < 0) { /* a reset: passed on at once, not delayed */
        conn_close(e->conn);
        return 0;
    }
    e->reading = 0; /* EOF: passed on after the delay */
    watch(e, EPOLL_CTL_MOD);
    enqueue(e->peer, END, NULL, 0);
    return 1;
}

/* Writes the chunks now due; returns 0 when the connection was closed. */
static int endpoint_flush(struct endpoint *e, int64_t now) {
    while (e->head && e->head->due_ns <= now && !e->write_blocked && !e->connecting) {
        struct chunk *c = e->head;
        if (c->kind == END) {
            shutdown(e->fd, SHUT_WR);
            e->write_shut = 1;
        } else {
            ssize_t n = write(e->fd, c->data + c->off, c->len - c->off);
            if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
                e->write_blocked = 1;
                watch(e, EPOLL_CTL_MOD);
                return 1;
            }
            if (n < 0) {
                conn_close(e->conn);
                return 0;
            }
            c->off += (size_t)n;
            if (c->off < c->len) continue;
        }
        e->head = c->next;
        if (!e->head) e->tail = NULL;
        free(c);
    }
    if (e->write_shut && e->peer->write_shut) { /* both ways ended */
        conn_close(e->conn);
        return 0;
    }
    return 1;
}

static void accept_one(struct listener *l) {
    int client = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK);
    if (client < 0) return;
    int server = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (server < 0) die("socket");
    int one = 1; /* small chunks must not wait for Nagle */
    setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(server, (struct sockaddr *)&l->target, sizeof l->target) < 0 &&
        errno != EINPROGRESS) {
        close(server);
        close(client);
        return;
    }
    struct conn *c = calloc(1, sizeof *c);
    if (!c) die("calloc");
    c->client = (struct endpoint){ENDPOINT, client, c, &c->server, NULL, NULL, 0, 0, 0, 0};
    c->server = (struct endpoint){ENDPOINT, server, c, &c->client, NULL, NULL, 0, 0, 0, 1};
    c->next = conns;
    if (conns) conns->prev = c;
    conns = c;
    watch(&c->client, EPOLL_CTL_ADD); /* nothing yet: read once the target answers */
    watch(&c->server, EPOLL_CTL_ADD);
}

static int connected(struct endpoint *server) {
    int error = 0;
    socklen_t len = sizeof error;
    getsockopt(server->fd, SOL_SOCKET, SO_ERROR, &error, &len);
    if (error) { /* refused: the client sees its connection closed */
        conn_close(server->conn);
        return 0;
    }
    server->connecting = 0;
    server->reading = 1;
    server->peer->reading = 1;
    watch(server, EPOLL_CTL_MOD);
    watch(server->peer, EPOLL_CTL_MOD);
    return 1;
}

/* The earliest chunk due that can be written, or INT64_MAX. */
static int64_t earliest_due(void) {
    int64_t earliest = INT64_MAX;
    for (struct conn *c = conns; c; c = c->next) {
        struct endpoint *sides[2] = {&c->client, &c->server};
        for (int i = 0; i < 2; i++)
            if (sides[i]->head && !sides[i]->write_blocked && !sides[i]->connecting &&
                sides[i]->head->due_ns < earliest)
                earliest = sides[i]->head->due_ns;
    }
    return earliest;
}

static void flush_all_due(int64_t now) {
    struct conn *c = conns;
    while (c) {
        struct conn *next = c->next;
        if (endpoint_flush(&c->client, now)) endpoint_flush(&c->server, now);
        c = next;
    }
}

int main(int argc, char **argv) {
    double delay_ms = 2.0;
    struct listener listeners[MAX_LINKS];
    int count = 0;
    signal(SIGPIPE, SIG_IGN);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--delay-ms") == 0 && i + 1 < argc) {
            delay_ms = atof(argv[++i]);
            continue;
        }
        char *equals = strchr(argv[i], '=');
        if (!equals || count == MAX_LINKS) {
            fprintf(stderr, "usage: %s [--delay-ms N] LISTEN_HOST:PORT=TARGET_HOST:PORT...\n",
                    argv[0]);
            return 2;
        }
        *equals = 0;
        struct sockaddr_in listen_at;
        struct listener *l = &listeners[count++];
        l->kind = LISTENER;
        if (parse_address(argv[i], &listen_at) < 0 || parse_address(equals + 1, &l->target) < 0) {
            fprintf(stderr, "delay_proxy: not HOST:PORT=HOST:PORT (IPv4): %s\n", argv[i]);
            return 2;
        }
        l->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        int one = 1;
        setsockopt(l->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l->fd, (struct sockaddr *)&listen_at, sizeof listen_at) < 0) die("bind");
        if (listen(l->fd, 1024) < 0) die("listen");
    }
    if (!count) {
        fprintf(stderr, "delay_proxy: no links\n");
        return 2;
    }
    delay_ns = (int64_t)(delay_ms * 1e6);
    if ((epfd = epoll_create1(0)) < 0) die("epoll_create1");
    for (int i = 0; i < count; i++) {
        struct epoll_event lev = {.events = EPOLLIN, .data.ptr = &listeners[i]};
        epoll_ctl(epfd, EPOLL_CTL_ADD, listeners[i].fd, &lev);
    }
    printf("delay proxy ready\n");
    fflush(stdout);

    struct epoll_event events[256];
    for (;;) {
        int64_t now = now_ns();
        flush_all_due(now);
        int64_t due = earliest_due();
        struct timespec wait = {0};
        if (due != INT64_MAX && due > now) {
            wait.tv_sec = (due - now) / 1000000000;
            wait.tv_nsec = (due - now) % 1000000000;
        }
        int n = epoll_pwait2(epfd, events, 256, due == INT64_MAX ? NULL : &wait, NULL);
        if (n < 0 && errno != EINTR) die("epoll_pwait2");
        /* An endpoint closed earlier in this batch must not be touched: each is looked
         * up among the live conns first. */
        for (int i = 0; i < n; i++) {
            enum kind *kind = events[i].data.ptr;
            if (*kind == LISTENER) {
                accept_one((struct listener *)kind);
            } else {
                struct endpoint *e = (struct endpoint *)kind;
                int alive = 0;
                for (struct conn *c = conns; c; c = c->next)
                    if (&c->client == e || &c->server == e) alive = 1;
                if (!alive) continue;
                uint32_t what = events[i].events;
                if (e->connecting) {
                    if ((what & (EPOLLOUT | EPOLLERR | EPOLLHUP)) && !connected(e)) continue;
                    if (e->connecting) continue;
                }
                if ((what & EPOLLOUT) && e->write_blocked) {
                    e->write_blocked = 0;
                    watch(e, EPOLL_CTL_MOD);
                }
                if ((what & (EPOLLIN | EPOLLHUP | EPOLLERR)) && e->reading) {
                    endpoint_read(e);
                } else if (what & EPOLLERR) { /* a reset after its EOF: a failure */
                    conn_close(e->conn);
                } else if (what & EPOLLHUP) {
                    /* Both ways shut on this socket (level-triggered: it would be reported
                     * on every wait): stop watching it; the conn closes once the other
                     * way has delivered its end too. */
                    if (!e->write_shut) {
                        conn_close(e->conn);
                    } else {
                        epoll_ctl(epfd, EPOLL_CTL_DEL, e->fd, NULL);
                    }
                }
            }
        }
    }
}
