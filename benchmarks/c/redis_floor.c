/* The Redis floor of LockService.lock() + release(): the same two commands the package
 * sends (EVALSHA of its acquire script, then EVALSHA of its release script, with the same
 * arguments), written as hand-made RESP on one blocking TCP connection, sequentially.
 *
 * Built and driven by benchmarks/floors.py. Usage:
 *   redis_floor HOST PORT DB KEYPREFIX TOKENPREFIX ACQUIRE... -- RELEASE...
 * ACQUIRE and RELEASE are the two commands' words as the package sent them, with the words
 * {key} and {token} standing for each cycle's key and fresh token. Then, per line "N [THINK
 * [SPIN]]" read from stdin, it runs N cycles on keys KEYPREFIX0..KEYPREFIX255 and prints one
 * line: the batch's elapsed nanoseconds, then each cycle's nanoseconds. THINK: nanoseconds
 * busy-waited before each command (client CPU added to the cycle); SPIN: nanoseconds a reply
 * wait polls the socket (recv MSG_DONTWAIT) before it blocks in recv (0: it blocks at once). A grant
 * refused or an error reply ends the program with status 3 and a message on stderr.
 */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define KEYS 256

static int fd;
static char in[1 << 16];
static size_t in_len, in_pos;
static long long spin_ns;

static void die(const char *what) {
    fprintf(stderr, "redis_floor: %s\n", what);
    exit(3);
}

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void think(long long ns) {
    if (ns <= 0) return;
    long long end = now_ns() + ns;
    while (now_ns() < end) {
    }
}

static void send_all(const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = send(fd, buf, len, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("send failed");
        }
        buf += n;
        len -= (size_t)n;
    }
}

static int next_byte(void) {
    if (in_pos == in_len) {
        ssize_t n = -1;
        if (spin_ns > 0) {
            long long end = now_ns() + spin_ns;
            do n = recv(fd, in, sizeof in, MSG_DONTWAIT); while (n < 0 && (errno == EAGAIN || errno == EINTR) && now_ns() < end);
            if (n < 0 && errno != EAGAIN && errno != EINTR) die("recv failed");
        }
        if (n < 0)
            do n = recv(fd, in, sizeof in, 0); while (n < 0 && errno == EINTR);
        if (n <= 0) die("connection closed");
        in_len = (size_t)n;
        in_pos = 0;
    }
    return (unsigned char)in[in_pos++];
}

/* Reads one line (without CRLF) into line; returns its length. */
static size_t read_line(char *line, size_t cap) {
    size_t n = 0;
    for (;;) {
        int c = next_byte();
        if (c == '\r') {
            if (next_byte() != '\n') die("bad line end");
            line[n] = 0;
            return n;
        }
        if (n + 1 < cap) line[n++] = (char)c;
    }
}

/* Reads one reply; returns the first integer of it (an array's first element), for the
 * grant check. Bulk strings and nested arrays are consumed. */
static long long read_reply(void) {
    char line[512];
    read_line(line, sizeof line);
    switch (line[0]) {
    case ':':
        return atoll(line + 1);
    case '+':
        return 0;
    case '-':
        fprintf(stderr, "redis_floor: error reply %s\n", line);
        exit(3);
    case '$': {
        long long len = atoll(line + 1);
        for (long long i = 0; i < len + 2 && len >= 0; i++) next_byte();
        return 0;
    }
    case '*': {
        long long count = atoll(line + 1), first = 0;
        for (long long i = 0; i < count; i++) {
            long long v = read_reply();
            if (i == 0) first = v;
        }
        return first;
    }
    default:
        die("unknown reply type");
    }
    return 0;
}

static size_t bulk(char *out, const char *s, size_t len) {
    size_t n = (size_t)sprintf(out, "$%zu\r\n", len);
    memcpy(out + n, s, len);
    memcpy(out + n + len, "\r\n", 2);
    return n + len + 2;
}

static size_t command(char *out, int argc, const char **argv) {
    size_t n = (size_t)sprintf(out, "*%d\r\n", argc);
    for (int i = 0; i < argc; i++) n += bulk(out + n, argv[i], strlen(argv[i]));
    return n;
}

static int fill(const char **words, int n, const char **out, const char *key, const char *token) {
    for (int i = 0; i < n; i++)
        out[i] = strcmp(words[i], "{key}") == 0 ? key : strcmp(words[i], "{token}") == 0 ? token : words[i];
    return n;
}

int main(int argc, char **argv) {
    if (argc < 9) die("usage: HOST PORT DB KEYPREFIX TOKENPREFIX ACQUIRE... -- RELEASE...");
    const char *host = argv[1], *port = argv[2], *db = argv[3], *keyprefix = argv[4], *tokenprefix = argv[5];
    const char **acquire_words = (const char **)argv + 6, **release_words = NULL;
    int acquire_n = 0, release_n = 0;
    for (int i = 6; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0) {
            release_words = (const char **)argv + i + 1;
            release_n = argc - i - 1;
            break;
        }
        acquire_n++;
    }
    if (!release_words || acquire_n == 0 || release_n == 0 || acquire_n > 64 || release_n > 64)
        die("two commands separated by -- expected");

    struct addrinfo hints = {0}, *ai;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, port, &hints, &ai) != 0) die("cannot resolve host");
    fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
    if (fd < 0 || connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) die("cannot connect");
    freeaddrinfo(ai);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* as redis-py does */

    static char out[1 << 16];
    const char *select[] = {"SELECT", db};
    send_all(out, command(out, 2, select));
    read_reply();

    static long long lat[1 << 20];
    char keys[KEYS][256], token[256], request[32];
    const char *words[64];
    for (int k = 0; k < KEYS; k++) snprintf(keys[k], sizeof keys[k], "%s%d", keyprefix, k);
    unsigned long long serial = 0, cycle = 0;
    while (fgets(request, sizeof request, stdin)) {
        long n = 0;
        long long think_ns = 0;
        spin_ns = 0;
        if (sscanf(request, "%ld %lld %lld", &n, &think_ns, &spin_ns) < 1) die("bad request");
        if (n <= 0 || n > (long)(sizeof lat / sizeof lat[0])) die("bad batch size");
        long long start = now_ns();
        for (long i = 0; i < n; i++) {
            long long t0 = now_ns();
            const char *key = keys[cycle++ % KEYS];
            /* The package's token: host:pid:wall ms:32 hex digits. */
            snprintf(token, sizeof token, "%s%lld:%016llx%016llx", tokenprefix, (long long)time(NULL) * 1000,
                     0x9e3779b97f4a7c15ULL * ++serial, 0xbf58476d1ce4e5b9ULL * serial);
            think(think_ns);
            send_all(out, command(out, fill(acquire_words, acquire_n, words, key, token), words));
            if (read_reply() != 1) die("acquire not granted (key unexpectedly held)");
            think(think_ns);
            send_all(out, command(out, fill(release_words, release_n, words, key, token), words));
            read_reply();
            lat[i] = now_ns() - t0;
        }
        long long elapsed = now_ns() - start;
        printf("%lld", elapsed);
        for (long i = 0; i < n; i++) printf(" %lld", lat[i]);
        printf("\n");
        fflush(stdout);
    }
    return 0;
}
