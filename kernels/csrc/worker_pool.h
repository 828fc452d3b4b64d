/* One persistent pool of worker threads per process, shared by the C kernels of the library. */
#ifndef KVPARK_WORKER_POOL_H
#define KVPARK_WORKER_POOL_H

/* part `part` of `num_parts` of a kernel call; the parts of a call write disjoint outputs */
typedef void (*kvpark_task)(void *arg, int part, int num_parts);

/* Runs task(arg, p, num_parts) once for every p in 0..num_parts-1, on up to `num_threads`
 * threads: the caller and the pool's workers (started on first need, kept for the life of the
 * process) claim parts until none is left; returns when all are done. */
void kvpark_pool_run(kvpark_task task, void *arg, int num_parts, int num_threads);

/* items [first, end) of a call over n items; the spans of a call are disjoint */
typedef void (*kvpark_span_task)(void *arg, int first, int end);

/* Runs task over items 0..n-1 cut into even spans of at least `min_per_span` items (fewer would
 * not pay for waking a thread), at most one a thread: a lone span runs on the caller. */
void kvpark_pool_run_spans(kvpark_span_task task, void *arg, int n, int min_per_span,
                           int num_threads);

/* workers started so far (for tests and logs) */
int kvpark_pool_workers(void);

#endif
