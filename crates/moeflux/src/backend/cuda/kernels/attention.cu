// Causal grouped-query attention over a KV cache `[capacity, kv_heads ·
// head_dim]` that already holds the new keys and values.
//
// One block per (query token, head). Each of the block's W warps takes
// every W-th visible position and keeps a running (online) softmax: its
// maximum, the sum of exp(score - maximum) and the weighted sum of values;
// the warps' partial results are merged at the end. No buffer grows with
// the context. A decode step has one block per head only, so it takes
// more warps per block (ATTN_DECODE_WARPS) to keep the context's reads in
// flight; prefill has blocks enough with ATTN_WARPS.

#define ATTN_WARPS 4
#define ATTN_DECODE_WARPS 16
// Head dimensions up to ATTN_MAX_PER_LANE · 32 (checked on the host).
#define ATTN_MAX_PER_LANE 16

// `start` is the position of the first query, read from `position` on the
// device instead when that is given (a recorded decode step).
template <int W>
__device__ __forceinline__ void attend(const float* q, const float* keys, const float* values,
                                       float* out, int n, int heads, int kv_heads, int head_dim,
                                       i64 start, const u32* position, float scale) {
    if (position) start = *position;
    __shared__ float warp_max_score[W];
    __shared__ float warp_total[W];
    __shared__ float warp_acc[W][ATTN_MAX_PER_LANE * WARP_SIZE];
    int warp = threadIdx.x / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    int group = heads / kv_heads;
    i64 kv_width = (i64)kv_heads * head_dim;
    i64 q_width = (i64)heads * head_dim;

    for (i64 item = blockIdx.x; item < (i64)n * heads; item += gridDim.x) {
        i64 t = item / heads;
        int h = (int)(item % heads);
        const float* query = q + t * q_width + (i64)h * head_dim;
        const float* k_head = keys + (i64)(h / group) * head_dim;
        const float* v_head = values + (i64)(h / group) * head_dim;
        i64 visible = start + t + 1;

        float qv[ATTN_MAX_PER_LANE];
        float acc[ATTN_MAX_PER_LANE];
#pragma unroll
        for (int k = 0; k < ATTN_MAX_PER_LANE; ++k) {
            int d = lane + k * WARP_SIZE;
            qv[k] = d < head_dim ? query[d] : 0.0f;
            acc[k] = 0.0f;
        }
        float max_score = NEG_INF;
        float total = 0.0f;
        for (i64 j = warp; j < visible; j += W) {
            const float* key = k_head + j * kv_width;
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < ATTN_MAX_PER_LANE; ++k) {
                int d = lane + k * WARP_SIZE;
                if (d < head_dim) s = fmaf(qv[k], key[d], s);
            }
            s = warp_sum(s) * scale;
            float new_max = fmaxf(max_score, s);
            float rescale = expf(max_score - new_max);  // 0 for the first position
            float p = expf(s - new_max);
            total = total * rescale + p;
            const float* value = v_head + j * kv_width;
#pragma unroll
            for (int k = 0; k < ATTN_MAX_PER_LANE; ++k) {
                int d = lane + k * WARP_SIZE;
                if (d < head_dim) acc[k] = acc[k] * rescale + p * value[d];
            }
            max_score = new_max;
        }
        if (lane == 0) {
            warp_max_score[warp] = max_score;
            warp_total[warp] = total;
        }
#pragma unroll
        for (int k = 0; k < ATTN_MAX_PER_LANE; ++k) {
            int d = lane + k * WARP_SIZE;
            if (d < head_dim) warp_acc[warp][d] = acc[k];
        }
        __syncthreads();
        // A warp that saw no position has maximum -inf and weighs 0; at
        // least one warp saw position 0, so the overall maximum is finite.
        float overall = warp_max_score[0];
        for (int w = 1; w < W; ++w) overall = fmaxf(overall, warp_max_score[w]);
        float weights[W];
        float denominator = 0.0f;
        for (int w = 0; w < W; ++w) {
            weights[w] = expf(warp_max_score[w] - overall);
            denominator += warp_total[w] * weights[w];
        }
        float* o = out + t * q_width + (i64)h * head_dim;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float sum = 0.0f;
            for (int w = 0; w < W; ++w) sum += warp_acc[w][d] * weights[w];
            o[d] = sum / denominator;
        }
        __syncthreads();  // the next item reuses the shared arrays
    }
}

#define ATTENTION_KERNEL(name, W)                                                         \
    extern "C" __global__ void __launch_bounds__(W * WARP_SIZE)                           \
        name(const float* q, const float* keys, const float* values, float* out, int n,   \
             int heads, int kv_heads, int head_dim, i64 start, const u32* position,       \
             float scale) {                                                               \
        attend<W>(q, keys, values, out, n, heads, kv_heads, head_dim, start, position,    \
                  scale);                                                                 \
    }

ATTENTION_KERNEL(attention, ATTN_WARPS)
ATTENTION_KERNEL(attention_decode, ATTN_DECODE_WARPS)

// keys[start + t] = k[t], values[start + t] = v[t] for the n new rows of
// `width`; `start` from `position` on the device when given.
extern "C" __global__ void kv_store(float* keys, float* values, const float* k, const float* v,
                                    i64 width, int n, i64 start, const u32* position) {
    if (position) start = *position;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)n * width;
         i += (i64)gridDim.x * blockDim.x) {
        keys[start * width + i] = k[i];
        values[start * width + i] = v[i];
    }
}
