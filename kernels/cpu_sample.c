/* The native sampler's draw on CPU: one token per row of fp32 logits from softmax(logits / temperature), by the
 * inverse CDF at one uniform number per row, and the drawn token's raw and temperature-scaled logprobs.
 *
 * The draw is the torch sampler's (`rlhf/rollout/native/sampler.py`), two-level over blocks of BLOCK tokens: the
 * block whose cumulative mass first exceeds u times the total (just below it), then the token inside it whose
 * cumulative mass first exceeds what is left. Probabilities are never normalised: exp(x - max) serves the draw
 * and the log-sum-exp alike, in two passes over a row (its maximum, then the exponentials summed per block) plus
 * one block recomputed for the inner lookup. Tokens whose scaled logit lies more than -EXP_FLOOR below the row's
 * maximum (probability below 1.8e-35 of the top token's; filtered tokens, -inf, among them) are never drawn and add
 * nothing to the sums: the exp below is exact enough only down to its floor. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256
#define LANES 16
#define EXP_FLOOR (-80.0f)

typedef float vf16 __attribute__((vector_size(64)));
typedef float vf16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t vi16 __attribute__((vector_size(64)));

static inline float below(float total) { return nextafterf(total, 0.0f); }

/* exp(c) for c in [EXP_FLOOR, 0]: 2^n exp(r), n = c / ln 2 rounded, r = c - n ln 2 in [-ln2/2, ln2/2], exp(r) by
 * its degree-6 Taylor polynomial (relative error ~2e-7). Plain vector arithmetic without libmvec's range checks,
 * which this domain never needs: ~2x faster. */
static inline vf16 exp16(vf16 c) {
    const vi16 n = __builtin_convertvector(c * 1.44269504f - 0.5f, vi16); /* c <= 0: truncating t - 0.5 rounds t */
    const vf16 nf = __builtin_convertvector(n, vf16);
    const vf16 r = (c - nf * 0.693145752f) - nf * 1.42860677e-6f;
    vf16 p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (vf16)((n + 127) << 23);
}

/* exp((x - top) * inv_t) for the LANES logits at x (the first `count` of them when fewer, the rest padded with
 * -inf), 0 where that is below EXP_FLOOR (or x is -inf or NaN) */
static inline vf16 weight16(const float *x, int64_t count, float top, float inv_t) {
    vf16 logits;
    if (count >= LANES) {
        logits = *(const vf16u *)x;
    } else {
        float tail[LANES];
        for (int l = 0; l < LANES; ++l) tail[l] = l < count ? x[l] : -INFINITY;
        memcpy(&logits, tail, sizeof logits);
    }
    const vf16 d = (logits - top) * inv_t;
    const vi16 live = d >= EXP_FLOOR;
    return (vf16)((vi16)exp16((vf16)((vi16)d & live)) & live);
}

/* sum of weight16 over x[0, count) */
static inline float mass_of(const float *x, int64_t count, float top, float inv_t) {
    vf16 acc = {0};
    for (int64_t j = 0; j < count; j += LANES) acc += weight16(x + j, count - j, top, inv_t);
    float mass = 0.0f;
    for (int l = 0; l < LANES; ++l) mass += acc[l];
    return mass;
}

/* logits [rows, vocab] (contiguous), inv_t = 1 / temperature > 0, uniform [rows] in [0, 1); block_mass scratch of
 * ceil(vocab / BLOCK) floats. Out: token [rows]; logprob = log_softmax(logits)[token]; scaled_logprob =
 * log_softmax(logits * inv_t)[token]. */
void rlhf_sample_f32(const float *logits, int64_t rows, int64_t vocab, float inv_t, const float *uniform,
                     float *block_mass, int64_t *token, float *logprob, float *scaled_logprob) {
    const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
    const int scaled = inv_t != 1.0f;
    float inner[BLOCK] __attribute__((aligned(64)));
    for (int64_t r = 0; r < rows; ++r) {
        const float *x = logits + r * vocab;
        float top = -FLT_MAX;
#pragma omp simd reduction(max : top)
        for (int64_t j = 0; j < vocab; ++j) top = fmaxf(top, x[j]);
        float total = 0.0f, raw_total = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t start = b * BLOCK, count = (start + BLOCK < vocab ? start + BLOCK : vocab) - start;
            block_mass[b] = mass_of(x + start, count, top, inv_t);
            total += block_mass[b];
            if (scaled) raw_total += mass_of(x + start, count, top, 1.0f);
        }
        const float target = uniform[r] * below(total);
        /* the first block whose cumulative mass exceeds the target (the last one, at worst) */
        int64_t chosen = 0;
        float before = 0.0f;
        for (; chosen < blocks - 1; ++chosen) {
            const float next = before + block_mass[chosen];
            if (next > target) break;
            before = next;
        }
        const int64_t start = chosen * BLOCK, count = (start + BLOCK < vocab ? start + BLOCK : vocab) - start;
        for (int64_t j = 0; j < count; j += LANES)
            *(vf16 *)(inner + j) = weight16(x + start + j, count - j, top, inv_t); /* BLOCK floats: whole vectors */
        float inner_total = 0.0f;
        for (int64_t j = 0; j < count; ++j) inner_total += inner[j];
        /* the block's running sum may end a rounding error below its mass: keep the target under it */
        const float left = fminf(target - before, below(inner_total));
        int64_t pick = count - 1;
        float running = 0.0f;
        for (int64_t j = 0; j < count; ++j) {
            running += inner[j];
            if (running > left) {
                pick = j;
                break;
            }
        }
        const float d = x[start + pick] - top;
        token[r] = start + pick;
        scaled_logprob[r] = d * inv_t - logf(total);
        logprob[r] = scaled ? d - logf(raw_total) : scaled_logprob[r];
    }
}
