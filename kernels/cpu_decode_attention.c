/* One decode step of grouped-query attention on CPU: RoPE, KV-cache write and attention in one call.
 *
 * `mixed` is the QKV projection of the step in Megatron's per-group layout, [slots][groups][heads + 2][head_dim]
 * (the group's query heads, then its key, then its value), contiguous. For each slot s and group g: rotate the
 * key and the query heads (x * cos + rotate_half(x) * sin, with `sin` already carrying rotate_half's sign:
 * rows cos_sin[s] = [cos | signed sin], each head_dim long), write key and value at position pos[s] of the
 * cache row, then attend over positions 0..pos[s] of that row only (no mask, no work past each slot's own
 * length): scores = scale * q.k, softmax, weighted sum of values. Output [slots][groups][heads][head_dim].
 * Two entry points: fp32 tensors (`rlhf_decode_attention`) and bf16 tensors (`rlhf_decode_attention_bf16`:
 * mixed, cos_sin, caches and output bf16, the arithmetic fp32, results rounded to nearest even as torch does).
 * Scratch: heads * (max_len + head_dim) floats. Single-threaded (no OpenMP runtime next to torch's). Built by
 * cpu_decode_attention.py with gcc; the torch ops in rlhf.rollout.native.forward are the reference path.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define LINE 64

INLINE float bf16_to_float(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

INLINE uint16_t float_to_bf16(float x) { /* round to nearest even; NaN stays NaN (quiet bit set) */
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Element i of a fp32 (bf16 == 0) or bf16 array; the callers pass a constant, so each entry point gets its own
 * specialised, vectorisable copy of the kernel. */
INLINE float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void store(void *p, int64_t i, float x, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = float_to_bf16(x);
    else ((float *)p)[i] = x;
}

/* out[o + d] = rotated x[x0 + d] (both typed as `bf16` says, or `out` fp32 when out_f32). */
INLINE void rotate(const void *x, int64_t x0, const void *cs, int64_t c0, int64_t head_dim, void *out, int64_t o,
                   int bf16, int out_f32) {
    const int64_t half = head_dim / 2;
    const int out_bf16 = bf16 && !out_f32;
#pragma omp simd
    for (int64_t d = 0; d < half; ++d)
        store(out, o + d, load(x, x0 + d, bf16) * load(cs, c0 + d, bf16)
                          + load(x, x0 + d + half, bf16) * load(cs, c0 + head_dim + d, bf16), out_bf16);
#pragma omp simd
    for (int64_t d = half; d < head_dim; ++d)
        store(out, o + d, load(x, x0 + d, bf16) * load(cs, c0 + d, bf16)
                          + load(x, x0 + d - half, bf16) * load(cs, c0 + head_dim + d, bf16), out_bf16);
}

/* Prefetch lines first..first+count-1 (of `total`) of `base` into L2. Without it the step waits on every cache row
 * it reads: on a 2-core Xeon, SmolLM2's 30 layers at 32 slots x 56 positions (82 MB of fp32 cache per step, out
 * of cache) took 10-12 ms; prefetching the next row 5-8 ms (resident in cache: 4 ms). */
INLINE void prefetch_lines(const char *base, int64_t first, int64_t count, int64_t total) {
    for (int64_t line = first; line < first + count && line < total; ++line)
        __builtin_prefetch(base + line * LINE, 0, 2);
}

