// RMSNorm over consecutive groups of `group` features (a whole row, or one
// head): one block per group, the sum of squares reduced across the block.

// NORM_THREADS: the most threads per block.
// Launch geometry comes from the host: compile.rs passes the constants of
// geometry.rs as -D options, so a launch and its kernel cannot disagree.
#if !defined(NORM_THREADS) || !defined(QK_WARPS)
#error "norm.cu: launch geometry missing (compile.rs passes geometry.rs as -D options)"
#endif

// 1/sqrt(mean(x²) + eps) over the `n` values of x, by the whole block
// (`scratch`: block_sum's).
__device__ __forceinline__ float block_inverse_rms(const float* x, int n, float eps,
                                                   float* scratch) {
    float squares = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) squares += x[i] * x[i];
    squares = block_sum(squares, scratch);
    return 1.0f / sqrtf(squares / (float)n + eps);
}

// out = x · 1/sqrt(mean(x²) + eps) · (offset + w); offset is 0 or 1.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    rms_norm(const float* x, const float* weight, float* out, i64 groups, int group,
             float eps, float offset) {
    prefetch_span(weight, 4 * (i64)group);
    await_inputs();
    __shared__ float scratch[32];
    for (i64 g = blockIdx.x; g < groups; g += gridDim.x) {
        const float* xg = x + g * group;
        float* og = out + g * group;
        float inv = block_inverse_rms(xg, group, eps, scratch);
        for (int i = threadIdx.x; i < group; i += blockDim.x) {
            og[i] = xg[i] * inv * (offset + weight[i]);
        }
    }
}

// Gated DeltaNet's output norm: out = x · 1/sqrt(mean(x²) + eps) · w · silu(z).
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    gated_rms_norm(const float* x, const float* z, const float* weight, float* out,
                   i64 groups, int group, float eps) {
    prefetch_span(weight, 4 * (i64)group);
    await_inputs();
    __shared__ float scratch[32];
    for (i64 g = blockIdx.x; g < groups; g += gridDim.x) {
        const float* xg = x + g * group;
        const float* zg = z + g * group;
        float* og = out + g * group;
        float inv = block_inverse_rms(xg, group, eps, scratch);
        for (int i = threadIdx.x; i < group; i += blockDim.x) {
            og[i] = xg[i] * inv * weight[i] * silu(zg[i]);
        }
    }
}

// qk_norm_rope's weights and frequencies asked of L2 before the kernel
// before has finished.
__device__ __forceinline__ void prefetch_qk_weights(const float* q_weight,
                                                    const float* k_weight,
                                                    const float* inv_freq, int head_dim,
                                                    int half) {
    prefetch_span(q_weight, 4 * (i64)head_dim);
    prefetch_span(k_weight, 4 * (i64)head_dim);
    prefetch_span(inv_freq, 4 * (i64)half);
}

// Attention's queries and keys, prepared in one launch: RMSNorm of each
// head (times offset + weight), then the rotation `rope` applies, with the
// same arithmetic as rms_norm and rope. One block per head of q or k;
// q is [rows, q_heads · head_dim], k [rows, k_heads · head_dim], both in
// place; row t sits at position start_pos + t, start_pos read from
// `position` on the device when given (a recorded decode step), or at
// positions[t] when given (rows of several sequences); cos and sin are
// multiplied by `scale` (YaRN's attention factor, else 1). block_threads
// is the launch's threads a block. Dynamic shared memory: head_dim floats.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    qk_norm_rope(float* q, float* k, const float* q_weight, const float* k_weight,
                 const float* inv_freq, i64 rows, int q_heads, int k_heads, int head_dim,
                 int half, float eps, float offset, i64 start_pos, const u32* position,
                 const i64* positions, float scale, int block_threads) {
    prefetch_qk_weights(q_weight, k_weight, inv_freq, head_dim, half);
    await_inputs();
    if (position) start_pos = *position;
    extern __shared__ float normed[];
    __shared__ float scratch[32];
    i64 heads = (i64)q_heads + k_heads;
    for (i64 item = blockIdx.x; item < rows * heads; item += gridDim.x) {
        i64 t = item / heads;
        int h = (int)(item % heads);
        bool is_q = h < q_heads;
        float* head = is_q ? q + (t * q_heads + h) * head_dim
                           : k + (t * k_heads + (h - q_heads)) * head_dim;
        const float* weight = is_q ? q_weight : k_weight;
        float inv = block_inverse_rms(head, head_dim, eps, scratch);
        for (int i = threadIdx.x; i < head_dim; i += block_threads) {
            normed[i] = head[i] * inv * (offset + weight[i]);
        }
        __syncthreads();
        float position = (float)(positions ? positions[t] : start_pos + t);
        for (int i = threadIdx.x; i < head_dim; i += block_threads) {
            float v = normed[i];
            if (i < 2 * half) {
                int kf = i < half ? i : i - half;
                float angle = position * inv_freq[kf];
                float c = cosf(angle) * scale;
                float s = sinf(angle) * scale;
                v = i < half ? normed[i] * c - normed[i + half] * s
                             : normed[i] * c + normed[i - half] * s;
            }
            head[i] = v;
        }
        __syncthreads();  // the next item reuses `normed`
    }
}

