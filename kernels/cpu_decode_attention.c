/* One decode step of grouped-query attention on CPU: RoPE, KV-cache write and attention in one call.
 *
 * `mixed` is the QKV projection of the step in Megatron's per-group layout, [slots][groups][heads + 2][head_dim]
 * (the group's query heads, then its key, then its value), contiguous. For each slot s and group g: rotate the
 * key and the query heads (x * cos + rotate_half(x) * sin, with `sin` already carrying rotate_half's sign:
 * rows cos_sin[s] = [cos | signed sin], each head_dim long), write key and value at position pos[s] of the
 * cache row, then attend over positions 0..pos[s] of that row only (no mask, no work past each slot's own
 * length): scores = scale * q.k, softmax, weighted sum of values. Output [slots][groups][heads][head_dim].
 * fp32 throughout. Scratch: heads * (max_len + head_dim) floats. Single-threaded (no OpenMP runtime next to
 * torch's). Built by cpu_decode_attention.py with gcc; the torch ops in rlhf.rollout.native.forward are the
 * reference path.
 */
#include <math.h>
#include <stdint.h>

static void rotate(const float *x, const float *cos, const float *sin, int64_t head_dim, float *out) {
    const int64_t half = head_dim / 2;
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] + x[d + half] * sin[d];
#pragma omp simd
    for (int64_t d = half; d < head_dim; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

void rlhf_decode_attention(const float *mixed, const float *cos_sin, float *k_cache, float *v_cache,
                           const int64_t *pos, int64_t num_slots, int64_t groups, int64_t heads, int64_t head_dim,
                           int64_t max_len, float scale, float *out, float *scratch) {
    float *scores = scratch, *queries = scratch + heads * max_len;
    for (int64_t sg = 0; sg < num_slots * groups; ++sg) {
        const int64_t s = sg / groups, p = pos[s];
        const float *x = mixed + sg * (heads + 2) * head_dim;
        const float *cos = cos_sin + s * 2 * head_dim, *sin = cos + head_dim;
        float *keys = k_cache + sg * max_len * head_dim;
        float *values = v_cache + sg * max_len * head_dim;
        rotate(x + heads * head_dim, cos, sin, head_dim, keys + p * head_dim);
        for (int64_t d = 0; d < head_dim; ++d) values[p * head_dim + d] = x[(heads + 1) * head_dim + d];
        for (int64_t h = 0; h < heads; ++h) rotate(x + h * head_dim, cos, sin, head_dim, queries + h * head_dim);
        /* Each cache row is read once for all of the group's heads: scores[h * max_len + l]. */
        for (int64_t l = 0; l <= p; ++l) {
            const float *kv = keys + l * head_dim;
            for (int64_t h = 0; h < heads; ++h) {
                const float *qv = queries + h * head_dim;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < head_dim; ++d) acc += qv[d] * kv[d];
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
        float *o = out + sg * heads * head_dim;
        for (int64_t i = 0; i < heads * head_dim; ++i) o[i] = 0.0f;
        for (int64_t l = 0; l <= p; ++l) {
            const float *vv = values + l * head_dim;
            for (int64_t h = 0; h < heads; ++h) {
                const float w = scores[h * max_len + l];
                float *oh = o + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) oh[d] += w * vv[d];
            }
        }
    }
}
