/* fp32 GEMMs at decode size on CPU: y[m][n] = x[m][k] @ W^T (+ add[m][n]) for a few dozen rows x against a
 * weight W [n][k] read from memory once per call.
 *
 * At 32 rows such a GEMM is bound by reading W, and a single core only reads memory near its stream rate when the
 * reads are issued ahead of use. The weight is packed once (`rlhf_pack_linear_f32`) into panels of NR columns,
 * panel-major: packed[panel][k][NR], zero-padded past n. Each panel is then served, KB rows of k at a time (a chunk
 * that stays in L1), to every block of MR rows (MR x NR accumulators in registers, one broadcast of x and NR/16
 * vector loads of the panel per k), while the next panel is prefetched into L2, spread over the tiles, so its read
 * from memory overlaps this panel's arithmetic. On a 2-core Xeon (one thread) this ran the decode GEMMs of
 * SmolLM2-135M (32 rows, weights out of cache) 1.3-1.7x faster per call than oneDNN's packed inner product
 * (1.1-1.2x with torch's output allocation around it); serving the panel from L1 in chunks instead of whole from L2
 * made a decode step's GEMMs (30 layers + LM head) 6-7% faster again (68 -> 64 ms, same sums bit for bit).
 * Vectors are GCC's vector extension (16 floats: one AVX-512 register, two AVX2 ones); single-threaded, like the
 * rest of this library. Built by cpu_decode_attention.py with the attention kernel.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define NR 48
#define MR 8
#define LINE 64
#define KB 96         /* k per chunk: a chunk of a panel is 18 KB, served to every row block from L1 */
#define MAX_BLOCKS 16 /* row blocks per pass over the weight (128 rows: DECODE_GEMM_ROWS) */

typedef float vf16 __attribute__((vector_size(64)));
typedef float vf16u __attribute__((vector_size(64), aligned(4), may_alias));

void rlhf_pack_linear_f32(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t kk = 0; kk < k; ++kk) {
            float *dst = packed + (p * k + kk) * NR;
            for (int64_t j = 0; j < NR; ++j) {
                const int64_t col = p * NR + j;
                dst[j] = col < n ? w[col * k + kk] : 0.0f;
            }
        }
}

/* rows (<= MR) rows of x[:, k0:k1] against the panel's rows k0..k1-1, accumulated in registers from `part` (from 0
 * when first) and stored back to `part`, or when last written to y (cols <= NR valid columns) plus `add` when given:
 * every output is still one sum in k order, so the result does not depend on KB. Prefetches pf_bytes of the next
 * panel from pf, a cache line per k. */
INLINE void tile(const float *x, int64_t k, int64_t k0, int64_t k1, const float *panel, float *part, float *y,
                 const float *add, int64_t ld, int rows, int cols, const char *pf, int64_t pf_bytes, int first,
                 int last) {
    vf16 acc[MR][3];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        if (first) {
            acc[r][0] = acc[r][1] = acc[r][2] = (vf16){0};
        } else {
            acc[r][0] = *(const vf16 *)(part + r * NR);
            acc[r][1] = *(const vf16 *)(part + r * NR + 16);
            acc[r][2] = *(const vf16 *)(part + r * NR + 32);
        }
    }
    for (int64_t kk = k0; kk < k1; ++kk) {
        if ((kk - k0) * LINE < pf_bytes) __builtin_prefetch(pf + (kk - k0) * LINE, 0, 2);
        const float *w = panel + kk * NR;
        const vf16 w0 = *(const vf16u *)w, w1 = *(const vf16u *)(w + 16), w2 = *(const vf16u *)(w + 32);
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
            if (r < rows) {
                const float xv = x[r * k + kk];
                acc[r][0] += xv * w0;
                acc[r][1] += xv * w1;
                acc[r][2] += xv * w2;
            }
        }
    }
    if (!last) {
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
            *(vf16 *)(part + r * NR) = acc[r][0];
            *(vf16 *)(part + r * NR + 16) = acc[r][1];
            *(vf16 *)(part + r * NR + 32) = acc[r][2];
        }
        return;
    }
    for (int r = 0; r < rows; ++r) {
        float out[NR];
        memcpy(out, &acc[r][0], sizeof acc[r][0]);
        memcpy(out + 16, &acc[r][1], sizeof acc[r][1]);
        memcpy(out + 32, &acc[r][2], sizeof acc[r][2]);
        if (add != NULL)
            for (int j = 0; j < cols; ++j) out[j] += add[r * ld + j];
        memcpy(y + r * ld, out, (size_t)cols * sizeof(float));
    }
}

