/* The native kernels' one thread pool (kernels/cpu_pool.c). */
#ifndef HETERO_CPU_POOL_H
#define HETERO_CPU_POOL_H
#include <stdint.h>

/* Item `item` of a job, run on worker `worker` (0 is the calling thread, 1.. the pool's). */
typedef void (*pool_fn)(void *ctx, int64_t item, int worker);

/* Runs items 0 .. n_items - 1 on up to `nthreads` threads, the caller among them, and returns
 * when all are done. Items are claimed one at a time: a thread the OS deschedules holds up only
 * the item it is running, never the others' share. */
void pool_run(pool_fn fn, void *ctx, int64_t n_items, int nthreads);

#define POOL_MAX_THREADS 256
#endif
