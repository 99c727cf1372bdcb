/* The services an LLVM module exported by TVM calls through function pointers that TVM's own runtime
 * (libtvm_runtime) fills in when it loads the library: the parallel-for launcher (`T.parallel` loops) and
 * workspace allocation (scratch buffers above the stack limit). k3c loads its kernels with apache-tvm-ffi only,
 * which does not fill them in, so this file is linked into every k3c `kernels/cpu.so` and sets them from a
 * constructor when the library is loaded.
 *
 * Parallel tasks run on a small pthread pool (the caller plus K3C_NUM_THREADS - 1 workers; default: the online
 * cores), started at the first launch. An idle worker polls for the next job for K3C_SPIN_US microseconds
 * (default 200: a decode step launches its kernels back to back, and a futex wake-up of a sleeping worker costs
 * tens of microseconds, more than a small kernel) and then sleeps on a condition variable; the caller polls for
 * the job's end the same way. The spin yields the core at every poll and is bounded, unlike an OpenMP runtime's,
 * so that torch's own pool (a different libgomp, used by the library ops between kernels) gets the cores when it
 * wakes.
 * Workspaces come from a per-thread stack (below). Signatures: tvm/include/tvm/runtime/c_backend_api.h
 * (TVMBackendParallelLaunch, TVMBackendParallelBarrier, TVMBackendAllocWorkspace, TVMBackendFreeWorkspace).
 * The pointers are weak: a library whose kernels use none of the services does not define them. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

typedef struct { void *sync_handle; int32_t num_task; } TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv *penv, void *cdata);

extern void *__TVMBackendParallelLaunch __attribute__((weak));
extern void *__TVMBackendParallelBarrier __attribute__((weak));
extern void *__TVMBackendAllocWorkspace __attribute__((weak));
extern void *__TVMBackendFreeWorkspace __attribute__((weak));

#define K3C_MAX_THREADS 256

static struct {
  pthread_mutex_t launch;        /* one parallel launch at a time */
  pthread_mutex_t mu;            /* guards gen and the job fields below */
  pthread_cond_t wake, done;
  int nthreads;                  /* 0 until started; includes the calling thread */
  long spin_ns;                  /* how long an idle thread polls before it sleeps */
  atomic_ulong gen;              /* bumped once per job (under mu) */
  FTVMParallelLambda flambda;
  void *cdata;
  TVMParallelGroupEnv env;
  atomic_int next, remaining, err;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER};

/* Claim and run tasks of the current job until none is left. */
static void run_tasks(void) {
  int task;
  while ((task = atomic_fetch_add(&pool.next, 1)) < pool.env.num_task) {
    if (pool.flambda(task, &pool.env, pool.cdata) != 0) atomic_store(&pool.err, 1);
    if (atomic_fetch_sub(&pool.remaining, 1) == 1) {
      pthread_mutex_lock(&pool.mu);
      pthread_cond_signal(&pool.done);
      pthread_mutex_unlock(&pool.mu);
    }
  }
}

static long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Poll, for at most pool.spin_ns, until `gen` differs from `from` (a job was posted) or, with gen NULL, until
 * `remaining` is 0 (the job is done). Returns whether that happened. */
static int spin_until(atomic_ulong *gen, unsigned long from, atomic_int *remaining) {
  long end = 0;
  for (unsigned i = 0;; ++i) {
    if (gen ? atomic_load(gen) != from : atomic_load(remaining) <= 0) return 1;
    sched_yield();  /* a thread of torch's pool woken on this core runs at once */
    if ((i & 15) == 15) {
      long t = now_ns();
      if (end == 0) end = t + pool.spin_ns;
      else if (t >= end) return 0;
    }
  }
}

static void *worker(void *arg) {
  (void)arg;
  unsigned long seen = 0;
  for (;;) {
    if (!spin_until(&pool.gen, seen, NULL)) {
      pthread_mutex_lock(&pool.mu);
      while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.wake, &pool.mu);
      pthread_mutex_unlock(&pool.mu);
    }
    seen = atomic_load(&pool.gen);
    run_tasks();
  }
  return NULL;
}

static void start_pool(void) {
  const char *env = getenv("K3C_NUM_THREADS");
  long n = env ? atol(env) : sysconf(_SC_NPROCESSORS_ONLN);
  n = n < 1 ? 1 : n > K3C_MAX_THREADS ? K3C_MAX_THREADS : n;
  const char *spin = getenv("K3C_SPIN_US");
  long us = spin ? atol(spin) : 200;
  pool.spin_ns = (us < 0 ? 0 : us) * 1000L;
  int started = 1;
  for (long i = 1; i < n; ++i) {
    pthread_t t;
    if (pthread_create(&t, NULL, worker, NULL) != 0) break;
    pthread_detach(t);
    ++started;
  }
  pool.nthreads = started;
}

