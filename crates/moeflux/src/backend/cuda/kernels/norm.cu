// RMSNorm over consecutive groups of `group` features (a whole row, or one
// head): one block per group, the sum of squares reduced across the block.

#define NORM_THREADS 256

// out = x · 1/sqrt(mean(x²) + eps) · (offset + w); offset is 0 or 1.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    rms_norm(const float* x, const float* weight, float* out, i64 groups, int group,
             float eps, float offset) {
    __shared__ float scratch[32];
    for (i64 g = blockIdx.x; g < groups; g += gridDim.x) {
        const float* xg = x + g * group;
        float* og = out + g * group;
        float squares = 0.0f;
        for (int i = threadIdx.x; i < group; i += blockDim.x) squares += xg[i] * xg[i];
        squares = block_sum(squares, scratch);
        float inv = 1.0f / sqrtf(squares / (float)group + eps);
        for (int i = threadIdx.x; i < group; i += blockDim.x) {
            og[i] = xg[i] * inv * (offset + weight[i]);
        }
    }
}

// Gated DeltaNet's output norm: out = x · 1/sqrt(mean(x²) + eps) · w · silu(z).
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    gated_rms_norm(const float* x, const float* z, const float* weight, float* out,
                   i64 groups, int group, float eps) {
    __shared__ float scratch[32];
    for (i64 g = blockIdx.x; g < groups; g += gridDim.x) {
        const float* xg = x + g * group;
        const float* zg = z + g * group;
        float* og = out + g * group;
        float squares = 0.0f;
        for (int i = threadIdx.x; i < group; i += blockDim.x) squares += xg[i] * xg[i];
        squares = block_sum(squares, scratch);
        float inv = 1.0f / sqrtf(squares / (float)group + eps);
        for (int i = threadIdx.x; i < group; i += blockDim.x) {
            og[i] = xg[i] * inv * weight[i] * silu(zg[i]);
        }
    }
}
