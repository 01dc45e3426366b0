/* The PostgreSQL floor of LockService.lock() + release(): the package's own acquire and
 * release statements, prepared once, run with PQexecPrepared on one libpq connection,
 * sequentially, in autocommit (each statement its own transaction, as the package runs
 * them). The durability is whatever the statements carry: the package's release turns
 * synchronous_commit off for its own transaction; the acquire commits durably.
 *
 * Built and driven by benchmarks/floors.py. Usage:
 *   pg_floor CONNINFO KEYPREFIX TOKENPREFIX TTL LIFE HOLDER ACQUIRE_SQL ACQUIRE_PARAMS RELEASE_SQL RELEASE_PARAMS
 * *_PARAMS name each $n in order, comma-separated, from: key, token, ttl, life, holder.
 * Then, per line "N" read from stdin, it runs N cycles on keys KEYPREFIX0..KEYPREFIX255 and
 * prints one line: the batch's elapsed nanoseconds, then each cycle's nanoseconds. A line
 * "N THINK" does the same with THINK nanoseconds of busy-waiting before each statement (a
 * client's own CPU time between statements, simulated); the line "backend" prints the
 * connection's server process id. A grant refused or an error ends the program with status 3
 * and a message on stderr.
 */
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define KEYS 256
#define MAXP 8

static PGconn *conn;

static void die(const char *what) {
    fprintf(stderr, "pg_floor: %s%s%s\n", what, conn ? ": " : "", conn ? PQerrorMessage(conn) : "");
    exit(3);
}

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void think(long long ns) {
    if (ns <= 0) return;
    long long until = now_ns() + ns;
    while (now_ns() < until)
        ;
}

/* Parameter slots: 0 key, 1 token, 2 ttl, 3 life, 4 holder. */
static int parse_params(const char *spec, int *slots) {
    static const char *names[] = {"key", "token", "ttl", "life", "holder"};
    char copy[256];
    int n = 0;
    snprintf(copy, sizeof copy, "%s", spec);
    for (char *name = strtok(copy, ","); name; name = strtok(NULL, ",")) {
        int found = -1;
        for (int i = 0; i < 5; i++)
            if (strcmp(name, names[i]) == 0) found = i;
        if (found < 0 || n == MAXP) die("bad parameter list");
        slots[n++] = found;
    }
    return n;
}

static void prepare(const char *name, const char *sql, int nparams) {
    PGresult *res = PQprepare(conn, name, sql, nparams, NULL);
    if (PQresultStatus(res) != PGRES_COMMAND_OK) die("prepare failed");
    PQclear(res);
}

int main(int argc, char **argv) {
    if (argc != 11) die("usage: CONNINFO KEYPREFIX TOKENPREFIX TTL LIFE HOLDER ACQUIRE_SQL ACQUIRE_PARAMS RELEASE_SQL RELEASE_PARAMS");
    const char *keyprefix = argv[2], *tokenprefix = argv[3];
    int acquire_slots[MAXP], release_slots[MAXP];
    int acquire_n = parse_params(argv[8], acquire_slots), release_n = parse_params(argv[10], release_slots);

    conn = PQconnectdb(argv[1]);
    if (PQstatus(conn) != CONNECTION_OK) die("cannot connect");
    prepare("floor_acquire", argv[7], acquire_n);
    prepare("floor_release", argv[9], release_n);

    static long long lat[1 << 20];
    char keys[KEYS][256], token[256], request[64];
    for (int k = 0; k < KEYS; k++) snprintf(keys[k], sizeof keys[k], "%s%d", keyprefix, k);
    const char *value[5] = {NULL, token, argv[4], argv[5], argv[6]};
    const char *acquire_values[MAXP], *release_values[MAXP];
    unsigned long long serial = 0, cycle = 0;
    while (fgets(request, sizeof request, stdin)) {
        if (strncmp(request, "backend", 7) == 0) {
            printf("%d\n", PQbackendPID(conn));
            fflush(stdout);
            continue;
        }
        long n = 0;
        long long think_ns = 0;
        if (sscanf(request, "%ld %lld", &n, &think_ns) < 1) die("bad request");
        if (n <= 0 || n > (long)(sizeof lat / sizeof lat[0])) die("bad batch size");
        long long start = now_ns();
        for (long i = 0; i < n; i++) {
            long long t0 = now_ns();
            value[0] = keys[cycle++ % KEYS];
            /* The package's token: host:pid:wall ms:32 hex digits. */
            snprintf(token, sizeof token, "%s%lld:%016llx%016llx", tokenprefix, (long long)time(NULL) * 1000,
                     0x9e3779b97f4a7c15ULL * ++serial, 0xbf58476d1ce4e5b9ULL * serial);
            for (int p = 0; p < acquire_n; p++) acquire_values[p] = value[acquire_slots[p]];
            for (int p = 0; p < release_n; p++) release_values[p] = value[release_slots[p]];
            think(think_ns);
            PGresult *res = PQexecPrepared(conn, "floor_acquire", acquire_n, acquire_values, NULL, NULL, 0);
            if (PQresultStatus(res) != PGRES_TUPLES_OK) die("acquire failed");
            if (PQntuples(res) < 1 || strcmp(PQgetvalue(res, 0, 0), "t") != 0)
                die("acquire not granted (key unexpectedly held)");
            PQclear(res);
            think(think_ns);
            res = PQexecPrepared(conn, "floor_release", release_n, release_values, NULL, NULL, 0);
            if (PQresultStatus(res) != PGRES_TUPLES_OK) die("release failed");
            PQclear(res);
            lat[i] = now_ns() - t0;
        }
        long long elapsed = now_ns() - start;
        printf("%lld", elapsed);
        for (long i = 0; i < n; i++) printf(" %lld", lat[i]);
        printf("\n");
        fflush(stdout);
    }
    PQfinish(conn);
    return 0;
}
