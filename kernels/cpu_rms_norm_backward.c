/* The fp32 RMSNorm backward of training, for y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) per row (the
 * forward, which also returns rstd, is `rlhf_rms_norm_f32` in cpu_decode_attention.c):
 *   grad_x = rstd * (g * w) - x * rstd^3 * mean((g * w) * x),   grad_w = sum over rows of g * x * rstd.
 * torch's composite rms_norm runs this as ~20 separate elementwise passes and reductions over [rows, dim]; on a
 * SmolLM2 training step (61 norms, two micro-batches of 256 rows) those cost ~100 ms of ~3.3 s. grad_w is summed
 * over the rows in double (`acc`, dim doubles of scratch), then rounded once: as accurate as torch's cascade sum.
 * Returns 0, or -1 when the scratch could not be allocated (nothing written). */
#include <stdint.h>
#include <stdlib.h>

int rlhf_rms_norm_backward_f32(const float *x, const float *weight, const float *rstd, const float *grad,
                               int64_t rows, int64_t dim, float *grad_x, float *grad_w) {
    double *acc = calloc((size_t)dim, sizeof(double));
    if (acc == NULL) return -1;
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * dim, *gr = grad + r * dim;
        float *gx = grad_x + r * dim;
        const float inv = rstd[r];
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += gr[d] * weight[d] * xr[d];
        const float scale = inv * inv * inv * dot / (float)dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) {
            gx[d] = inv * gr[d] * weight[d] - xr[d] * scale;
            acc[d] += (double)(gr[d] * xr[d] * inv);
        }
    }
    for (int64_t d = 0; d < dim; ++d) grad_w[d] = (float)acc[d];
    free(acc);
    return 0;
}
