/* The lookup table's read (radixkv/table/reader.py, table_format.py), in one call: hash a prompt's
 * blocks as radixkv.protocol.block_hashes does (content = sum token_k * K_k, chained h = h * P + c,
 * all mod 2**64), then read each block's bucket under its sequence counter, in order, until the
 * first block the table does not hold. Built on first use (kvpool/jit.py, CLibrary) and called
 * through ctypes; the numpy path in reader.py computes the same answer where it is not built. */
#include <stdint.h>

#define P 0x9E3779B97F4A7C15ULL
#define WAYS 7
#define WORDS 16

static int64_t rkv_run(const uint32_t *tokens, int64_t num_blocks, int64_t block_size,
                       const uint64_t *keys, uint64_t salt, const uint64_t *buckets,
                       uint64_t mask, int64_t tries, uint64_t *hashes, int64_t *ids,
                       int64_t *counters) {
    uint64_t h = salt;
    for (int64_t i = 0; i < num_blocks; i++) {
        const uint32_t *row = tokens + i * block_size;
        uint64_t c = 0;
        for (int64_t k = 0; k < block_size; k++) c += (uint64_t)row[k] * keys[k];
        h = h * P + c;
        hashes[i] = h;
        __builtin_prefetch(buckets + (h & mask) * WORDS);
    }
    for (int64_t i = 0; i < num_blocks; i++) {
        const uint64_t key = hashes[i];
        const uint64_t *b = buckets + (key & mask) * WORDS;
        uint64_t value = 0;
        int64_t t = 0;
        for (; t < tries; t++) {
            uint64_t before = __atomic_load_n(&b[0], __ATOMIC_ACQUIRE);
            if (!(before & 1)) {
                value = 0;
                for (int w = 0; w < WAYS; w++) {
                    if (__atomic_load_n(&b[1 + w], __ATOMIC_RELAXED) == key) {
                        value = __atomic_load_n(&b[1 + WAYS + w], __ATOMIC_RELAXED);
                        break;
                    }
                }
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (__atomic_load_n(&b[0], __ATOMIC_RELAXED) == before) break;
            }
            counters[0]++;
            __builtin_ia32_pause();  /* the writer is mid-change: give it the core's time */
        }
        if (t == tries) {  /* in change all along (the writer stopped mid-change?): a miss */
            counters[2]++;
            return i;
        }
        if (value == 0) return i;
        ids[i] = (int64_t)(value & 0xFFFFFFFFULL) - 1;
    }
    return num_blocks;
}

/* tokens: num_blocks x block_size uint32; keys: block_size odd multipliers; buckets: the table's
 * buckets (WORDS words each), mask = buckets - 1; hashes: num_blocks words of scratch; ids out:
 * each block of the run's pool block id (-1: on the disk tier only). Returns the leading run
 * found; counters[0] += bucket reads redone, counters[1] = the run's leading part in the pool,
 * counters[2] += 1 if the run ended at a bucket still in change after `tries` reads. */
int64_t rkv_peek(const uint32_t *tokens, int64_t num_blocks, int64_t block_size,
                 const uint64_t *keys, uint64_t salt, const uint64_t *buckets, uint64_t mask,
                 int64_t tries, uint64_t *hashes, int64_t *ids, int64_t *counters) {
    int64_t n = rkv_run(tokens, num_blocks, block_size, keys, salt, buckets, mask, tries,
                        hashes, ids, counters);
    int64_t pool = 0;
    while (pool < n && ids[pool] >= 0) pool++;
    counters[1] = pool;
    return n;
}
