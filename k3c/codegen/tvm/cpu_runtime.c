/* The services an LLVM module exported by TVM calls through function pointers that TVM's own runtime
 * (libtvm_runtime) fills in when it loads the library: the parallel-for launcher (`T.parallel` loops) and
 * workspace allocation (scratch buffers above the stack limit). k3c loads its kernels with apache-tvm-ffi only,
 * which does not fill them in, so this file is linked into every k3c `kernels/cpu.so` and sets them from a
 * constructor when the library is loaded.
 *
 * Parallel tasks run on a small pthread pool (the caller plus K3C_NUM_THREADS - 1 workers; default: the online
 * cores), started at the first launch. Idle workers sleep on a condition variable: an OpenMP runtime would spin,
 * and a second OpenMP runtime next to torch's own (a different libgomp) makes both spin against each other.
 * Workspaces come from posix_memalign. Signatures: tvm/include/tvm/runtime/c_backend_api.h
 * (TVMBackendParallelLaunch, TVMBackendParallelBarrier, TVMBackendAllocWorkspace, TVMBackendFreeWorkspace).
 * The pointers are weak: a library whose kernels use none of the services does not define them. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
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
  unsigned long gen;             /* bumped once per job */
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

static void *worker(void *arg) {
  (void)arg;
  unsigned long seen = 0;
  for (;;) {
    pthread_mutex_lock(&pool.mu);
    while (pool.gen == seen) pthread_cond_wait(&pool.wake, &pool.mu);
    seen = pool.gen;
    pthread_mutex_unlock(&pool.mu);
    run_tasks();
  }
  return NULL;
}

static void start_pool(void) {
  const char *env = getenv("K3C_NUM_THREADS");
  long n = env ? atol(env) : sysconf(_SC_NPROCESSORS_ONLN);
  n = n < 1 ? 1 : n > K3C_MAX_THREADS ? K3C_MAX_THREADS : n;
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
    ++pool.gen;
    pthread_cond_broadcast(&pool.wake);
  }
  pthread_mutex_unlock(&pool.mu);
  run_tasks();
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

static void *k3c_alloc_workspace(int device_type, int device_id, uint64_t nbytes, int dtype_code, int dtype_bits) {
  (void)device_type; (void)device_id; (void)dtype_code; (void)dtype_bits;
  void *p = NULL;
  return posix_memalign(&p, 64, nbytes ? nbytes : 1) == 0 ? p : NULL;
}

static int k3c_free_workspace(int device_type, int device_id, void *ptr) {
  (void)device_type; (void)device_id;
  free(ptr);
  return 0;
}

__attribute__((constructor)) static void k3c_install_cpu_runtime(void) {
  if (&__TVMBackendParallelLaunch) __TVMBackendParallelLaunch = (void *)k3c_parallel_launch;
  if (&__TVMBackendParallelBarrier) __TVMBackendParallelBarrier = (void *)k3c_parallel_barrier;
  if (&__TVMBackendAllocWorkspace) __TVMBackendAllocWorkspace = (void *)k3c_alloc_workspace;
  if (&__TVMBackendFreeWorkspace) __TVMBackendFreeWorkspace = (void *)k3c_free_workspace;
}
