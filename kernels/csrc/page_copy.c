/* Whole KV pages between the pool's per-layer caches and the host tier's pages, on the CPU
 * (kernels/kv_copy.py `save_pages` / `load_pages`): page p of every layer's cache (page_bytes
 * each, contiguous) <-> host page i, [layers][page_bytes]. One call for a batch of pages: torch
 * took a copy op for each layer of each page, whose fixed cost outweighed the bytes' (a
 * 512-token step evicting 32 pages of 30 layers: 960 ops). Pages split between threads. */
#include <stdint.h>
#include <string.h>

#include "worker_pool.h"

typedef struct {
    char *const *layers;  /* each layer's cache: [pool pages][page_bytes] */
    const int64_t *pages; /* pool page of each host page */
    char *const *host;    /* host pages: [layers][page_bytes] each */
    int64_t page_bytes;
    int num_layers, num_pages, to_host;
} PageCopy;

static void copy_pages(void *arg, int first, int end) {
    const PageCopy *c = arg;
    for (int i = first; i < end; i++)
        for (int layer = 0; layer < c->num_layers; layer++) {
            char *pool = c->layers[layer] + c->pages[i] * c->page_bytes;
            char *host = c->host[i] + (int64_t)layer * c->page_bytes;
            if (c->to_host) memcpy(host, pool, (size_t)c->page_bytes);
            else memcpy(pool, host, (size_t)c->page_bytes);
        }
}

#define PAGES_PER_PART 4 /* the fewest pages worth a thread of their own */

/* to_host 1: pool pages -> host pages; 0: host pages -> pool pages */
void kvpark_copy_pages(char *const *layers, int num_layers, const int64_t *pages, int num_pages,
                       int64_t page_bytes, char *const *host, int to_host, int num_threads) {
    PageCopy c = {layers, pages, host, page_bytes, num_layers, num_pages, to_host};
    kvpark_pool_run_spans(copy_pages, &c, num_pages, PAGES_PER_PART, num_threads);
}
