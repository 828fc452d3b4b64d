/* The kernels' worker pool: a few pthreads created once per process.
 *
 * Why not OpenMP or a thread per call: torch's OpenMP workers spin on the cores after every
 * GEMM, and thread creation per call costs tens of microseconds per kernel call (7 calls a
 * layer). Here a worker spins for at most SPIN_NS after its last part (the gap between two
 * kernel calls of a decode layer is usually shorter), then sleeps on a condition variable, so an
 * idle pool leaves the cores to torch's prefill GEMMs.
 *
 * A call publishes (task, arg, num_parts) and bumps `generation`; every started worker takes the
 * part named by its index (or none) and acknowledges, so the next call cannot overwrite a job a
 * worker is still reading. Calls are serialised by `run_lock`.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include "worker_pool.h"

#include <pthread.h>
#include <stdint.h>
#include <time.h>

#define MAX_WORKERS 63
#define SPIN_NS 100000 /* 100 us */

static struct {
    pthread_mutex_t run_lock; /* one call at a time */
    pthread_mutex_t lock;     /* guards the sleeps below */
    pthread_cond_t wake, done;
    int num_workers;
    unsigned generation; /* atomic: bumped per call */
    int sleepers;        /* atomic: workers asleep (or about to be) on `wake` */
    int caller_asleep;   /* atomic */
    int pending;         /* atomic: workers yet to acknowledge the current call */
    kvpark_task task;
    void *arg;
    int num_parts;
    /* the generation before each worker's first call (a new worker may start running after
     * the call that created it was published) */
    unsigned start_generation[MAX_WORKERS + 1];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, NULL, NULL, 0, {0}};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* spins until `*word` != `old` or SPIN_NS pass; returns whether it changed */
static int spin_while_equal(const unsigned *word, unsigned old) {
    const int64_t deadline = now_ns() + SPIN_NS;
    for (unsigned i = 1;; i++) {
        if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != old) return 1;
        if (i % 64 == 0 && now_ns() > deadline) return 0;
        cpu_relax();
    }
}

static unsigned wait_for_call(unsigned seen) {
    if (spin_while_equal(&pool.generation, seen))
        return __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
    pthread_mutex_lock(&pool.lock);
    /* seq_cst pairs with the caller's bump then read of `sleepers`: one of the two sees the
     * other, so a call is never missed */
    __atomic_add_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
    unsigned gen;
    while ((gen = __atomic_load_n(&pool.generation, __ATOMIC_SEQ_CST)) == seen)
        pthread_cond_wait(&pool.wake, &pool.lock);
    __atomic_sub_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&pool.lock);
    return gen;
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg; /* 1-based: part 0 is the caller's */
    unsigned seen = pool.start_generation[index];
    for (;;) {
        seen = wait_for_call(seen);
        if (index < pool.num_parts) pool.task(pool.arg, index, pool.num_parts);
        if (__atomic_sub_fetch(&pool.pending, 1, __ATOMIC_SEQ_CST) == 0
            && __atomic_load_n(&pool.caller_asleep, __ATOMIC_SEQ_CST)) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
    }
    return NULL;
}

static void grow(int wanted) {
    if (wanted > MAX_WORKERS) wanted = MAX_WORKERS;
    while (pool.num_workers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pool.start_generation[pool.num_workers + 1] = pool.generation;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, worker_main,
                                          (void *)(intptr_t)(pool.num_workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) return; /* the caller takes the parts nobody else can */
        pool.num_workers++;
    }
}

static void wait_for_workers(void) {
    const unsigned *pending = (const unsigned *)&pool.pending;
    const int64_t deadline = now_ns() + SPIN_NS;
    for (unsigned i = 1; __atomic_load_n(pending, __ATOMIC_ACQUIRE) != 0; i++) {
        if (i % 64 == 0 && now_ns() > deadline) break;
        cpu_relax();
    }
    if (__atomic_load_n(&pool.pending, __ATOMIC_SEQ_CST) == 0) return;
    pthread_mutex_lock(&pool.lock);
    __atomic_store_n(&pool.caller_asleep, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&pool.pending, __ATOMIC_SEQ_CST) != 0)
        pthread_cond_wait(&pool.done, &pool.lock);
    __atomic_store_n(&pool.caller_asleep, 0, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&pool.lock);
}

/* a forked child has none of the parent's threads */
static void forget_workers(void) { pool.num_workers = 0; }

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_workers); }

void kvpark_pool_run(kvpark_task task, void *arg, int num_parts) {
    if (num_parts <= 1) {
        task(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool.run_lock);
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    grow(num_parts - 1);
    const int workers = pool.num_workers;
    pool.task = task;
    pool.arg = arg;
    pool.num_parts = num_parts;
    __atomic_store_n(&pool.pending, workers, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&pool.generation, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    task(arg, 0, num_parts);
    for (int p = workers + 1; p < num_parts; p++) task(arg, p, num_parts); /* none started */
    if (workers > 0) wait_for_workers();
    pthread_mutex_unlock(&pool.run_lock);
}

int kvpark_pool_workers(void) { return pool.num_workers; }
