/* Walking a sequence's paged KV cache one position at a time, as the AVX-512 attention kernel
 * (paged_attention.c) does. Plain C, inlined into the kernel's own target code. (The AVX2
 * kernel goes block by block instead, to take key rows eight at a time within a block.) */
#ifndef SARATHI_PAGED_ROWS_H
#define SARATHI_PAGED_ROWS_H

#include <stdint.h>

/* Walks a sequence's positions in order through its block table, yielding each position's row
 * for one KV head as a byte offset into the cache: no division per position (a 64-bit divide
 * by the block size per row made both passes wait on it). */
typedef struct {
    const int64_t *table; /* the next block's entry */
    int64_t block_bytes, row_bytes, head_bytes, left_in_block, next_row;
} rows_t;

static inline rows_t rows_from(const int64_t *table, int64_t block_size, int64_t row_bytes,
                               int64_t head_bytes) {
    rows_t r = {table, block_size * row_bytes, row_bytes, head_bytes, 0, 0};
    return r;
}

static inline int64_t next_row(rows_t *r, int64_t block_size) {
    if (r->left_in_block == 0) { /* the next block, read only when a position needs it */
        r->next_row = *r->table++ * r->block_bytes + r->head_bytes;
        r->left_in_block = block_size;
    }
    int64_t row = r->next_row;
    r->next_row += r->row_bytes;
    --r->left_in_block;
    return row;
}


#endif
