/* One pool of worker threads for every native kernel (qdot, attention), instead of OpenMP.
 *
 * Why not OpenMP: `#pragma omp for schedule(static)` gives each thread a fixed share and ends in
 * a barrier, so on a busy machine one descheduled thread stalls the whole call for a scheduler
 * slice (milliseconds), and an idle OpenMP team spins for a while after each region, fighting
 * torch's own team and the server's threads for the same cores. Measured on the 2-core machine
 * with another job running: 0.6 tok/s by default against 30 with one thread.
 *
 * Here a job is a count of items; every thread (the caller first) claims the next item with one
 * compare-and-swap on `state` = generation << 32 | next item, so the share of a thread that is
 * descheduled is taken over by the others and only the item it is in holds the call up. An idle
 * worker spins for `HETERO_POOL_SPIN_US` microseconds (default 10; 200 from 8 cores on), then
 * sleeps on a futex; a new job wakes the sleepers, and the caller starts on the items meanwhile, so a worker's wake-up
 * delays a call by a part of it. Longer spins lost under load: SmolLM2 decode with 2 threads at
 * load 11-15 on 2 cores, 50 us 13-15 tok/s, 200 us 12.5-13, 0-10 us 13-17 (a spinning worker
 * takes the time slices the engine's own thread needs). A caller waiting for the last items
 * yields the CPU after a short spin, so a worker it waits for can be scheduled.
 */
#define _GNU_SOURCE
#include "cpu_pool.h"

#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

