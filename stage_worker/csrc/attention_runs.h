/* Which of a step's query tokens go to the attention kernels together, as a tile
 * (chunk_attention_avx2.c, chunk_attention_avx512.c): consecutive tokens with one block table,
 * a prompt chunk's. Plain C, inlined into each kernel's own target code. */
#ifndef SARATHI_ATTENTION_RUNS_H
#define SARATHI_ATTENTION_RUNS_H

#include <stdint.h>
#include <string.h>

/* Tokens from `first` on that go as one tile: at most `most`, each with the first's table over
 * every block it attends (a prompt chunk's tokens repeat their sequence's table). */
static int64_t run_length(const int64_t *table, const int64_t *lens, int64_t tokens,
                          int64_t max_blocks, int64_t block_size, int64_t first, int64_t most) {
    const int64_t *row = table + first * max_blocks;
    int64_t n = 1;
    for (; n < most && first + n < tokens; ++n) {
        const int64_t used = (lens[first + n] + block_size - 1) / block_size;
        if (memcmp(row, table + (first + n) * max_blocks, (size_t)used * sizeof(int64_t)) != 0)
            break;
    }
    return n;
}

/* Work items: runs[k] = (first token, count), the tiles of more than one token first, so that
 * the largest items start first and the threads finish together. Returns their number. */
static int64_t split_into_runs(const int64_t *table, const int64_t *lens, int64_t tokens,
                               int64_t max_blocks, int64_t block_size, int64_t most,
                               int64_t *runs) {
    int64_t num_runs = 0;
    for (int pass = 0; pass < 2; ++pass)
        for (int64_t first = 0; first < tokens;) {
            const int64_t n = run_length(table, lens, tokens, max_blocks, block_size, first, most);
            if ((n > 1) == (pass == 0)) {
                runs[2 * num_runs] = first;
                runs[2 * num_runs + 1] = n;
                ++num_runs;
            }
            first += n;
        }
    return num_runs;
}

#endif
