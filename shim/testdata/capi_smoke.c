// A C program using libtensorrpc directly: a server publishes a tensor, a
// client fetches it as a DLManagedTensor, sends it back, calls a C handler,
// and every pool buffer comes back. shim_test.go compiles and runs it.
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "libtensorrpc.h"

#define N 100000  // floats: over the eager threshold

static int failures;

// fail_and_exit fails a fetch on its own thread and ends without taking
// the message (trpc_last_error) or the details.
static void *fail_and_exit(void *arg) {
  trpc_client cli = (trpc_client)(uintptr_t)arg;
  DLManagedTensor *m = trpc_client_fetch_tensor(cli, "never", 0, 10000);
  return (void *)(uintptr_t)(m == NULL);
}
#define CHECK(cond, ...)                  \
  do {                                    \
    if (!(cond)) {                        \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);       \
      fprintf(stderr, "\n");              \
      failures++;                         \
    }                                     \
  } while (0)

static int ok(int code, char *err, const char *what) {
  if (code != 0) {
    fprintf(stderr, "FAIL %s: code %d: %s\n", what, code, err ? err : "");
    trpc_free(err);
    failures++;
    return 0;
  }
  return 1;
}

// double_it replies with each request tensor times two.
static int double_it(void *user, trpc_reply reply, const char *method, const uint8_t *meta, int64_t meta_len,
                     DLManagedTensor **tensors, int64_t n) {
  (void)user;
  (void)method;
  char *err = NULL;
  trpc_reply_set_metadata(reply, (uint8_t *)meta, meta_len, NULL);
  for (int64_t i = 0; i < n; i++) {
    DLTensor *t = &tensors[i]->dl_tensor;
    float *f = (float *)t->data;
    for (int64_t j = 0; j < t->shape[0]; j++) f[j] *= 2;
    if (trpc_reply_add_tensor(reply, t, &err) != 0) {  // ours: no copy
      trpc_reply_set_error(reply, err);
      trpc_free(err);
      return 13;
    }
    tensors[i]->deleter(tensors[i]);
  }
  return 0;
}

// fails fails with a short message and a traceback in its details.
static int fails(void *user, trpc_reply reply, const char *method, const uint8_t *meta, int64_t meta_len,
                 DLManagedTensor **tensors, int64_t n) {
  (void)user;
  (void)method;
  (void)meta;
  (void)meta_len;
  for (int64_t i = 0; i < n; i++) tensors[i]->deleter(tensors[i]);
  trpc_reply_set_error(reply, "ZeroDivisionError: division by zero");
  trpc_reply_set_error_details(reply, "Traceback (most recent call last):\n  File \"h.py\", line 1\n");
  return 2;
}

#define ROWS 64
#define COLS 4096  // floats per row: 16 KiB rows (3 of them pass the eager threshold), 1 MiB in all

static DLTensor matrix(float *data, int64_t *shape, int64_t rows) {
  DLTensor t = {0};
  t.data = data;
  t.device.device_type = 1;
  t.ndim = 2;
  t.dtype.code = 2;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  shape[0] = rows;
  shape[1] = COLS;
  t.shape = shape;
  return t;
}