INLINE void decode_attention(const void *mixed, const void *cos_sin, void *k_cache, void *v_cache,
                             const int64_t *pos, int64_t num_slots, int64_t groups, int64_t heads, int64_t head_dim,
                             int64_t max_len, float scale, void *out, float *scratch, int bf16) {
    float *scores = scratch, *queries = scratch + heads * max_len;
    for (int64_t sg = 0; sg < num_slots * groups; ++sg) {
        const int64_t s = sg / groups, p = pos[s];
        const int64_t x0 = sg * (heads + 2) * head_dim, c0 = s * 2 * head_dim, row0 = sg * max_len * head_dim;
        rotate(mixed, x0 + heads * head_dim, cos_sin, c0, head_dim, k_cache, row0 + p * head_dim, bf16, 0);
        for (int64_t d = 0; d < head_dim; ++d)
            store(v_cache, row0 + p * head_dim + d, load(mixed, x0 + (heads + 1) * head_dim + d, bf16), bf16);
        for (int64_t h = 0; h < heads; ++h)
            rotate(mixed, x0 + h * head_dim, cos_sin, c0, head_dim, queries, h * head_dim, bf16, 1);
        /* The next slot-group's cache rows are read from memory while this one computes (prefetched into L2,
         * spread over this one's position loops: its keys during the scores, its values during the sum). */
        const int64_t next = sg + 1 < num_slots * groups ? sg + 1 : sg, elem = bf16 ? 2 : 4;
        const int64_t next_lines = ((pos[next / groups] + 1) * head_dim * elem + LINE - 1) / LINE;
        const int64_t per_position = (next_lines + p) / (p + 1);
        const char *k_next = (const char *)k_cache + next * max_len * head_dim * elem;
        const char *v_next = (const char *)v_cache + next * max_len * head_dim * elem;
        /* Each cache row is read once for all of the group's heads: scores[h * max_len + l]. */
        for (int64_t l = 0; l <= p; ++l) {
            const int64_t k0 = row0 + l * head_dim;
            prefetch_lines(k_next, l * per_position, per_position, next_lines);
            for (int64_t h = 0; h < heads; ++h) {
                const float *qv = queries + h * head_dim;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < head_dim; ++d) acc += qv[d] * load(k_cache, k0 + d, bf16);
                scores[h * max_len + l] = acc * scale;
            }
        }
        for (int64_t h = 0; h < heads; ++h) {
            float *row = scores + h * max_len;
            float top = row[0];
            for (int64_t l = 1; l <= p; ++l) top = row[l] > top ? row[l] : top;
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t l = 0; l <= p; ++l) {
                row[l] = expf(row[l] - top);
                total += row[l];
            }
            const float inv = 1.0f / total;
#pragma omp simd
            for (int64_t l = 0; l <= p; ++l) row[l] *= inv;
        }
        float *acc = queries; /* the queries are spent: accumulate the output there in fp32 */
        for (int64_t i = 0; i < heads * head_dim; ++i) acc[i] = 0.0f;
        for (int64_t l = 0; l <= p; ++l) {
            const int64_t v0 = row0 + l * head_dim;
            prefetch_lines(v_next, l * per_position, per_position, next_lines);
            for (int64_t h = 0; h < heads; ++h) {
                const float w = scores[h * max_len + l];
                float *oh = acc + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) oh[d] += w * load(v_cache, v0 + d, bf16);
            }
        }
        const int64_t o0 = sg * heads * head_dim;
        for (int64_t i = 0; i < heads * head_dim; ++i) store(out, o0 + i, acc[i], bf16);
    }
}

/* The kernel with head_dim a compile-time constant for the common sizes (the inner loops then unroll with no
 * per-loop prologue: 1.3x (fp32) and 1.6x (bf16) faster at SmolLM2's 64), else the generic loops. */
#define DISPATCH(BF16)                                                                                             \
    switch (head_dim) {                                                                                             \
    case 16: decode_attention(mixed, cos_sin, k_cache, v_cache, pos, num_slots, groups, heads, 16, max_len, scale, \
                              out, scratch, BF16); break;                                                          \
    case 32: decode_attention(mixed, cos_sin, k_cache, v_cache, pos, num_slots, groups, heads, 32, max_len, scale, \
                              out, scratch, BF16); break;                                                          \
    case 64: decode_attention(mixed, cos_sin, k_cache, v_cache, pos, num_slots, groups, heads, 64, max_len, scale, \
                              out, scratch, BF16); break;                                                          \
    case 128: decode_attention(mixed, cos_sin, k_cache, v_cache, pos, num_slots, groups, heads, 128, max_len,      \
                               scale, out, scratch, BF16); break;                                                  \
    default: decode_attention(mixed, cos_sin, k_cache, v_cache, pos, num_slots, groups, heads, head_dim, max_len,  \
                              scale, out, scratch, BF16);                                                          \
    }

void rlhf_decode_attention(const float *mixed, const float *cos_sin, float *k_cache, float *v_cache,
                           const int64_t *pos, int64_t num_slots, int64_t groups, int64_t heads, int64_t head_dim,
                           int64_t max_len, float scale, float *out, float *scratch) {
    DISPATCH(0)
}

void rlhf_decode_attention_bf16(const uint16_t *mixed, const uint16_t *cos_sin, uint16_t *k_cache,
                                uint16_t *v_cache, const int64_t *pos, int64_t num_slots, int64_t groups,
                                int64_t heads, int64_t head_dim, int64_t max_len, float scale, uint16_t *out,
                                float *scratch) {
    DISPATCH(1)
}

/* RMSNorm of `rows` rows of `dim` (fp32 or bf16): out = x / sqrt(mean(x^2) + eps) * w, in fp32 (bf16: rounded
 * once; torch's bf16 rms_norm upcasts the same way but in ~8 separate passes). In a decode step every norm follows a
 * GEMM that streamed its weight through the caches, and torch's op then cost ~50 us at 32 x 576 fp32 (~15 us when
 * warm): most of it fetching torch's own dispatch code again. */
