/* Causal attention over a packed (THD) micro-batch for training on CPU, fp32, forward and backward.
 *
 * Sequence s holds tokens [cu[s], cu[s+1]); token t of it attends to its sequence's tokens up to t, never across a
 * boundary, and no padding is computed. q is [T][heads][d], k and v [T][groups][d] (grouped-query: head h reads
 * group h / (heads / groups)), each addressed through its own token and head strides (megatron hands views of the
 * fused QKV projection) with a contiguous last dimension; d is a multiple of 16. out is [T][heads][d] and lse
 * [T][heads] (each row's log of its softmax denominator, kept for the backward), both contiguous.
 *
 * Per (sequence, group) the keys (and in the backward the values) are copied transposed into a [d][ld] scratch; per
 * head, QR query rows at a time: their scores against 32 keys at a time are d multiply-adds of two key vectors by
 * each row's element (QR x 2 accumulators in registers), the softmax runs over each row's causal prefix, and the
 * weighted sum of values runs key by key with the rows' d-vectors in registers. The backward recomputes the rows'
 * probabilities from lse, as flash attention does: with D_r = dO_r . O_r, dS = scale P (dO V^T - D), dQ = dS K,
 * dK = dS^T Q and dV = P^T dO, the heads of a group summed into its dK and dV. Everything stays in cache for the
 * short sequences it is chosen for (the caller keeps torch's flash kernel for long ones). Single-threaded; vectors
 * are GCC's vector extension (16 floats: one AVX-512 register, two AVX2 ones). Built by cpu_decode_attention.py.
 *
 * Both return 0, or -1 when the scratch cannot be allocated (the outputs are then not written). */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define QR 4  /* query rows per block */
#define KT 32 /* keys per score tile: two vectors */
/* The softmax loops run whole vectors of keys, the lanes past a row's causal end zeroed after (a short row's scalar
 * remainder of expf calls cost more than its vector part). Their exponents are floored here: the vector expf takes
 * a slow scalar path for huge negative inputs. exp(-80) = 1.8e-35 stands for a probability below it. */
#define EXP_FLOOR (-80.0f)

typedef float vf16 __attribute__((vector_size(64)));
typedef float vf16u __attribute__((vector_size(64), aligned(4), may_alias));

typedef struct {
    const float *base;
    int64_t token_stride, head_stride;
} view3;

INLINE const float *at(view3 t, int64_t token, int64_t head) {
    return t.base + token * t.token_stride + head * t.head_stride;
}

static int64_t longest(const int64_t *cu, int64_t seqs) {
    int64_t most = 0;
    for (int64_t s = 0; s < seqs; ++s)
        if (cu[s + 1] - cu[s] > most) most = cu[s + 1] - cu[s];
    return most;
}

typedef int32_t vi16 __attribute__((vector_size(64)));

/* Swap the off-diagonal b x b blocks of each 2b x 2b block of a 16 x 16 tile held as 16 row vectors: rows i and
 * i + b exchange the lanes whose bit b differs from the row's. After b = 8, 4, 2, 1 the tile is transposed. */
#define SWAP_BLOCKS(r, b, lo, hi)                                                                                  \
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i)                                                        \
        if (!(i & (b))) {                                                                                        \
            const vf16 a = r[i], c = r[i + (b)];                                                                 \
            r[i] = __builtin_shuffle(a, c, lo);                                                                  \
            r[i + (b)] = __builtin_shuffle(a, c, hi);                                                            \
        }

INLINE void transpose16(vf16 r[16]) {
    SWAP_BLOCKS(r, 8, ((vi16){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
                ((vi16){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}))
    SWAP_BLOCKS(r, 4, ((vi16){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}),
                ((vi16){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}))
    SWAP_BLOCKS(r, 2, ((vi16){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}),
                ((vi16){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}))
    SWAP_BLOCKS(r, 1, ((vi16){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}),
                ((vi16){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}))
}

/* dst[c][j] = element c of row j (of `length` rows from `start` in group g), zero for length <= j < ld; d and ld
 * are multiples of 16, dst 64-byte aligned: 16 x 16 tiles transposed in registers (a copy: exact). */
static void transpose_rows(view3 src, int64_t start, int64_t length, int64_t g, int64_t d, int64_t ld,
                           float *dst) {
    for (int64_t j0 = 0; j0 < ld; j0 += 16)
        for (int64_t c0 = 0; c0 < d; c0 += 16) {
            vf16 tile[16];
            _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) {
                tile[i] = (vf16){0};
                if (j0 + i < length) tile[i] = *(const vf16u *)(at(src, start + j0 + i, g) + c0);
            }
            transpose16(tile);
            _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) *(vf16 *)(dst + (c0 + i) * ld + j0) = tile[i];
        }
}