/* num_task 0 means "one task per pool thread"; every task id in [0, num_task) runs exactly once. */
static int k3c_parallel_launch(FTVMParallelLambda flambda, void *cdata, int num_task) {
  pthread_mutex_lock(&pool.launch);
  if (pool.nthreads == 0) start_pool();
  int n = num_task > 0 ? num_task : pool.nthreads;
  pthread_mutex_lock(&pool.mu);
  pool.flambda = flambda;
  pool.cdata = cdata;
  pool.env.sync_handle = NULL;
  pool.env.num_task = n;
  atomic_store(&pool.err, 0);
  atomic_store(&pool.remaining, n);
  atomic_store(&pool.next, 0);
  if (n > 1) {
    atomic_fetch_add(&pool.gen, 1);
    pthread_cond_broadcast(&pool.wake);
  }
  pthread_mutex_unlock(&pool.mu);
  run_tasks();
  spin_until(NULL, 0, &pool.remaining);
  pthread_mutex_lock(&pool.mu);
  while (atomic_load(&pool.remaining) > 0) pthread_cond_wait(&pool.done, &pool.mu);
  /* a worker still leaving run_tasks must not claim a task of the next job before that job is set up */
  atomic_store(&pool.next, 1 << 30);
  pthread_mutex_unlock(&pool.mu);
  int err = atomic_load(&pool.err);
  pthread_mutex_unlock(&pool.launch);
  return err;
}

/* Parallel loops lowered by TVM need no barrier; one is only emitted for explicit syncs, which k3c never writes. */
static int k3c_parallel_barrier(int task_id, TVMParallelGroupEnv *penv) { (void)task_id; (void)penv; return 0; }

/* Workspaces: TVM allocates every scratch buffer of a parallel loop body (a dot's partial sums included) through
 * these hooks, once per iteration, and frees them in reverse order (scoped). They come from a per-thread stack
 * of K3C_WS_BYTES (a bump pointer: no malloc, no lock, no page faults after the first use); a buffer that does
 * not fit, or a free out of order, falls back to posix_memalign / free. */
#define K3C_WS_BYTES (1 << 20)
#define K3C_WS_DEPTH 64
static __thread struct {
  char *base;                    /* 64-byte aligned, K3C_WS_BYTES; NULL until the thread's first workspace */
  size_t top;                    /* bytes in use */
  int depth;                     /* live stack entries */
  size_t start[K3C_WS_DEPTH];    /* each live entry's offset */
  char freed[K3C_WS_DEPTH];      /* freed out of order, popped when it reaches the top */
} ws;

static void *k3c_alloc_workspace(int device_type, int device_id, uint64_t nbytes, int dtype_code, int dtype_bits) {
  (void)device_type; (void)device_id; (void)dtype_code; (void)dtype_bits;
  size_t size = ((nbytes ? nbytes : 1) + 63) & ~(size_t)63;
  if (!ws.base && posix_memalign((void **)&ws.base, 64, K3C_WS_BYTES) != 0) ws.base = NULL;
  if (ws.base && ws.depth < K3C_WS_DEPTH && size <= K3C_WS_BYTES - ws.top) {
    ws.start[ws.depth] = ws.top;
    ws.freed[ws.depth++] = 0;
    ws.top += size;
    return ws.base + ws.start[ws.depth - 1];
  }
  void *p = NULL;
  return posix_memalign(&p, 64, size) == 0 ? p : NULL;
}

static int k3c_free_workspace(int device_type, int device_id, void *ptr) {
  (void)device_type; (void)device_id;
  char *c = ptr;
  if (!ws.base || c < ws.base || c >= ws.base + K3C_WS_BYTES) {
    free(ptr);
    return 0;
  }
  for (int i = ws.depth - 1; i >= 0; --i)
    if (ws.base + ws.start[i] == c) {
      ws.freed[i] = 1;
      break;
    }
  while (ws.depth > 0 && ws.freed[ws.depth - 1]) ws.top = ws.start[--ws.depth];
  return 0;
}

__attribute__((constructor)) static void k3c_install_cpu_runtime(void) {
  if (&__TVMBackendParallelLaunch) __TVMBackendParallelLaunch = (void *)k3c_parallel_launch;
  if (&__TVMBackendParallelBarrier) __TVMBackendParallelBarrier = (void *)k3c_parallel_barrier;
  if (&__TVMBackendAllocWorkspace) __TVMBackendAllocWorkspace = (void *)k3c_alloc_workspace;
  if (&__TVMBackendFreeWorkspace) __TVMBackendFreeWorkspace = (void *)k3c_free_workspace;
}