INLINE void rms_norm(const void *x, const void *weight, int64_t rows, int64_t dim, float eps, void *out, float *rstd,
                     int bf16) {
    for (int64_t r = 0; r < rows; ++r) {
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < dim; ++d) {
            const float v = load(x, r * dim + d, bf16);
            sum += v * v;
        }
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        if (rstd != NULL) rstd[r] = inv;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d)
            store(out, r * dim + d, load(x, r * dim + d, bf16) * inv * load(weight, d, bf16), bf16);
    }
}

void rlhf_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, int64_t rows, int64_t dim, float eps,
                        uint16_t *out) {
    rms_norm(x, weight, rows, dim, eps, out, NULL, 1);
}

/* rstd (rows floats, or NULL) receives each row's 1 / sqrt(mean(x^2) + eps), which the training backward reuses. */
void rlhf_rms_norm_f32(const float *x, const float *weight, int64_t rows, int64_t dim, float eps, float *out,
                       float *rstd) {
    rms_norm(x, weight, rows, dim, eps, out, rstd, 0);
}

/* The prefill's attention inputs in one pass (fp32 or bf16): `mixed` [prompts][len][groups][heads + 2][head_dim]
 * (the QKV projection of right-padded prompts) -> RoPE'd queries q_out [prompts][groups * heads][len][head_dim],
 * RoPE'd keys k_out and values v_out [prompts][groups][len][head_dim] (the layouts SDPA reads; token_major: q_out
 * [prompts][len][groups * heads][head_dim], k_out and v_out [prompts][len][groups][head_dim], the packed
 * attention kernel's), and keys and values written at positions 0..len-1 of each prompt's cache row slots[p].
 * cos_sin rows [len][2][head_dim] as above; the keys are rotated as the decode step rotates its own. */
INLINE void prefill_rope(const void *mixed, const void *cos_sin, const int64_t *slots, int64_t prompts, int64_t len,
                         int64_t groups, int64_t heads, int64_t head_dim, int64_t max_len, void *q_out, void *k_out,
                         void *v_out, void *k_cache, void *v_cache, int token_major, int bf16) {
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float), row = (size_t)head_dim * elem;
    for (int64_t p = 0; p < prompts; ++p)
        for (int64_t t = 0; t < len; ++t)
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t x0 = ((p * len + t) * groups + g) * (heads + 2) * head_dim, c0 = t * 2 * head_dim;
                for (int64_t h = 0; h < heads; ++h)
                    rotate(mixed, x0 + h * head_dim, cos_sin, c0, head_dim, q_out,
                           (token_major ? ((p * len + t) * groups + g) * heads + h
                                        : ((p * groups + g) * heads + h) * len + t) * head_dim, bf16, 0);
                const int64_t kv = (token_major ? (p * len + t) * groups + g : (p * groups + g) * len + t) * head_dim;
                const int64_t cache = ((slots[p] * groups + g) * max_len + t) * head_dim;
                rotate(mixed, x0 + heads * head_dim, cos_sin, c0, head_dim, k_out, kv, bf16, 0);
                memcpy((char *)k_cache + cache * elem, (const char *)k_out + kv * elem, row);
                memcpy((char *)v_out + kv * elem, (const char *)mixed + (x0 + (heads + 1) * head_dim) * elem, row);
                memcpy((char *)v_cache + cache * elem, (const char *)v_out + kv * elem, row);
            }
}

void rlhf_prefill_rope_bf16(const uint16_t *mixed, const uint16_t *cos_sin, const int64_t *slots, int64_t prompts,
                            int64_t len, int64_t groups, int64_t heads, int64_t head_dim, int64_t max_len,
                            uint16_t *q_out, uint16_t *k_out, uint16_t *v_out, uint16_t *k_cache,
                            uint16_t *v_cache, int token_major) {
    prefill_rope(mixed, cos_sin, slots, prompts, len, groups, heads, head_dim, max_len, q_out, k_out, v_out, k_cache,
                 v_cache, token_major, 1);
}

void rlhf_prefill_rope_f32(const float *mixed, const float *cos_sin, const int64_t *slots, int64_t prompts,
                           int64_t len, int64_t groups, int64_t heads, int64_t head_dim, int64_t max_len,
                           float *q_out, float *k_out, float *v_out, float *k_cache, float *v_cache,
                           int token_major) {
    prefill_rope(mixed, cos_sin, slots, prompts, len, groups, heads, head_dim, max_len, q_out, k_out, v_out, k_cache,
                 v_cache, token_major, 0);
}