/* s[r][j] = sum_c rows[r][c] * kt[c][j] for j < keys (rounded up to KT), r < QR; rows [QR][d], kt and s ld wide. */
static void scores(const float *rows, const float *kt, int64_t ld, int64_t d, int64_t keys, float *s) {
    for (int64_t j0 = 0; j0 < keys; j0 += KT) {
        vf16 acc[QR][2];
        for (int r = 0; r < QR; ++r) acc[r][0] = acc[r][1] = (vf16){0};
        for (int64_t c = 0; c < d; ++c) {
            const vf16 k0 = *(const vf16 *)(kt + c * ld + j0), k1 = *(const vf16 *)(kt + c * ld + j0 + 16);
            _Pragma("GCC unroll 4") for (int r = 0; r < QR; ++r) {
                const float x = rows[r * d + c];
                acc[r][0] += x * k0;
                acc[r][1] += x * k1;
            }
        }
        for (int r = 0; r < QR; ++r) {
            *(vf16 *)(s + r * ld + j0) = acc[r][0];
            *(vf16 *)(s + r * ld + j0 + 16) = acc[r][1];
        }
    }
}

/* out[r][c0 + 16 v] (+)= sum_{j < keys} w[r][j] * rows_j[c0 + 16 v] for v < NV, rows_j = at(src, start + j, g):
 * the rows' NV vectors in registers, written to out (row stride ld_out) times mul[r], or added when accumulate. */
INLINE void weighted_rows(const float *w, int64_t ld, view3 src, int64_t start, int64_t g, int64_t keys, int64_t c0,
                          const int NV, float *out, int64_t ld_out, int rows, const float *mul) {
    vf16 acc[QR][4];
    for (int r = 0; r < QR; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = (vf16){0};
    for (int64_t j = 0; j < keys; ++j) {
        const float *x = at(src, start + j, g) + c0;
        vf16 xv[4];
        for (int v = 0; v < NV; ++v) xv[v] = *(const vf16u *)(x + 16 * v);
        _Pragma("GCC unroll 4") for (int r = 0; r < QR; ++r) {
            const float p = w[r * ld + j];
            for (int v = 0; v < NV; ++v) acc[r][v] += p * xv[v];
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < NV; ++v) *(vf16u *)(out + r * ld_out + c0 + 16 * v) = acc[r][v] * mul[r];
}

/* rows_j[c0 + 16 v] += sum_r w[r][j] * x[r][c0 + 16 v] for each key j < keys (rows_j in dst, [T][groups][d]). */
INLINE void add_outer(const float *w, int64_t ld, const float *x, int64_t d, float *dst, int64_t start, int64_t g,
                      int64_t groups, int64_t keys, int64_t c0, const int NV) {
    vf16 xv[QR][4];
    for (int r = 0; r < QR; ++r)
        for (int v = 0; v < NV; ++v) xv[r][v] = *(const vf16 *)(x + r * d + c0 + 16 * v);
    for (int64_t j = 0; j < keys; ++j) {
        float *y = dst + ((start + j) * groups + g) * d + c0;
        vf16 acc[4];
        for (int v = 0; v < NV; ++v) acc[v] = *(const vf16u *)(y + 16 * v);
        _Pragma("GCC unroll 4") for (int r = 0; r < QR; ++r) {
            const float p = w[r * ld + j];
            for (int v = 0; v < NV; ++v) acc[v] += p * xv[r][v];
        }
        for (int v = 0; v < NV; ++v) *(vf16u *)(y + 16 * v) = acc[v];
    }
}

/* weighted_rows / add_outer over all of d, 64 columns (4 vectors) at a time. */
static void weighted_rows_d(const float *w, int64_t ld, view3 src, int64_t start, int64_t g, int64_t keys,
                            int64_t d, float *out, int64_t ld_out, int rows, const float *mul) {
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
        const int64_t left = (d - c0) / 16;
        if (left >= 4) weighted_rows(w, ld, src, start, g, keys, c0, 4, out, ld_out, rows, mul);
        else if (left == 3) weighted_rows(w, ld, src, start, g, keys, c0, 3, out, ld_out, rows, mul);
        else if (left == 2) weighted_rows(w, ld, src, start, g, keys, c0, 2, out, ld_out, rows, mul);
        else weighted_rows(w, ld, src, start, g, keys, c0, 1, out, ld_out, rows, mul);
    }
}

static void add_outer_d(const float *w, int64_t ld, const float *x, int64_t d, float *dst, int64_t start, int64_t g,
                        int64_t groups, int64_t keys) {
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
        const int64_t left = (d - c0) / 16;
        if (left >= 4) add_outer(w, ld, x, d, dst, start, g, groups, keys, c0, 4);
        else if (left == 3) add_outer(w, ld, x, d, dst, start, g, groups, keys, c0, 3);
        else if (left == 2) add_outer(w, ld, x, d, dst, start, g, groups, keys, c0, 2);
        else add_outer(w, ld, x, d, dst, start, g, groups, keys, c0, 1);
    }
}