static struct {
    _Atomic uint64_t state;  /* generation << 32 | next item */
    _Atomic uint32_t gen;    /* the futex word, bumped once a job */
    _Atomic int64_t done;    /* items finished in this generation */
    _Atomic(pool_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n;
    _Atomic int nthreads;
    _Atomic int sleepers;
    int started; /* workers 1 .. started are running */
} P;
static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int in_job = 0; /* a kernel called from an item runs inline */
static int spin_ns = -1;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void sleep_on_gen(uint32_t seen) {
#ifdef __linux__
    syscall(SYS_futex, &P.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
    struct timespec ts = {0, 20000};
    (void)seen;
    nanosleep(&ts, NULL);
#endif
}

static void wake_sleepers(void) {
#ifdef __linux__
    syscall(SYS_futex, &P.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
}

/* Blocks until the generation moves past `seen`; returns the new one. */
static uint32_t wait_for_job(uint32_t seen) {
    int64_t start = now_ns();
    for (uint32_t spins = 1;; spins++) {
        const uint32_t g = atomic_load_explicit(&P.gen, memory_order_acquire);
        if (g != seen) return g;
        cpu_relax();
        if (spins % 64 == 0 && now_ns() - start > spin_ns) {
            atomic_fetch_add(&P.sleepers, 1); /* seq_cst: ordered against the publisher's load */
            if (atomic_load(&P.gen) == seen) sleep_on_gen(seen);
            atomic_fetch_sub(&P.sleepers, 1);
            start = now_ns();
        }
    }
}

/* Claims and runs items of generation g until none is left. */
static void work(uint32_t g, int worker) {
    for (;;) {
        uint64_t s = atomic_load_explicit(&P.state, memory_order_acquire);
        if ((uint32_t)(s >> 32) != g || (int64_t)(uint32_t)s >= atomic_load(&P.n)) return;
        if (!atomic_compare_exchange_weak(&P.state, &s, s + 1)) continue;
        /* the job cannot change while an item of it is unfinished: fn and ctx are g's */
        atomic_load(&P.fn)(atomic_load(&P.ctx), (int64_t)(uint32_t)s, worker);
        atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
    }
}

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&P.gen) - 1; /* started inside pool_run, before its bump */
    in_job = 1;
    for (;;) {
        seen = wait_for_job(seen);
        if (id < atomic_load(&P.nthreads)) work(seen, id);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    P.started = 0; /* the threads did not come along */
    pthread_mutex_init(&job_lock, NULL);
}

static void grow(int nthreads) {
    if (spin_ns < 0) {
        const char *env = getenv("HETERO_POOL_SPIN_US");
        /* small machines (the engine's own threads compete for the cores): 10 us; from 8
         * cores on, 200 us, which keeps the workers awake across a GPU's part of a layer when
         * the CPU's experts are host nodes of a CUDA graph (kernels/host_hop.py) */
        const long cores = sysconf(_SC_NPROCESSORS_ONLN);
        spin_ns = 1000 * (env ? atoi(env) : cores >= 8 ? 200 : 10);
        pthread_atfork(NULL, NULL, after_fork_in_child);
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 20);
    while (P.started + 1 < nthreads) {
        pthread_t t;
        if (pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(P.started + 1))) break;
        pthread_detach(t);
        P.started++;
    }
    pthread_attr_destroy(&attr);
}

void pool_run(pool_fn fn, void *ctx, int64_t n_items, int nthreads) {
    if (nthreads > POOL_MAX_THREADS) nthreads = POOL_MAX_THREADS;
    if (nthreads > n_items) nthreads = (int)n_items;
    if (nthreads <= 1 || in_job) {
        for (int64_t i = 0; i < n_items; i++) fn(ctx, i, 0);
        return;
    }
    pthread_mutex_lock(&job_lock);
    const uint32_t g = atomic_load(&P.gen) + 1;
    grow(nthreads);
    /* The new generation's state first: a worker still in the last job's `work` loop (its items
     * all done, about to look for another, perhaps descheduled in between) must not pair the
     * last job's state with this job's count, fn or ctx. Once the state names g, its check
     * fails and its compare-and-swap of the old state cannot succeed. (Stored last, as it once
     * was, such a worker claimed an item of the last job's numbering and ran it with this
     * job's fn and, or, ctx: items ran twice or late, and a call returned early.) No worker
     * claims an item of g before P.gen says g, stored last. */
    atomic_store(&P.state, (uint64_t)g << 32);
    atomic_store(&P.fn, fn);
    atomic_store(&P.ctx, ctx);
    atomic_store(&P.n, n_items);
    atomic_store(&P.nthreads, P.started + 1 < nthreads ? P.started + 1 : nthreads);
    atomic_store(&P.done, 0);
    atomic_store(&P.gen, g);
    if (atomic_load(&P.sleepers) > 0) wake_sleepers();
    in_job = 1;
    work(g, 0);
    for (uint32_t spins = 1; atomic_load_explicit(&P.done, memory_order_acquire) < n_items;
         spins++) {
        if (spins < 2000) cpu_relax();
        else sched_yield(); /* the one we wait for may need this core */
    }
    in_job = 0;
    pthread_mutex_unlock(&job_lock);
}

/* For tests: run `n` items that each add their index + 1 to sums[worker]; returns the workers
 * used. */
static void add_index(void *ctx, int64_t item, int worker) {
    atomic_fetch_add((_Atomic int64_t *)ctx + worker, item + 1);
}

int native_pool_selftest(int64_t n, int nthreads, int64_t *sums) {
    static _Atomic int64_t acc[POOL_MAX_THREADS];
    for (int i = 0; i < POOL_MAX_THREADS; i++) atomic_store(&acc[i], 0);
    pool_run(add_index, acc, n, nthreads);
    int used = 0;
    for (int i = 0; i < POOL_MAX_THREADS; i++) {
        sums[i] = atomic_load(&acc[i]);
        used += sums[i] != 0;
    }
    return used;
}

/* For tests: `jobs` short jobs back to back, alternating two contexts (as kernels alternate),
 * n items each (1 .. 97); returns how many jobs' sums were wrong when pool_run returned or a
 * moment later (an item run twice, run late, or run with the other job's context). */
int native_pool_stress(int jobs, int nthreads) {
    static _Atomic int64_t acc[2][POOL_MAX_THREADS];
    int bad = 0;
    for (int j = 0; j < jobs; j++) {
        _Atomic int64_t *ctx = acc[j & 1];
        const int64_t n = 1 + (int64_t)j * 7919 % 97;
        for (int i = 0; i < POOL_MAX_THREADS; i++) atomic_store(&ctx[i], 0);
        pool_run(add_index, ctx, n, nthreads);
        for (int check = 0; check < 2; check++) {
            int64_t total = 0;
            for (int i = 0; i < POOL_MAX_THREADS; i++) total += atomic_load(&ctx[i]);
            if (total != n * (n + 1) / 2) {
                bad++;
                break;
            }
            if (check == 0) sched_yield(); /* a late item of this job would land meanwhile */
        }
    }
    return bad;
}
