/*
 * bench_capi.c: the C ABI's own cost of a Fetch, for bench_latency.py's
 * "c" row. A C program (so every call comes from a thread Go did not
 * make, as Python's do) dials ADDR on TRANSPORT, fetches the tensor
 * published under "bench" once as a warm-up, then ITERS times, each
 * fetch (trpc_client_fetch) and release (the DLManagedTensor's deleter)
 * timed together, and prints one JSON line: [[seconds, ...], voluntary
 * context switches per call].
 *
 *   cc -O2 -I shim/capi shim/examples/bench_capi.c path/to/libtensorrpc.so
 *   ./a.out ADDR TRANSPORT ITERS
 *
 * It declares the few functions it calls itself, so that it needs only
 * tensorrpc.h (the ABI's types), not the libtensorrpc.h `go build` writes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "tensorrpc.h"

extern int trpc_client_dial(char *target, trpc_options *opts, int64_t timeout_ms, trpc_client *out, char **err);
extern int trpc_client_fetch(trpc_client h, char *key, int flags, int64_t timeout_ms, DLManagedTensor **out,
                             char **err);
extern int trpc_client_close(trpc_client h, int64_t *outstanding, char **err);
extern void trpc_free(void *p);

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static long switches(void) {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_nvcsw;
}

static int fail(const char *what, int code, char *err) {
  fprintf(stderr, "bench_capi: %s: code %d: %s\n", what, code, err ? err : "");
  trpc_free(err);
  return 1;
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s ADDR TRANSPORT ITERS\n", argv[0]);
    return 2;
  }
  int iters = atoi(argv[3]);
  if (iters < 1) {
    fprintf(stderr, "bench_capi: ITERS must be at least 1\n");
    return 2;
  }
  trpc_options opts;
  memset(&opts, 0, sizeof opts);
  opts.transports = argv[2];
  trpc_client c = 0;
  char *err = NULL;
  int code = trpc_client_dial(argv[1], &opts, 30000, &c, &err);
  if (code != 0) {
    return fail("dial", code, err);
  }
  double *ds = malloc(sizeof(double) * (size_t)iters);
  if (ds == NULL) {
    return 1;
  }
  DLManagedTensor *m = NULL;
  if ((code = trpc_client_fetch(c, "bench", 0, -1, &m, &err)) != 0) {
    return fail("fetch", code, err);
  }
  m->deleter(m);
  long sw = switches();
  for (int i = 0; i < iters; i++) {
    double t0 = now();
    if ((code = trpc_client_fetch(c, "bench", 0, -1, &m, &err)) != 0) {
      return fail("fetch", code, err);
    }
    m->deleter(m);
    ds[i] = now() - t0;
  }
  sw = switches() - sw;
  printf("[[");
  for (int i = 0; i < iters; i++) {
    printf("%s%.9g", i ? ", " : "", ds[i]);
  }
  printf("], %.3f]\n", (double)sw / iters);
  free(ds);
  int64_t outstanding = 0;
  if ((code = trpc_client_close(c, &outstanding, &err)) != 0) {
    return fail("close", code, err);
  }
  return 0;
}