/* rows i0 .. i0 + rows - 1 of head h copied into buf [QR][d] (zeros past rows). */
static void gather_rows(view3 src, int64_t start, int64_t i0, int rows, int64_t h, int64_t d, float *buf) {
    memset(buf, 0, (size_t)(QR * d) * sizeof(float));
    for (int r = 0; r < rows; ++r) memcpy(buf + r * d, at(src, start + i0 + r, h), (size_t)d * sizeof(float));
}

static float *scratch(int64_t most, int64_t d, int64_t *ld) {
    *ld = (most + KT - 1) / KT * KT;
    const size_t floats = (size_t)(2 * d * *ld + 2 * QR * *ld + 3 * QR * d);
    return aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
}

int rlhf_packed_attention_f32(const float *q, int64_t q_token, int64_t q_head, const float *k, int64_t k_token,
                              int64_t k_head, const float *v, int64_t v_token, int64_t v_head, const int64_t *cu,
                              int64_t seqs, int64_t heads, int64_t groups, int64_t d, float scale, float *out,
                              float *lse) {
    const view3 Q = {q, q_token, q_head}, K = {k, k_token, k_head}, V = {v, v_token, v_head};
    const int64_t per_group = heads / groups;
    int64_t ld;
    float *kt = scratch(longest(cu, seqs), d, &ld);
    if (kt == NULL) return -1;
    float *s = kt + 2 * d * ld, *qb = s + 2 * QR * ld;
    for (int64_t seq = 0; seq < seqs; ++seq) {
        const int64_t start = cu[seq], length = cu[seq + 1] - cu[seq];
        for (int64_t g = 0; g < groups; ++g) {
            transpose_rows(K, start, length, g, d, ld, kt);
            for (int64_t h = g * per_group; h < (g + 1) * per_group; ++h)
                for (int64_t i0 = 0; i0 < length; i0 += QR) {
                    const int rows = length - i0 < QR ? (int)(length - i0) : QR;
                    const int64_t keys = i0 + rows, whole = (keys + 15) / 16 * 16; /* <= the scores written */
                    gather_rows(Q, start, i0, rows, h, d, qb);
                    scores(qb, kt, ld, d, keys, s);
                    float inverse[QR] = {0};
                    for (int r = 0; r < QR; ++r) {
                        float *sr = s + r * ld;
                        if (r >= rows) {
                            memset(sr, 0, (size_t)keys * sizeof(float));
                            continue;
                        }
                        const int64_t n = i0 + r + 1;
                        for (int64_t j = n; j < whole; ++j) sr[j] = -FLT_MAX / 4; /* past the causal end */
                        float top = -FLT_MAX, total = 0.0f;
#pragma omp simd reduction(max : top)
                        for (int64_t j = 0; j < whole; ++j) top = fmaxf(top, sr[j] * scale);
#pragma omp simd
                        for (int64_t j = 0; j < whole; ++j) sr[j] = expf(fmaxf(sr[j] * scale - top, EXP_FLOOR));
                        for (int64_t j = n; j < whole; ++j) sr[j] = 0.0f;
#pragma omp simd reduction(+ : total)
                        for (int64_t j = 0; j < whole; ++j) total += sr[j];
                        inverse[r] = 1.0f / total;
                        lse[(start + i0 + r) * heads + h] = top + logf(total);
                    }
                    weighted_rows_d(s, ld, V, start, g, keys, d, out + ((start + i0) * heads + h) * d, heads * d,
                                    rows, inverse);
                }
        }
    }
    free(kt);
    return 0;
}