// qk_norm_rope with one warp per head, QK_WARPS warps a block, for calls
// of many heads (several sequences' decode steps, prefill chunks): a
// head's sum of squares needs no block barrier, each lane rotates whole
// pairs (one cos and sin per frequency), and a quarter of the blocks take
// fewer waves of the multiprocessors. The arithmetic is qk_norm_rope's,
// operation for operation: the sum of squares is added in the order its
// block of `block_threads` threads adds it, so the results are its bit
// for bit. Dynamic shared memory: head_dim floats a warp. block_threads
// is a multiple of 32, at most 1024.
extern "C" __global__ void __launch_bounds__(QK_WARPS * WARP_SIZE)
    qk_norm_rope_warps(float* q, float* k, const float* q_weight, const float* k_weight,
                       const float* inv_freq, i64 rows, int q_heads, int k_heads,
                       int head_dim, int half, float eps, float offset, i64 start_pos,
                       const u32* position, const i64* positions, float scale,
                       int block_threads) {
    prefetch_qk_weights(q_weight, k_weight, inv_freq, head_dim, half);
    await_inputs();
    if (position) start_pos = *position;
    extern __shared__ float qk_normed[];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    float* normed = qk_normed + warp * head_dim;
    const i64 heads = (i64)q_heads + k_heads;
    for (i64 item = (i64)blockIdx.x * QK_WARPS + warp; item < rows * heads;
         item += (i64)gridDim.x * QK_WARPS) {
        const i64 t = item / heads;
        const int h = (int)(item % heads);
        const bool is_q = h < q_heads;
        float* head = is_q ? q + (t * q_heads + h) * head_dim
                           : k + (t * k_heads + (h - q_heads)) * head_dim;
        const float* weight = is_q ? q_weight : k_weight;
        for (int i = lane; i < head_dim; i += WARP_SIZE) normed[i] = head[i];
        // Thread lane + 32·w of such a block adds the squares of features
        // lane + 32·w, + block_threads, ... (all this lane's own); its
        // warps' sums are then added as block_sum adds them.
        float total = 0.0f;
        for (int w = 0; w < block_threads / WARP_SIZE; ++w) {
            float squares = 0.0f;
            for (int i = lane + WARP_SIZE * w; i < head_dim; i += block_threads) {
                squares += normed[i] * normed[i];
            }
            squares = warp_sum(squares);
            if (lane == w) total = squares;
        }
        total = warp_sum(total);
        const float inv = 1.0f / sqrtf(total / (float)head_dim + eps);
        for (int i = lane; i < head_dim; i += WARP_SIZE) {
            normed[i] = normed[i] * inv * (offset + weight[i]);
        }
        __syncwarp();
        const float pos = (float)(positions ? positions[t] : start_pos + t);
        for (int f = lane; f < half; f += WARP_SIZE) {
            const float angle = pos * inv_freq[f];
            const float c = cosf(angle) * scale;
            const float s = sinf(angle) * scale;
            const float a = normed[f], b = normed[f + half];
            head[f] = a * c - b * s;
            head[f + half] = b * c + a * s;
        }
        for (int i = 2 * half + lane; i < head_dim; i += WARP_SIZE) head[i] = normed[i];
        __syncwarp();  // the next item reuses `normed`
    }
}