// rows_checks exercises ABI version 4: a writable published matrix, rows
// fetched into a new tensor and into the caller's memory (between guard
// bytes that must stay untouched), rows written back, the errors, and a
// tcp session on which the caller's memory moves without a pool copy.
static void rows_checks(trpc_server srv, trpc_client cli, char *addr) {
  char *err = NULL;
  int64_t shape[2], out_shape[2];
  float *m = malloc(ROWS * COLS * sizeof(float));
  for (int i = 0; i < ROWS * COLS; i++) m[i] = (float)i;
  DLTensor pub = matrix(m, shape, ROWS);
  ok(trpc_server_publish_flags(srv, "kv", &pub, TRPC_PUBLISH_WRITABLE, &err), err, "publish writable");
  ok(trpc_server_publish_flags(srv, "ro", &pub, 0, &err), err, "publish read-only");
  CHECK(trpc_server_publish_flags(srv, "bad", &pub, 4, &err) == 3, "unknown publish flags accepted");
  trpc_free(err);
  err = NULL;
  free(m);

  const int64_t idx[3] = {5, 0, 63};  // const: the functions take const int64_t *
  DLManagedTensor *got = NULL;
  if (ok(trpc_client_fetch_rows(cli, "kv", idx, 3, 0, 10000, &got, &err), err, "fetch_rows")) {
    float *f = got->dl_tensor.data;
    CHECK(got->dl_tensor.ndim == 2 && got->dl_tensor.shape[0] == 3 && got->dl_tensor.shape[1] == COLS, "rows shape");
    CHECK(f[0] == 5 * COLS && f[COLS] == 0 && f[2 * COLS + COLS - 1] == (float)(ROWS * COLS - 1), "rows data");
    got->deleter(got);
  }
  CHECK(trpc_client_fetch_rows(cli, "kv", idx, 0, 0, 10000, &got, &err) == 3, "no rows accepted");
  trpc_free(err);
  err = NULL;

  // Into the caller's memory, between guards.
  float *buf = malloc((3 * COLS + 2) * sizeof(float));
  for (int i = 0; i < 3 * COLS + 2; i++) buf[i] = -1;
  DLTensor dst = matrix(buf + 1, out_shape, 3);
  if (ok(trpc_client_fetch_into(cli, "kv", &dst, idx, 3, 0, 10000, &err), err, "fetch_into rows")) {
    CHECK(buf[1] == 5 * COLS && buf[1 + COLS] == 0 && buf[3 * COLS] == (float)(ROWS * COLS - 1), "into data");
    CHECK(buf[0] == -1 && buf[3 * COLS + 1] == -1, "into wrote outside dst");
  }
  const int64_t far[1] = {ROWS};
  buf[1] = -2;
  CHECK(trpc_client_fetch_into(cli, "kv", &dst, far, 1, 0, 10000, &err) == 3, "row out of range accepted");
  trpc_free(err);
  err = NULL;
  CHECK(trpc_client_fetch_into(cli, "kv", &dst, NULL, 0, 0, 10000, &err) == 3, "whole tensor into 3 rows accepted");
  trpc_free(err);
  err = NULL;
  CHECK(buf[1] == -2, "a refused fetch_into wrote dst");

  // Rows written back land; a read-only tensor refuses them.
  for (int i = 0; i < 3 * COLS; i++) buf[1 + i] = 1000000.0f + i;
  const int64_t to[3] = {2, 40, 7};
  ok(trpc_client_send_rows(cli, "kv", to, 3, &dst, 10000, &err), err, "send_rows");
  DLManagedTensor *all = NULL;
  if (ok(trpc_server_fetch(srv, "kv", 0, 10000, &all, &err), err, "server fetch kv")) {
    float *f = all->dl_tensor.data;
    CHECK(f[2 * COLS] == 1000000.0f && f[40 * COLS + 1] == 1000000.0f + COLS + 1 &&
              f[7 * COLS + COLS - 1] == 1000000.0f + 3 * COLS - 1, "written rows");
    CHECK(f[3 * COLS] == 3 * COLS, "a row not written changed");
    all->deleter(all);
  }
  CHECK(trpc_client_send_rows(cli, "ro", to, 3, &dst, 10000, &err) == 7, "send_rows to a read-only tensor");
  trpc_free(err);
  err = NULL;
  CHECK(trpc_client_send_rows(cli, "nope", to, 3, &dst, 10000, &err) == 5, "send_rows to a missing key");
  trpc_free(err);
  err = NULL;
  const int64_t twice[3] = {1, 1, 2};
  CHECK(trpc_client_send_rows(cli, "kv", twice, 3, &dst, 10000, &err) == 3, "send_rows of a row twice");
  trpc_free(err);
  err = NULL;

  // On tcp the caller's memory is read and written in place: no pool copy.
  trpc_options tcp = {0};
  tcp.transports = "tcp";
  trpc_client c2;
  if (ok(trpc_client_dial(addr, &tcp, 10000, &c2, &err), err, "dial tcp")) {
    float *whole = malloc(ROWS * COLS * sizeof(float));
    int64_t whole_shape[2];
    DLTensor w = matrix(whole, whole_shape, ROWS);
    ok(trpc_client_fetch_into(c2, "kv", &w, NULL, 0, 0, 10000, &err), err, "tcp fetch_into whole");
    CHECK(whole[2 * COLS] == 1000000.0f && whole[3 * COLS] == 3 * COLS, "tcp whole data");
    ok(trpc_client_send(c2, "sent", &w, 10000, &err), err, "tcp send");
    ok(trpc_client_send_rows(c2, "kv", to, 3, &dst, 10000, &err), err, "tcp send_rows");
    trpc_stats st;
    ok(trpc_client_stats(c2, &st, &err), err, "tcp stats");
    CHECK(st.copies == 0, "tcp: %lld copies of caller memory", (long long)st.copies);
    free(whole);
    int64_t left = -1;
    ok(trpc_client_close(c2, &left, &err), err, "tcp close");
  }
  CHECK(trpc_server_unpublish(srv, "kv") == 1 && trpc_server_unpublish(srv, "ro") == 1 &&
            trpc_server_unpublish(srv, "sent") == 1, "unpublish");
  free(buf);
}