/* At most MAX_BLOCKS * MR rows: each panel is served in KB-deep chunks (KB x NR floats, in L1) to every row block,
 * the partial sums of a block kept in `part` between chunks. The next panel's prefetch is spread over all the
 * (chunk, block) tiles. */
static void linear_rows(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *add,
                        float *y) {
    const int64_t panels = (n + NR - 1) / NR, panel_bytes = k * NR * (int64_t)sizeof(float);
    const int64_t blocks = (m + MR - 1) / MR, chunks = (k + KB - 1) / KB;
    const int64_t share = (panel_bytes + blocks * chunks - 1) / (blocks * chunks);
    float part[MAX_BLOCKS][MR * NR] __attribute__((aligned(64)));
    for (int64_t p = 0; p < panels; ++p) {
        const float *panel = packed + p * k * NR;
        const char *next = (const char *)(panel + k * NR);
        const int64_t next_bytes = p + 1 < panels ? panel_bytes : 0;
        const int cols = n - p * NR < NR ? (int)(n - p * NR) : NR;
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t k0 = c * KB, k1 = k0 + KB < k ? k0 + KB : k;
            const int first = c == 0, last = c == chunks - 1;
            for (int64_t b = 0; b < blocks; ++b) {
                const int64_t r0 = b * MR, start = (c * blocks + b) * share;
                const int64_t left = next_bytes - start > 0 ? next_bytes - start : 0;
                const int64_t bytes = left < share ? left : share;
                const int rows = m - r0 < MR ? (int)(m - r0) : MR;
                const float *add_b = add != NULL ? add + r0 * n + p * NR : NULL;
                float *y_b = y + r0 * n + p * NR;
                if (rows == MR) /* the full block gets its own copy of the tile with no row checks */
                    tile(x + r0 * k, k, k0, k1, panel, part[b], y_b, add_b, n, MR, cols, next + start, bytes, first,
                         last);
                else
                    tile(x + r0 * k, k, k0, k1, panel, part[b], y_b, add_b, n, rows, cols, next + start, bytes,
                         first, last);
            }
        }
    }
}

void rlhf_linear_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *add,
                     float *y) {
    for (int64_t r0 = 0; r0 < m; r0 += MAX_BLOCKS * MR) {
        const int64_t rows = m - r0 < MAX_BLOCKS * MR ? m - r0 : MAX_BLOCKS * MR;
        linear_rows(x + r0 * k, rows, k, packed, n, add != NULL ? add + r0 * n : NULL, y + r0 * n);
    }
}

/* out[r][j] = silu(gate_up[r][j]) * gate_up[r][inner + j]: the SwiGLU of a fused [gate; up] projection. */
void rlhf_swiglu_f32(const float *gate_up, int64_t m, int64_t inner, float *out) {
    for (int64_t r = 0; r < m; ++r) {
        const float *gate = gate_up + r * 2 * inner, *up = gate + inner;
        float *o = out + r * inner;
#pragma omp simd
        for (int64_t j = 0; j < inner; ++j) o[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    }
}

/* The backward of rlhf_swiglu_f32 (training): with s = sigmoid(gate), grad_gate_up[r] = [grad_out * up * s * (1 +
 * gate * (1 - s)), grad_out * gate * s], written straight into the [m][2 * inner] gradient of the projection (torch
 * runs this as ~6 passes and a cat). */
void rlhf_swiglu_backward_f32(const float *gate_up, const float *grad_out, int64_t m, int64_t inner,
                              float *grad_gate_up) {
    for (int64_t r = 0; r < m; ++r) {
        const float *gate = gate_up + r * 2 * inner, *up = gate + inner, *g = grad_out + r * inner;
        float *grad_gate = grad_gate_up + r * 2 * inner, *grad_up = grad_gate + inner;
#pragma omp simd
        for (int64_t j = 0; j < inner; ++j) {
            const float s = 1.0f / (1.0f + expf(-gate[j]));
            grad_gate[j] = g[j] * up[j] * (s * (1.0f + gate[j] * (1.0f - s)));
            grad_up[j] = g[j] * gate[j] * s;
        }
    }
}
