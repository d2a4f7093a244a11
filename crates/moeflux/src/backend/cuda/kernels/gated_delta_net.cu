// Gated DeltaNet's token mixing: causal depthwise conv1d + SiLU over the
// q|k|v channels with a rolling history of kernel - 1 inputs, L2-normalised
// q and k, then the gated delta rule per value head.

// mixed[t, c] = silu(Σ_i w[c, i] · window[t + i, c]) where window is the
// history `[kernel - 1, channels]` followed by the new inputs qkv `[n, channels]`.
extern "C" __global__ void gdn_conv(const float* qkv, const float* history,
                                    const float* weight, float* mixed, int n, int channels,
                                    int kernel) {
    await_inputs();
    int kept = kernel - 1;
    i64 total = (i64)n * channels;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        i64 t = idx / channels;
        int c = (int)(idx % channels);
        float acc = 0.0f;
        for (int i = 0; i < kernel; ++i) {
            i64 r = t + i;
            float v = r < kept ? history[r * channels + c] : qkv[(r - kept) * channels + c];
            acc += weight[(i64)c * kernel + i] * v;
        }
        mixed[idx] = silu(acc);
    }
}

// The new history: the last kernel - 1 rows of [history | qkv]. One thread
// per channel walks the rows upwards, so the rows it still has to read
// (n + r > r) are never overwritten first.
extern "C" __global__ void gdn_conv_history(const float* qkv, float* history, int n,
                                            int channels, int kernel) {
    await_inputs();
    int kept = kernel - 1;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < channels;
         c += gridDim.x * blockDim.x) {
        for (int r = 0; r < kept; ++r) {
            i64 source = (i64)n + r;
            history[(i64)r * channels + c] =
                source < kept ? history[source * channels + c]
                              : qkv[(source - kept) * channels + c];
        }
    }
}

// Scales each query and key head (the first 2·key_heads heads of key_head_dim
// features of a row) by 1/sqrt(Σx² + 1e-6), the queries also by q_scale.
// One warp per (token, head).
extern "C" __global__ void gdn_qk_norm(float* mixed, int n, int channels, int key_heads,
                                       int key_head_dim, float q_scale) {
    await_inputs();
    int lane = threadIdx.x % WARP_SIZE;
    i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    i64 warps = ((i64)gridDim.x * blockDim.x) / WARP_SIZE;
    i64 total = (i64)n * 2 * key_heads;
    for (i64 item = warp; item < total; item += warps) {
        i64 t = item / (2 * key_heads);
        int head = (int)(item % (2 * key_heads));
        float* x = mixed + t * channels + (i64)head * key_head_dim;
        float squares = 0.0f;
        for (int d = lane; d < key_head_dim; d += WARP_SIZE) squares += x[d] * x[d];
        float inv = 1.0f / sqrtf(warp_sum(squares) + 1e-6f);
        for (int d = lane; d < key_head_dim; d += WARP_SIZE) {
            float v = x[d] * inv;
            x[d] = head < key_heads ? v * q_scale : v;
        }
    }
}

// The delta rule, token by token. Per token: S *= decay;
// delta = (v - Sᵀk) · beta; S += k ⊗ delta; o = Sᵀq, for the head's state
// S `[dk, dv]`. Every step reads and writes only its own column of S, so a
// warp owns one column, held in registers across the tokens (lane l holds
// rows l, l + 32, ...; dk ≤ 32 · GDN_LANE_ROWS, checked on the host), and
// the two dot products per token are warp sums. The next token's inputs
// are loaded while the current one computes. Grid (value_heads,
// ceil(dv / GDN_WARPS)), GDN_WARPS warps per block (columns of one head,
// which share q and k through L1).
// Launch geometry comes from the host: compile.rs passes the constants of
// geometry.rs as -D options, so a launch and its kernel cannot disagree.
#if !defined(GDN_WARPS) || !defined(GDN_LANE_ROWS)
#error "gated_delta_net.cu: launch geometry missing (compile.rs passes geometry.rs as -D options)"
#endif

// One token's inputs of one column.
struct GdnStep {
    float q[GDN_LANE_ROWS];
    float k[GDN_LANE_ROWS];
    float v, a, b;
};

__device__ __forceinline__ void gdn_load(GdnStep& step, const float* mixed, const float* b,
                                         const float* a, i64 t, int channels, int key,
                                         int key_dim, int v_index, int h, int value_heads,
                                         int dk, int lane) {
    const float* row = mixed + t * channels;
#pragma unroll
    for (int r = 0; r < GDN_LANE_ROWS; ++r) {
        int i = lane + r * WARP_SIZE;
        step.q[r] = i < dk ? row[key + i] : 0.0f;
        step.k[r] = i < dk ? row[key_dim + key + i] : 0.0f;
    }
    step.v = row[v_index];
    step.a = a[t * value_heads + h];
    step.b = b[t * value_heads + h];
}

extern "C" __global__ void __launch_bounds__(GDN_WARPS * WARP_SIZE)
    gdn_recurrence(const float* mixed, const float* b, const float* a, const float* a_log,
                   const float* dt_bias, float* state, float* out, int n, int channels,
                   int key_heads, int value_heads, int dk, int dv) {
    await_inputs();
    int warp = threadIdx.x / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    int h = blockIdx.x;
    int j = blockIdx.y * GDN_WARPS + warp;
    if (j >= dv) return;  // whole warps; no block-wide barriers below
    int key_dim = key_heads * dk;
    int key = (h / (value_heads / key_heads)) * dk;
    int v_index = 2 * key_dim + h * dv + j;
    float* s = state + (i64)h * dk * dv + j;
    float column[GDN_LANE_ROWS];
#pragma unroll
    for (int r = 0; r < GDN_LANE_ROWS; ++r) {
        int i = lane + r * WARP_SIZE;
        column[r] = i < dk ? s[(i64)i * dv] : 0.0f;
    }
    float decay_rate = -expf(a_log[h]);
    float bias = dt_bias[h];
    GdnStep next;
    if (n > 0) {
        gdn_load(next, mixed, b, a, 0, channels, key, key_dim, v_index, h, value_heads, dk,
                 lane);
    }
    for (int t = 0; t < n; ++t) {
        GdnStep step = next;
        if (t + 1 < n) {
            gdn_load(next, mixed, b, a, t + 1, channels, key, key_dim, v_index, h, value_heads,
                     dk, lane);
        }
        float decay = expf(decay_rate * softplus(step.a + bias));
        float beta = sigmoid(step.b);
        float kv = 0.0f;
#pragma unroll
        for (int r = 0; r < GDN_LANE_ROWS; ++r) {
            column[r] *= decay;
            kv += column[r] * step.k[r];
        }
        float delta = (step.v - warp_sum(kv)) * beta;
        float o = 0.0f;
#pragma unroll
        for (int r = 0; r < GDN_LANE_ROWS; ++r) {
            column[r] += step.k[r] * delta;
            o += column[r] * step.q[r];
        }
        o = warp_sum(o);
        if (lane == 0) out[(i64)t * value_heads * dv + (i64)h * dv + j] = o;
    }
#pragma unroll
    for (int r = 0; r < GDN_LANE_ROWS; ++r) {
        int i = lane + r * WARP_SIZE;
        if (i < dk) s[(i64)i * dv] = column[r];
    }
}
