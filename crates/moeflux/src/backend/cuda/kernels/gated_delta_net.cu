// Gated DeltaNet's token mixing: causal depthwise conv1d + SiLU over the
// q|k|v channels with a rolling history of kernel - 1 inputs, L2-normalised
// q and k, then the gated delta rule per value head.

#define GDN_THREADS 128

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

// The delta rule, token by token. Grid (value_heads, ceil(dv / GDN_THREADS));
// thread j owns column j of its head's state S `[dk, dv]`: every step of the
// rule reads and writes only that column, so the columns run in parallel.
// Per token: S *= decay; delta = (v - Sᵀk) · beta; S += k ⊗ delta; o = Sᵀq.
// Dynamic shared memory: 2·dk floats (the head's q and k).
extern "C" __global__ void __launch_bounds__(GDN_THREADS)
    gdn_recurrence(const float* mixed, const float* b, const float* a, const float* a_log,
                   const float* dt_bias, float* state, float* out, int n, int channels,
                   int key_heads, int value_heads, int dk, int dv) {
    await_inputs();
    extern __shared__ float qk[];
    float* qs = qk;
    float* ks = qk + dk;
    int h = blockIdx.x;
    int j = blockIdx.y * blockDim.x + threadIdx.x;
    int key_dim = key_heads * dk;
    int key = (h / (value_heads / key_heads)) * dk;
    int v_col = 2 * key_dim + h * dv;
    float* s = state + (i64)h * dk * dv;
    float decay_rate = -expf(a_log[h]);
    for (int t = 0; t < n; ++t) {
        const float* row = mixed + (i64)t * channels;
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = row[key + i];
            ks[i] = row[key_dim + key + i];
        }
        __syncthreads();
        float decay = expf(decay_rate * softplus(a[(i64)t * value_heads + h] + dt_bias[h]));
        float beta = sigmoid(b[(i64)t * value_heads + h]);
        if (j < dv) {
            float kv = 0.0f;
            for (int i = 0; i < dk; ++i) {
                float v = s[(i64)i * dv + j] * decay;
                s[(i64)i * dv + j] = v;
                kv += v * ks[i];
            }
            float delta = (row[v_col + j] - kv) * beta;
            float o = 0.0f;
            for (int i = 0; i < dk; ++i) {
                float v = s[(i64)i * dv + j] + ks[i] * delta;
                s[(i64)i * dv + j] = v;
                o += v * qs[i];
            }
            out[(i64)t * value_heads * dv + (i64)h * dv + j] = o;
        }
        __syncthreads();  // before the next token overwrites q and k
    }
}
