/* The kernels' worker pool: a few pthreads created once per process.
 *
 * Why not OpenMP or a thread per call: torch's OpenMP workers spin on the cores after every
 * GEMM, and creating threads per call costs tens of microseconds per kernel call (7 calls a
 * layer). Here a worker spins for at most SPIN_NS after its last part (the gap between two
 * kernel calls of a decode layer is usually shorter), then sleeps on a condition variable, so an
 * idle pool leaves the cores to torch's prefill GEMMs.
 *
 * Parts are claimed, not assigned: the caller claims parts like the workers do, so a worker
 * that other jobs on a shared machine keep off the CPU costs the call nothing (the caller does
 * its parts), and the caller waits only for parts that another thread has started. A claim is a
 * compare-and-swap on one word holding (call generation, number of parts, next part), so a
 * worker that wakes late can never take a part of a later call.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include "worker_pool.h"

#include <pthread.h>
#include <stdint.h>
#include <time.h>

#define MAX_WORKERS 63
#define MAX_PARTS 0xffff
#define SPIN_NS 100000 /* 100 us */

static struct {
    pthread_mutex_t run_lock; /* one call at a time */
    pthread_mutex_t lock;     /* guards the sleeps below */
    pthread_cond_t wake, done;
    int num_workers;
    uint64_t word;     /* atomic: generation << 32 | num_parts << 16 | next part */
    int finished;      /* atomic: parts of the current call done */
    int sleepers;      /* atomic: workers asleep (or about to be) on `wake` */
    int caller_asleep; /* atomic */
    kvpark_task task;  /* the current call's, written before its word is published */
    void *arg;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, NULL, NULL};

static inline unsigned generation_of(uint64_t word) { return (unsigned)(word >> 32); }

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

/* the next unclaimed part of call `generation` (and the call's part count), or -1 */
static int claim(unsigned generation, int *num_parts) {
    uint64_t word = __atomic_load_n(&pool.word, __ATOMIC_ACQUIRE);
    for (;;) {
        const int parts = (int)((word >> 16) & MAX_PARTS), next = (int)(word & MAX_PARTS);
        if (generation_of(word) != generation || next >= parts) return -1;
        if (__atomic_compare_exchange_n(&pool.word, &word, word + 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            *num_parts = parts;
            return next;
        }
    }
}

static void finish_part(int num_parts) {
    if (__atomic_add_fetch(&pool.finished, 1, __ATOMIC_SEQ_CST) == num_parts
        && __atomic_load_n(&pool.caller_asleep, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_signal(&pool.done);
        pthread_mutex_unlock(&pool.lock);
    }
}

/* the generation of the next call after `seen`: a bounded spin, then a sleep */
static unsigned wait_for_call(unsigned seen) {
    const int64_t deadline = now_ns() + SPIN_NS;
    for (unsigned i = 1;; i++) {
        const unsigned gen = generation_of(__atomic_load_n(&pool.word, __ATOMIC_ACQUIRE));
        if (gen != seen) return gen;
        if (i % 64 == 0 && now_ns() > deadline) break;
        cpu_relax();
    }
    pthread_mutex_lock(&pool.lock);
    /* seq_cst pairs with the caller's publish then read of `sleepers`: one of the two sees
     * the other, so a call is never slept through */
    __atomic_add_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
    unsigned gen;
    while ((gen = generation_of(__atomic_load_n(&pool.word, __ATOMIC_SEQ_CST))) == seen)
        pthread_cond_wait(&pool.wake, &pool.lock);
    __atomic_sub_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&pool.lock);
    return gen;
}

static void *worker_main(void *arg) {
    (void)arg;
    unsigned seen = 0;
    for (;;) {
        seen = wait_for_call(seen);
        int part, num_parts;
        while ((part = claim(seen, &num_parts)) >= 0) {
            /* a claimed part keeps its call open: task and arg are still this call's */
            pool.task(pool.arg, part, num_parts);
            finish_part(num_parts);
        }
    }
    return NULL;
}

static void grow(int wanted) {
    if (wanted > MAX_WORKERS) wanted = MAX_WORKERS;
    while (pool.num_workers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, worker_main, NULL);
        pthread_attr_destroy(&attr);
        if (failed) return; /* the caller claims what nobody else does */
        pool.num_workers++;
    }
}

static void wait_for_parts(int num_parts) {
    const int64_t deadline = now_ns() + SPIN_NS;
    for (unsigned i = 1; __atomic_load_n(&pool.finished, __ATOMIC_ACQUIRE) != num_parts; i++) {
        if (i % 64 == 0 && now_ns() > deadline) break;
        cpu_relax();
    }
    if (__atomic_load_n(&pool.finished, __ATOMIC_SEQ_CST) == num_parts) return;
    pthread_mutex_lock(&pool.lock);
    __atomic_store_n(&pool.caller_asleep, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&pool.finished, __ATOMIC_SEQ_CST) != num_parts)
        pthread_cond_wait(&pool.done, &pool.lock);
    __atomic_store_n(&pool.caller_asleep, 0, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&pool.lock);
}

/* a forked child has none of the parent's threads */
static void forget_workers(void) { pool.num_workers = 0; }

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_workers); }

void kvpark_pool_run(kvpark_task task, void *arg, int num_parts, int num_threads) {
    if (num_parts > MAX_PARTS) num_parts = MAX_PARTS;
    if (num_parts <= 1 || num_threads <= 1) {
        for (int p = 0; p < (num_parts > 1 ? num_parts : 1); p++) task(arg, p, num_parts);
        return;
    }
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    pthread_mutex_lock(&pool.run_lock);
    grow(num_threads - 1);
    pool.task = task;
    pool.arg = arg;
    __atomic_store_n(&pool.finished, 0, __ATOMIC_SEQ_CST);
    const unsigned gen = generation_of(__atomic_load_n(&pool.word, __ATOMIC_RELAXED)) + 1;
    __atomic_store_n(&pool.word, (uint64_t)gen << 32 | (uint64_t)num_parts << 16,
                     __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    int part, parts;
    while ((part = claim(gen, &parts)) >= 0) {
        task(arg, part, parts);
        finish_part(parts);
    }
    wait_for_parts(num_parts);
    pthread_mutex_unlock(&pool.run_lock);
}

typedef struct {
    kvpark_span_task task;
    void *arg;
    int n;
} SpansCall;

static void run_span(void *arg, int part, int num_parts) {
    const SpansCall *c = arg;
    c->task(c->arg, (int)((int64_t)c->n * part / num_parts),
            (int)((int64_t)c->n * (part + 1) / num_parts));
}

void kvpark_pool_run_spans(kvpark_span_task task, void *arg, int n, int min_per_span,
                           int num_threads) {
    int spans = n / min_per_span;
    if (spans > num_threads) spans = num_threads;
    if (spans <= 1) {
        task(arg, 0, n);
        return;
    }
    SpansCall c = {task, arg, n};
    kvpark_pool_run(run_span, &c, spans, spans);
}

int kvpark_pool_workers(void) { return pool.num_workers; }
