/* One whole decode step of a dense decoder on CPU in fp32, in one call: embedding, every layer, final norm, head.
 *
 * A decode step of a small model is bound by the number of calls, not by arithmetic: SmolLM2-sized weights are
 * streamed from memory by rlhf's decode GEMM whatever calls them, but each layer of the per-op path costs ~10 torch
 * or ctypes calls (norm, QKV, attention, output projection, norm, gate/up, SwiGLU, down), ~5-15 us each, and a tiny
 * model's whole layer computes in less than that. This entry point runs the same kernels of this library in the
 * same order (`rlhf_rms_norm_f32`, `rlhf_linear_f32` on weights packed by `rlhf_pack_linear_f32`,
 * `rlhf_decode_attention`, `rlhf_swiglu_f32`), so its logits are bit for bit those of the per-op path on the same
 * packed weights; only the calls between them are gone.
 *
 * Per layer (Megatron's layout, as rlhf.rollout.native.forward computes it): normed = rms(hidden) * input_norm;
 * mixed = normed @ Wqkv^T (+ bias) as [slots][groups][heads + 2][head_dim]; the query heads and the key head
 * RMS-normed over head_dim (q_norm / k_norm, when given); RoPE, the cache write at each slot's position and
 * attention (`rlhf_decode_attention`); hidden += attn @ Wproj^T; normed = rms(hidden) * mlp_norm; hidden +=
 * swiglu(normed @ Wfc1^T) @ Wfc2^T. Then logits = (rms(hidden) * final_norm) @ Whead^T. Single-threaded.
 */
#include <stdint.h>
#include <string.h>

/* The library's kernels (cpu_decode_attention.c, cpu_decode_gemm.c). */
void rlhf_decode_attention(const float *mixed, const float *cos_sin, float *k_cache, float *v_cache,
                           const int64_t *pos, int64_t num_slots, int64_t groups, int64_t heads, int64_t head_dim,
                           int64_t max_len, float scale, float *out, float *scratch);
void rlhf_rms_norm_f32(const float *x, const float *weight, int64_t rows, int64_t dim, float eps, float *out,
                       float *rstd);
void rlhf_linear_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *add,
                     float *y);
void rlhf_swiglu_f32(const float *gate_up, int64_t m, int64_t inner, float *out);

/* One layer's weights (packed GEMM weights; bias, q_norm and k_norm may be NULL) and its KV cache
 * [cache_slots][groups][max_len][head_dim]. Mirrored by a ctypes Structure in cpu_decode_stack.py. */
typedef struct {
    const float *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *proj, *mlp_norm, *fc1, *fc2;
    float *k_cache, *v_cache;
} rlhf_decode_layer;

/* The model's sizes. Mirrored by a ctypes Structure in cpu_decode_stack.py. */
typedef struct {
    int64_t hidden, groups, heads, head_dim, ffn, max_len, vocab;
    float eps, scale;
} rlhf_decode_geometry;

/* Floats of scratch a step of `slots` slots needs (the Python side allocates it once). */
int64_t rlhf_decode_stack_scratch(const rlhf_decode_geometry *g, int64_t slots) {
    const int64_t qkv = g->groups * (g->heads + 2) * g->head_dim, attn = g->groups * g->heads * g->head_dim;
    return slots * (g->hidden + qkv + attn + 3 * g->ffn + 2 * g->head_dim) + g->heads * (g->max_len + g->head_dim);
}

/* tokens, positions [slots] (int64); rope [positions][2][head_dim] (cos | signed sin, as the attention kernel
 * reads it); embedding [vocab][hidden]; logits [slots][vocab] (the head's rows, padding included); hidden_out
 * [slots][hidden] receives the last hidden states. */
void rlhf_decode_stack_f32(const rlhf_decode_layer *layers, int64_t num_layers, const rlhf_decode_geometry *g,
                           const int64_t *tokens, const int64_t *pos, int64_t slots, const float *embedding,
                           const float *rope, const float *final_norm, const float *head, float *hidden,
                           float *logits, float *scratch) {
    const int64_t h = g->hidden, d = g->head_dim, qkv_n = g->groups * (g->heads + 2) * d;
    const int64_t attn_n = g->groups * g->heads * d, ffn = g->ffn;
    float *normed = scratch, *mixed = normed + slots * h, *attn = mixed + slots * qkv_n;
    float *gate_up = attn + slots * attn_n, *act = gate_up + slots * 2 * ffn, *cos_sin = act + slots * ffn;
    float *attention_scratch = cos_sin + slots * 2 * d;
    for (int64_t s = 0; s < slots; ++s) {
        memcpy(hidden + s * h, embedding + tokens[s] * h, (size_t)h * sizeof(float));
        memcpy(cos_sin + s * 2 * d, rope + pos[s] * 2 * d, (size_t)(2 * d) * sizeof(float));
    }
    for (int64_t i = 0; i < num_layers; ++i) {
        const rlhf_decode_layer *layer = layers + i;
        rlhf_rms_norm_f32(hidden, layer->input_norm, slots, h, g->eps, normed, NULL);
        rlhf_linear_f32(normed, slots, h, layer->qkv, qkv_n, NULL, mixed);
        if (layer->qkv_bias != NULL)
            for (int64_t s = 0; s < slots; ++s)
                for (int64_t j = 0; j < qkv_n; ++j) mixed[s * qkv_n + j] += layer->qkv_bias[j];
        if (layer->q_norm != NULL) /* in place: each row is read whole before it is written */
            for (int64_t sg = 0; sg < slots * g->groups; ++sg) {
                float *group = mixed + sg * (g->heads + 2) * d;
                rlhf_rms_norm_f32(group, layer->q_norm, g->heads, d, g->eps, group, NULL);
                rlhf_rms_norm_f32(group + g->heads * d, layer->k_norm, 1, d, g->eps, group + g->heads * d, NULL);
            }
        rlhf_decode_attention(mixed, cos_sin, layer->k_cache, layer->v_cache, pos, slots, g->groups, g->heads, d,
                              g->max_len, g->scale, attn, attention_scratch);
        rlhf_linear_f32(attn, slots, attn_n, layer->proj, h, hidden, hidden); /* the residual added in place */
        rlhf_rms_norm_f32(hidden, layer->mlp_norm, slots, h, g->eps, normed, NULL);
        rlhf_linear_f32(normed, slots, h, layer->fc1, 2 * ffn, NULL, gate_up);
        rlhf_swiglu_f32(gate_up, slots, ffn, act);
        rlhf_linear_f32(act, slots, ffn, layer->fc2, h, hidden, hidden);
    }
    rlhf_rms_norm_f32(hidden, final_norm, slots, h, g->eps, normed, NULL);
    rlhf_linear_f32(normed, slots, h, head, g->vocab, NULL, logits);
}