int main(void) {
  char *err = NULL;
  trpc_server srv;
  trpc_client cli;
  CHECK(trpc_abi_version() == TRPC_ABI_VERSION, "library ABI %d, header %d", trpc_abi_version(), TRPC_ABI_VERSION);
  trpc_options opts = {0};
  opts.transports = "shm,tcp";
  opts.data_address = "127.0.0.1";  // for the tcp data plane; trpc_client_dial ignores it
  if (!ok(trpc_server_new("127.0.0.1:0", &opts, &srv, &err), err, "server_new")) return 1;
  char *addr = NULL;
  ok(trpc_server_address(srv, &addr, &err), err, "address");
  if (!ok(trpc_client_dial(addr, &opts, 10000, &cli, &err), err, "dial")) return 1;
  char addr_copy[256];
  snprintf(addr_copy, sizeof addr_copy, "%s", addr);
  trpc_free(addr);
  char *transport = NULL;
  ok(trpc_client_transport(cli, &transport, &err), err, "transport");
  CHECK(strcmp(transport, "shm") == 0, "transport %s", transport);
  trpc_free(transport);

  float *data = malloc(N * sizeof(float));
  for (int i = 0; i < N; i++) data[i] = (float)i;
  int64_t shape[1] = {N};
  DLTensor in = {0};
  in.data = data;
  in.device.device_type = 1;
  in.ndim = 1;
  in.dtype.code = 2;
  in.dtype.bits = 32;
  in.dtype.lanes = 1;
  in.shape = shape;
  ok(trpc_server_publish(srv, "x", &in, &err), err, "publish");
  free(data);  // the server has its own copy

  DLManagedTensor *got = NULL;
  if (ok(trpc_client_fetch(cli, "x", 0, 10000, &got, &err), err, "fetch")) {
    float *f = got->dl_tensor.data;
    CHECK(got->dl_tensor.ndim == 1 && got->dl_tensor.shape[0] == N, "shape");
    CHECK(got->dl_tensor.dtype.code == 2 && got->dl_tensor.dtype.bits == 32, "dtype");
    CHECK(f[0] == 0 && f[N - 1] == (float)(N - 1), "data");
    ok(trpc_client_send(cli, "back", &got->dl_tensor, 10000, &err), err, "send");
    got->deleter(got);
  }
  DLManagedTensor *back = NULL;
  if (ok(trpc_server_fetch(srv, "back", TRPC_FETCH_TAKE, 10000, &back, &err), err, "take")) {
    CHECK(((float *)back->dl_tensor.data)[12345] == 12345.0f, "back");
    back->deleter(back);
  }

  ok(trpc_server_handle(srv, "double", double_it, NULL, &err), err, "handle");
  DLManagedTensor *x = NULL;
  if (ok(trpc_client_fetch(cli, "x", 0, 10000, &x, &err), err, "fetch 2")) {
    uint8_t *rmeta = NULL;
    int64_t rmeta_len = 0, nr = 0;
    DLManagedTensor **rts = NULL;
    if (ok(trpc_client_call(cli, "double", (uint8_t *)"hi", 2, &x->dl_tensor, 1, 10000, &rmeta, &rmeta_len, &rts, &nr,
                            &err), err, "call")) {
      CHECK(rmeta_len == 2 && memcmp(rmeta, "hi", 2) == 0, "reply metadata");
      CHECK(nr == 1 && ((float *)rts[0]->dl_tensor.data)[N - 1] == 2.0f * (N - 1), "reply tensor");
      for (int64_t i = 0; i < nr; i++) rts[i]->deleter(rts[i]);
      trpc_free(rmeta);
      trpc_free(rts);
    }
    x->deleter(x);
  }

  // A handler's error details reach the caller; the message stays short.
  ok(trpc_server_handle(srv, "fails", fails, NULL, &err), err, "handle fails");
  {
    uint8_t *rmeta = NULL;
    int64_t rmeta_len = 0, nr = 0;
    DLManagedTensor **rts = NULL;
    CHECK(trpc_client_call(cli, "fails", NULL, 0, NULL, 0, 10000, &rmeta, &rmeta_len, &rts, &nr, &err) == 2,
          "fails: not UNKNOWN");
    CHECK(err != NULL && strcmp(err, "ZeroDivisionError: division by zero") == 0, "fails: message %s", err);
    trpc_free(err);
    err = NULL;
    char *details = trpc_error_details();
    CHECK(details != NULL && strstr(details, "line 1") != NULL, "fails: details %s", details ? details : "NULL");
    trpc_free(details);
    CHECK(trpc_error_details() == NULL, "details handed over twice");
  }

  // DLPack 1.0: a versioned share, a lease (read-only), a copy.
  DLManagedTensor *y = NULL;
  if (ok(trpc_client_fetch(cli, "x", TRPC_FETCH_LEASE, 10000, &y, &err), err, "lease")) {
    CHECK(trpc_dlpack_flags(y) == DLPACK_FLAG_BITMASK_READ_ONLY, "lease flags %llu",
          (unsigned long long)trpc_dlpack_flags(y));
    DLManagedTensorVersioned *v = trpc_dlpack_share_versioned(y, 0);
    DLManagedTensorVersioned *c = trpc_dlpack_share_versioned(y, 1);
    y->deleter(y);  // v holds its own reference
    CHECK(v != NULL && v->version.major == 1 && v->version.minor == 0, "versioned share");
    if (v != NULL) {
      CHECK(v->flags == DLPACK_FLAG_BITMASK_READ_ONLY, "versioned flags %llu", (unsigned long long)v->flags);
      CHECK(v->dl_tensor.shape[0] == N && ((float *)v->dl_tensor.data)[N - 1] == (float)(N - 1), "versioned data");
      v->deleter(v);
    }
    CHECK(c != NULL && c->flags == DLPACK_FLAG_BITMASK_IS_COPIED, "versioned copy");
    if (c != NULL) {
      float *f = c->dl_tensor.data;
      CHECK(c->dl_tensor.shape[0] == N && f[N - 1] == (float)(N - 1), "copied data");
      f[0] = 1;  // the copy is writable
      c->deleter(c);
    }
  }
  CHECK(trpc_dlpack_share_versioned(NULL, 0) == NULL && trpc_dlpack_flags(NULL) == 0, "NULL tensor");

  // A key that is not published: NOT_FOUND at once, or, with
  // TRPC_FETCH_WAIT, DEADLINE_EXCEEDED when the timeout passes.
  DLManagedTensor *none = NULL;
  CHECK(trpc_client_fetch(cli, "never", 0, 10000, &none, &err) == 5, "client: missing key not NOT_FOUND");
  trpc_free(err);
  err = NULL;
  CHECK(trpc_server_fetch(srv, "never", TRPC_FETCH_TAKE, 10000, &none, &err) == 5, "server: missing key not NOT_FOUND");
  trpc_free(err);
  err = NULL;
  CHECK(trpc_client_fetch(cli, "never", TRPC_FETCH_WAIT, 50, &none, &err) == 4, "client: wait did not time out");
  trpc_free(err);
  err = NULL;
  CHECK(trpc_server_fetch(srv, "never", TRPC_FETCH_WAIT, 50, &none, &err) == 4, "server: wait did not time out");
  trpc_free(err);
  err = NULL;
  CHECK(none == NULL, "a failed fetch stored a tensor");

  // ABI 7: trpc_client_fetch_tensor returns the tensor, or NULL and the
  // code and message through trpc_last_error (once).
  CHECK(trpc_last_error(NULL) == 0, "a last error without a failure");
  DLManagedTensor *ft = trpc_client_fetch_tensor(cli, "x", 0, 10000);
  CHECK(ft != NULL, "fetch_tensor: %d", trpc_last_error(NULL));
  if (ft != NULL) {
    CHECK(ft->dl_tensor.shape[0] == N && ((float *)ft->dl_tensor.data)[N - 1] == (float)(N - 1), "fetch_tensor data");
    ft->deleter(ft);
  }
  CHECK(trpc_client_fetch_tensor(cli, "never", 0, 10000) == NULL, "fetch_tensor: missing key returned a tensor");
  char *msg = NULL;
  int code = trpc_last_error(&msg);
  CHECK(code == 5 && msg != NULL && strstr(msg, "never") != NULL, "fetch_tensor: last error %d %s", code,
        msg ? msg : "NULL");
  trpc_free(msg);
  CHECK(trpc_last_error(&msg) == 0 && msg == NULL, "last error handed over twice");
  CHECK(trpc_client_fetch_tensor(cli, "never", TRPC_FETCH_WAIT, 50) == NULL && trpc_last_error(NULL) == 4,
        "fetch_tensor: wait did not time out");
  CHECK(trpc_client_fetch_tensor(0, "x", 0, 10000) == NULL && trpc_last_error(NULL) != 0, "fetch_tensor: handle 0");
  // Its failures replace the thread's error details too: details left
  // by a handler's failure are gone after a fetch_tensor that had none.
  {
    uint8_t *rmeta = NULL;
    int64_t rmeta_len = 0, nr = 0;
    DLManagedTensor **rts = NULL;
    CHECK(trpc_client_call(cli, "fails", NULL, 0, NULL, 0, 10000, &rmeta, &rmeta_len, &rts, &nr, &err) == 2,
          "fails again: not UNKNOWN");
    trpc_free(err);
    err = NULL;
    CHECK(trpc_client_fetch_tensor(cli, "never", 0, 10000) == NULL, "fetch_tensor: missing key returned a tensor");
    CHECK(trpc_error_details() == NULL, "fetch_tensor: a handler's stale details survived its failure");
    CHECK(trpc_last_error(NULL) == 5, "fetch_tensor after the handler: not NOT_FOUND");
  }
  // A thread that ends with a message and details nobody took frees them
  // (the thread-local strings' destructor; ASan/valgrind would see a
  // leak otherwise): here it must at least not crash.
  {
    pthread_t th;
    CHECK(pthread_create(&th, NULL, fail_and_exit, (void *)(uintptr_t)cli) == 0, "pthread_create");
    void *res = NULL;
    pthread_join(th, &res);
    CHECK(res == (void *)1, "the thread's fetch_tensor did not fail with NOT_FOUND");
  }

  rows_checks(srv, cli, addr_copy);

  // A stale handle and a bad tensor are errors, not crashes.
  in.data = NULL;
  CHECK(trpc_client_send(cli, "bad", &in, 1000, &err) == 3, "NULL data accepted");
  trpc_free(err);
  err = NULL;
  CHECK(trpc_client_send(cli + 1000, "bad", &in, 1000, &err) == 9, "stale handle accepted");
  trpc_free(err);
  err = NULL;

  CHECK(trpc_live_tensors() == 0, "%lld live tensors", (long long)trpc_live_tensors());
  int64_t left = -1;
  ok(trpc_client_close(cli, &left, &err), err, "client close");
  CHECK(left == 0, "client: %lld buffers live after close", (long long)left);
  ok(trpc_server_close(srv, &left, &err), err, "server close");
  CHECK(left == 0, "server: %lld buffers live after close", (long long)left);
  if (failures == 0) printf("capi_smoke OK\n");
  return failures != 0;
}
