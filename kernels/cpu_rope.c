/* Training's rotary embedding on CPU in fp32 (Megatron/HF non-interleaved), forward and backward in one pass each.
 *
 * x [tokens][batch][heads][dim] with any token, batch and head strides (the key is a view into the fused QKV
 * projection), the last dimension contiguous; cos and sin [tokens][dim], one row per token shared by its batch
 * (THD packs: batch 1, a row per packed token; bshd: a row per position). Forward:
 * out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] (x1, x2 the halves of dim), as Megatron's
 * `_apply_rotary_pos_emb_bshd` computes it in ~6 torch passes. Backward, the adjoint: grad_x = g * cos +
 * rotate_half^T(g * sin), rotate_half^T(z) = [z2, -z1]. out is contiguous [tokens][heads][dim]. Single-threaded.
 */
#include <stdint.h>

void rlhf_rope_f32(const float *x, int64_t tokens, int64_t batch, int64_t heads, int64_t dim, int64_t token_stride,
                   int64_t batch_stride, int64_t head_stride, const float *cos, const float *sin, int backward,
                   float *out) {
    const int64_t half = dim / 2;
    for (int64_t tb = 0; tb < tokens * batch; ++tb) {
        const int64_t t = tb / batch, b = tb % batch;
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
            const float *xh = x + t * token_stride + b * batch_stride + h * head_stride;
            float *o = out + (tb * heads + h) * dim;
            if (backward) {
#pragma omp simd
                for (int64_t d = 0; d < half; ++d) o[d] = xh[d] * c[d] + xh[d + half] * s[d + half];
#pragma omp simd
                for (int64_t d = half; d < dim; ++d) o[d] = xh[d] * c[d] - xh[d - half] * s[d - half];
            } else {
#pragma omp simd
                for (int64_t d = 0; d < half; ++d) o[d] = xh[d] * c[d] - xh[d + half] * s[d];
#pragma omp simd
                for (int64_t d = half; d < dim; ++d) o[d] = xh[d] * c[d] + xh[d - half] * s[d];
            }
        }
    }
}
