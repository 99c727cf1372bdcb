/* The two services an LLVM module exported by TVM calls through function pointers that TVM's own runtime
 * (libtvm_runtime) fills in when it loads the library: the parallel-for launcher (`T.parallel` loops) and
 * workspace allocation (scratch buffers above the stack limit). k3c loads its kernels with apache-tvm-ffi only,
 * which does not fill them in, so this file is linked into every k3c `kernels/cpu.so` and sets them from a
 * constructor when the library is loaded: parallel tasks run on OpenMP threads, workspaces come from malloc.
 * Signatures: tvm/include/tvm/runtime/c_backend_api.h (TVMBackendParallelLaunch, TVMBackendAllocWorkspace).
 * The pointers are weak: a library whose kernels use neither service does not define them. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct { void *sync_handle; int32_t num_task; } TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv *penv, void *cdata);

extern void *__TVMBackendParallelLaunch __attribute__((weak));
extern void *__TVMBackendParallelBarrier __attribute__((weak));
extern void *__TVMBackendAllocWorkspace __attribute__((weak));
extern void *__TVMBackendFreeWorkspace __attribute__((weak));

/* num_task 0 means "as many tasks as threads"; every task id in [0, num_task) runs exactly once. */
static int k3c_parallel_launch(FTVMParallelLambda flambda, void *cdata, int num_task) {
  int n = num_task > 0 ? num_task : omp_get_max_threads();
  TVMParallelGroupEnv env = {0, n};
  int err = 0;
#pragma omp parallel for schedule(static) reduction(| : err)
  for (int task = 0; task < n; ++task) err |= flambda(task, &env, cdata);
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