int rlhf_packed_attention_backward_f32(const float *q, int64_t q_token, int64_t q_head, const float *k,
                                       int64_t k_token, int64_t k_head, const float *v, int64_t v_token,
                                       int64_t v_head, const float *out, const float *grad_out, const float *lse,
                                       const int64_t *cu, int64_t seqs, int64_t heads, int64_t groups, int64_t d,
                                       float scale, float *grad_q, float *grad_k, float *grad_v) {
    const view3 Q = {q, q_token, q_head}, K = {k, k_token, k_head}, V = {v, v_token, v_head};
    const view3 O = {out, heads * d, d}, G = {grad_out, heads * d, d};
    const int64_t per_group = heads / groups;
    int64_t ld;
    float *kt = scratch(longest(cu, seqs), d, &ld);
    if (kt == NULL) return -1;
    float *vt = kt + d * ld, *p = vt + d * ld, *ds = p + QR * ld, *qb = ds + QR * ld, *gb = qb + QR * d;
    float *ob = gb + QR * d;
    const float ones[QR] = {1.0f, 1.0f, 1.0f, 1.0f};
    const int64_t tokens = cu[seqs] - cu[0];
    memset(grad_k + cu[0] * groups * d, 0, (size_t)(tokens * groups * d) * sizeof(float));
    memset(grad_v + cu[0] * groups * d, 0, (size_t)(tokens * groups * d) * sizeof(float));
    for (int64_t seq = 0; seq < seqs; ++seq) {
        const int64_t start = cu[seq], length = cu[seq + 1] - cu[seq];
        for (int64_t g = 0; g < groups; ++g) {
            transpose_rows(K, start, length, g, d, ld, kt);
            transpose_rows(V, start, length, g, d, ld, vt);
            for (int64_t h = g * per_group; h < (g + 1) * per_group; ++h)
                for (int64_t i0 = 0; i0 < length; i0 += QR) {
                    const int rows = length - i0 < QR ? (int)(length - i0) : QR;
                    const int64_t keys = i0 + rows, whole = (keys + 15) / 16 * 16; /* <= the scores written */
                    gather_rows(Q, start, i0, rows, h, d, qb);
                    gather_rows(G, start, i0, rows, h, d, gb);
                    gather_rows(O, start, i0, rows, h, d, ob);
                    scores(qb, kt, ld, d, keys, p);
                    scores(gb, vt, ld, d, keys, ds); /* dP[r][j] = dO_r . v_j */
                    for (int r = 0; r < QR; ++r) {
                        float *pr = p + r * ld, *dr = ds + r * ld;
                        const int64_t n = r < rows ? i0 + r + 1 : 0;
                        if (n > 0) {
                            const float row_lse = lse[(start + i0 + r) * heads + h];
                            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                            for (int64_t c = 0; c < d; ++c) dot += gb[r * d + c] * ob[r * d + c];
#pragma omp simd
                            for (int64_t j = 0; j < whole; ++j) {
                                pr[j] = expf(fmaxf(pr[j] * scale - row_lse, EXP_FLOOR));
                                dr[j] = pr[j] * (dr[j] - dot) * scale;
                            }
                            for (int64_t j = n; j < whole; ++j) pr[j] = dr[j] = 0.0f;
                        } else {
                            for (int64_t j = 0; j < keys; ++j) pr[j] = dr[j] = 0.0f;
                        }
                    }
                    weighted_rows_d(ds, ld, K, start, g, keys, d, grad_q + ((start + i0) * heads + h) * d,
                                    heads * d, rows, ones);
                    add_outer_d(ds, ld, qb, d, grad_k, start, g, groups, keys);
                    add_outer_d(p, ld, gb, d, grad_v, start, g, groups, keys);
                }
        }
    }
    free(kt);
    return 0;
}
