// Gated DeltaNet's delta rule for many tokens at once, in chunks of
// GDN_CHUNK tokens on the tensor cores (the chunked form of Yang et al.,
// "Gated Delta Networks"), instead of gated_delta_net.cu's token-by-token
// recurrence. Same inputs (the convolved, normalised q|k|v rows, b and a)
// and the same results within f32 rounding.
//
// Per value head, with S0 the state `[dk, dv]` before a chunk, g_t the
// cumulative log decay inside the chunk (Γ_t = exp(g_t)) and β_t the
// write strength, the recurrence S_t = d_t S_{t-1} + k_t δ_tᵀ,
// δ_t = β_t (v_t - (d_t S_{t-1})ᵀ k_t), o_t = S_tᵀ q_t unrolls to
//   U = W_v - W_k S0,  W_v = T diag(β) V,  W_k = T diag(βΓ) K,
//   T = (I + L)⁻¹,     L_ts = β_t exp(g_t - g_s) k_t·k_s   (s < t),
//   O = diag(Γ) Q S0 + M U,   M_ts = exp(g_t - g_s) q_t·k_s   (s ≤ t),
//   S_end = Γ_last S0 + Kᵀ diag(exp(g_last - g)) U,
// with U's rows the δ_t. W_v, W_k and M depend on the chunk alone:
// gdn_chunk_prepare computes them for every (head, chunk) in parallel;
// gdn_chunk_state then walks the chunks in order, a block per (head,
// GDN_STATE_COLS columns of S), the columns being independent.
//
// Products run as three TF32 MMAs per step (hi·hi + hi·lo + lo·hi of the
// operands split as x = hi + lo, both TF32): about f32 accuracy, which the
// tests hold these kernels to. Rows past the last token of a partial chunk
// are zeros (k = q = v = 0, β = 0, log decay 0), which leaves U, O and S
// as they would be without them.

#define GDN_CHUNK 64
#define GDN_CHUNK_THREADS 256
#define GDN_STATE_COLS 32
// Row stride of U and of the state tile: ≡ 8 (mod 32) words, so the B
// fragment's loads (k = lane % 4 rows apart, n = lane / 4 columns) hit 32
// different banks.
#define GDN_TILE_LD (GDN_STATE_COLS + 8)
#define GDN_TRI_LD (GDN_CHUNK + 4)

#if __CUDA_ARCH__ >= 800

__device__ __forceinline__ u32 to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// acc[nt] (16 rows × 8 columns, nt = 0..NT-1 side by side) += A · B over
// k in [0, k_len), k_len a multiple of 8; a(r, k) gives A's row r of the
// tile, b(k, n) B's column n of the NT·8. Fragments of
// mma.m16n8k8.row.col.tf32 with g = lane / 4, i = lane % 4:
//   A: a0 = (g, i), a1 = (g+8, i), a2 = (g, i+4), a3 = (g+8, i+4)
//   B: b0 = (k i, n g), b1 = (k i+4, n g)
//   C: c0 = (g, 2i), c1 = (g, 2i+1), c2 = (g+8, 2i), c3 = (g+8, 2i+1)
template <int NT, typename LoadA, typename LoadB>
__device__ __forceinline__ void warp_product(float (&acc)[NT][4], int k_len, LoadA a, LoadB b) {
    int lane = threadIdx.x % WARP_SIZE;
    int g = lane / 4, i = lane % 4;
    for (int k0 = 0; k0 < k_len; k0 += 8) {
        float av[4] = {a(g, k0 + i), a(g + 8, k0 + i), a(g, k0 + i + 4), a(g + 8, k0 + i + 4)};
        u32 ah[4], al[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            ah[r] = to_tf32(av[r]);
            al[r] = to_tf32(av[r] - __uint_as_float(ah[r]));
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            float bv[2] = {b(k0 + i, nt * 8 + g), b(k0 + i + 4, nt * 8 + g)};
            u32 bh[2], bl[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                bh[r] = to_tf32(bv[r]);
                bl[r] = to_tf32(bv[r] - __uint_as_float(bh[r]));
            }
            mma_tf32(acc[nt], al, bh);
            mma_tf32(acc[nt], ah, bl);
            mma_tf32(acc[nt], ah, bh);
        }
    }
}

// Calls f(row, column, value) for each of the lane's accumulator values
// (rows of the 16-row tile, columns of the NT·8).
template <int NT, typename F>
__device__ __forceinline__ void warp_tile_each(const float (&acc)[NT][4], F f) {
    int lane = threadIdx.x % WARP_SIZE;
    int g = lane / 4, i = lane % 4;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int r = 0; r < 4; ++r) f(g + 8 * (r / 2), nt * 8 + 2 * i + r % 2, acc[nt][r]);
    }
}

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nt][r] = 0.0f;
    }
}

#endif  // __CUDA_ARCH__ >= 800

__device__ __forceinline__ int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Where gdn_chunk_prepare leaves a (head, chunk)'s W_v [GDN_CHUNK, dv],
// W_k [GDN_CHUNK, dk], M [GDN_CHUNK, GDN_CHUNK] and g [GDN_CHUNK] in the
// work buffer (each array over all heads and chunks, head-major).
struct GdnChunkWork {
    float* wv;
    float* wk;
    float* m;
    float* g;
};

__device__ __forceinline__ GdnChunkWork gdn_chunk_work(float* work, int value_heads, int chunks,
                                                       int h, int c, int dk, int dv) {
    i64 items = (i64)value_heads * chunks * GDN_CHUNK;
    i64 item = ((i64)h * chunks + c) * GDN_CHUNK;
    GdnChunkWork w;
    w.wv = work + item * dv;
    w.wk = work + items * dv + item * dk;
    w.m = work + items * (dv + dk) + item * GDN_CHUNK;
    w.g = work + items * (dv + dk + GDN_CHUNK) + item;
    return w;
}

// Grid (value_heads, chunks), GDN_CHUNK_THREADS threads; dynamic shared
// memory: K and Q rows (strides round_up(dk, 32) + 4 and
// round_up(max(dk, dv), 32) + 4, ≡ 4 mod 32 for the A fragments), L and T
// (stride GDN_TRI_LD), g and β. compile.rs's caller sizes it the same way.
extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS)
    gdn_chunk_prepare(const float* mixed, const float* b, const float* a, const float* a_log,
                      const float* dt_bias, float* work, int n, int channels, int key_heads,
                      int value_heads, int dk, int dv) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    extern __shared__ float shared[];
    int h = blockIdx.x, c = blockIdx.y, chunks = gridDim.y;
    int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    int t0 = c * GDN_CHUNK;
    int len = min(GDN_CHUNK, n - t0);
    int key_dim = key_heads * dk;
    int key = (h / (value_heads / key_heads)) * dk;
    int dk8 = round_up(dk, 8), dv8 = round_up(dv, 8);
    int ldk = round_up(dk, 32) + 4;
    int ldx = round_up(max(dk, dv), 32) + 4;
    float* ks = shared;                        // K, then β Γ K
    float* xs = ks + GDN_CHUNK * ldk;          // Q, then β V
    float* ls = xs + GDN_CHUNK * ldx;          // L
    float* ts = ls + GDN_CHUNK * GDN_TRI_LD;   // T = (I + L)⁻¹
    float* gs = ts + GDN_CHUNK * GDN_TRI_LD;   // g
    float* betas = gs + GDN_CHUNK;             // β
    GdnChunkWork out = gdn_chunk_work(work, value_heads, chunks, h, c, dk, dv);

    for (int idx = tid; idx < GDN_CHUNK * dk8; idx += GDN_CHUNK_THREADS) {
        int t = idx / dk8, i = idx % dk8;
        bool real = t < len && i < dk;
        const float* row = mixed + (i64)(t0 + t) * channels;
        ks[t * ldk + i] = real ? row[key_dim + key + i] : 0.0f;
        xs[t * ldx + i] = real ? row[key + i] : 0.0f;
    }
    if (warp == 0) {
        // Log decays and β of the lane's two tokens, then g as an
        // inclusive scan over the chunk.
        float rate = -expf(a_log[h]), bias = dt_bias[h];
        float decay[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int t = lane + half * WARP_SIZE;
            bool real = t < len;
            i64 at = (i64)(t0 + t) * value_heads + h;
            decay[half] = real ? rate * softplus(a[at] + bias) : 0.0f;
            betas[t] = real ? sigmoid(b[at]) : 0.0f;
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            for (int offset = 1; offset < WARP_SIZE; offset <<= 1) {
                float up = __shfl_up_sync(FULL_MASK, decay[half], offset);
                if (lane >= offset) decay[half] += up;
            }
        }
        decay[1] += __shfl_sync(FULL_MASK, decay[0], WARP_SIZE - 1);
        gs[lane] = decay[0];
        gs[lane + WARP_SIZE] = decay[1];
        out.g[lane] = decay[0];
        out.g[lane + WARP_SIZE] = decay[1];
    }
    __syncthreads();

    // K Kᵀ into L and Q Kᵀ into M, masked and decayed: 4 row tiles × 8
    // column tiles, a warp takes one row tile and four column tiles.
    {
        int rt = warp % 4, ct = (warp / 4) * 4;
        float kk[4][4], qk[4][4];
        zero(kk);
        zero(qk);
        auto key_t = [&](int k, int s) { return ks[(ct * 8 + s) * ldk + k]; };
        warp_product(kk, dk8, [&](int r, int k) { return ks[(rt * 16 + r) * ldk + k]; }, key_t);
        warp_product(qk, dk8, [&](int r, int k) { return xs[(rt * 16 + r) * ldx + k]; }, key_t);
        warp_tile_each(kk, [&](int r, int col, float v) {
            int t = rt * 16 + r, s = ct * 8 + col;
            ls[t * GDN_TRI_LD + s] = s < t ? betas[t] * expf(gs[t] - gs[s]) * v : 0.0f;
        });
        warp_tile_each(qk, [&](int r, int col, float v) {
            int t = rt * 16 + r, s = ct * 8 + col;
            out.m[t * GDN_CHUNK + s] = s <= t ? expf(gs[t] - gs[s]) * v : 0.0f;
        });
    }
    __syncthreads();

    // The right-hand sides: β Γ K in place of K, β V in place of Q.
    for (int idx = tid; idx < GDN_CHUNK * dk8; idx += GDN_CHUNK_THREADS) {
        int t = idx / dk8, i = idx % dk8;
        ks[t * ldk + i] *= betas[t] * expf(gs[t]);
    }
    for (int idx = tid; idx < GDN_CHUNK * dv8; idx += GDN_CHUNK_THREADS) {
        int t = idx / dv8, j = idx % dv8;
        xs[t * ldx + j] = t < len && j < dv
                              ? betas[t] * mixed[(i64)(t0 + t) * channels + 2 * key_dim + h * dv + j]
                              : 0.0f;
    }
    // T = (I + L)⁻¹ by forward substitution, four lanes per column j:
    // T_tj = -Σ_{j ≤ s < t} L_ts T_sj, each lane summing every fourth s.
    {
        int j = tid / 4, part = tid % 4;
        for (int t = 0; t < GDN_CHUNK; ++t) {
            float sum = 0.0f;
            for (int s = j + part; s < t; s += 4) sum += ls[t * GDN_TRI_LD + s] * ts[s * GDN_TRI_LD + j];
            sum += __shfl_xor_sync(FULL_MASK, sum, 1);
            sum += __shfl_xor_sync(FULL_MASK, sum, 2);
            if (part == 0) ts[t * GDN_TRI_LD + j] = t < j ? 0.0f : t == j ? 1.0f : -sum;
            __syncwarp();
        }
    }
    __syncthreads();

    // W_v = T · β V and W_k = T · β Γ K: units of one row tile × four
    // column tiles over the warps; T is lower triangular, so a row tile
    // needs only k < its end.
    int units_v = 4 * ((dv8 + 31) / 32), units = units_v + 4 * ((dk8 + 31) / 32);
    for (int unit = warp; unit < units; unit += GDN_CHUNK_THREADS / WARP_SIZE) {
        bool is_v = unit < units_v;
        int u = is_v ? unit : unit - units_v;
        int rt = u % 4, ct = (u / 4) * 4;
        int width = is_v ? dv : dk;
        const float* rhs = is_v ? xs : ks;
        int ld = is_v ? ldx : ldk;
        int cols = is_v ? dv8 : dk8;
        float* dst = is_v ? out.wv : out.wk;
        float acc[4][4];
        zero(acc);
        warp_product(
            acc, (rt + 1) * 16, [&](int r, int k) { return ts[(rt * 16 + r) * GDN_TRI_LD + k]; },
            [&](int k, int col) {
                int j = ct * 8 + col;
                return j < cols ? rhs[k * ld + j] : 0.0f;
            });
        warp_tile_each(acc, [&](int r, int col, float v) {
            int t = rt * 16 + r, j = ct * 8 + col;
            if (j < width) dst[(i64)t * width + j] = v;
        });
    }
#endif
}

// Grid (value_heads, ceil(dv / GDN_STATE_COLS)), GDN_CHUNK_THREADS threads;
// dynamic shared memory: the state tile [round_up(dk, 16), GDN_TILE_LD],
// U [GDN_CHUNK, GDN_TILE_LD], g and the state-update factors.
extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS)
    gdn_chunk_state(const float* mixed, float* work, float* state, float* out, int n,
                    int channels, int key_heads, int value_heads, int dk, int dv) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    extern __shared__ float shared[];
    int h = blockIdx.x, col0 = blockIdx.y * GDN_STATE_COLS;
    int chunks = (n + GDN_CHUNK - 1) / GDN_CHUNK;
    int tid = threadIdx.x, warp = tid / WARP_SIZE;
    int key_dim = key_heads * dk;
    int key = (h / (value_heads / key_heads)) * dk;
    int dk8 = round_up(dk, 8), dk16 = round_up(dk, 16);
    float* ss = shared;                      // S[:, col0..]
    float* us = ss + dk16 * GDN_TILE_LD;     // U
    float* gs = us + GDN_CHUNK * GDN_TILE_LD;
    float* fac = gs + GDN_CHUNK;             // exp(g_last - g_t)
    float* s_global = state + (i64)h * dk * dv + col0;
    int width = min(GDN_STATE_COLS, dv - col0);

    for (int idx = tid; idx < dk16 * GDN_STATE_COLS; idx += GDN_CHUNK_THREADS) {
        int i = idx / GDN_STATE_COLS, j = idx % GDN_STATE_COLS;
        ss[i * GDN_TILE_LD + j] = i < dk && j < width ? s_global[(i64)i * dv + j] : 0.0f;
    }
    for (int c = 0; c < chunks; ++c) {
        int t0 = c * GDN_CHUNK;
        int len = min(GDN_CHUNK, n - t0);
        GdnChunkWork w = gdn_chunk_work(work, value_heads, chunks, h, c, dk, dv);
        if (tid < GDN_CHUNK) gs[tid] = w.g[tid];
        __syncthreads();
        float g_last = gs[GDN_CHUNK - 1];
        if (tid < GDN_CHUNK) fac[tid] = expf(g_last - gs[tid]);
        const float* rows = mixed + (i64)t0 * channels;
        // 4 row tiles × 4 column tiles: a warp takes a row tile and two
        // column tiles.
        int rt = warp / 2, ct = (warp % 2) * 2;
        auto state_b = [&](int k, int col) { return ss[k * GDN_TILE_LD + ct * 8 + col]; };
        {
            // U = W_v - W_k S.
            float acc[2][4];
            zero(acc);
            warp_product(
                acc, dk8,
                [&](int r, int k) { return k < dk ? w.wk[(rt * 16 + r) * dk + k] : 0.0f; },
                state_b);
            warp_tile_each(acc, [&](int r, int col, float v) {
                int t = rt * 16 + r, j = ct * 8 + col;
                us[t * GDN_TILE_LD + j] = (j < width ? w.wv[t * dv + col0 + j] : 0.0f) - v;
            });
        }
        __syncthreads();
        {
            // O = diag(Γ) Q S + M U.
            float acc[2][4];
            zero(acc);
            warp_product(
                acc, dk8,
                [&](int r, int k) {
                    int t = rt * 16 + r;
                    return t < len && k < dk ? rows[(i64)t * channels + key + k] : 0.0f;
                },
                state_b);
            int lane = tid % WARP_SIZE;
            float decay_lo = expf(gs[rt * 16 + lane / 4]), decay_hi = expf(gs[rt * 16 + lane / 4 + 8]);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                acc[nt][0] *= decay_lo;
                acc[nt][1] *= decay_lo;
                acc[nt][2] *= decay_hi;
                acc[nt][3] *= decay_hi;
            }
            warp_product(
                acc, (rt + 1) * 16,
                [&](int r, int k) { return w.m[(rt * 16 + r) * GDN_CHUNK + k]; },
                [&](int k, int col) { return us[k * GDN_TILE_LD + ct * 8 + col]; });
            warp_tile_each(acc, [&](int r, int col, float v) {
                int t = rt * 16 + r, j = ct * 8 + col;
                if (t < len && j < width) out[(i64)(t0 + t) * value_heads * dv + h * dv + col0 + j] = v;
            });
        }
        __syncthreads();
        // S = Γ_last S + Kᵀ diag(exp(g_last - g)) U: row tiles of S over
        // the warps, four column tiles each.
        float keep = expf(g_last);
        for (int st = warp; st < dk16 / 16; st += GDN_CHUNK_THREADS / WARP_SIZE) {
            float acc[4][4];
            zero(acc);
            warp_product(
                acc, GDN_CHUNK,
                [&](int r, int k) {
                    int i = st * 16 + r;
                    return k < len && i < dk ? rows[(i64)k * channels + key_dim + key + i] : 0.0f;
                },
                [&](int k, int col) { return us[k * GDN_TILE_LD + col] * fac[k]; });
            warp_tile_each(acc, [&](int r, int col, float v) {
                float* s = &ss[(st * 16 + r) * GDN_TILE_LD + col];
                *s = keep * *s + v;
            });
        }
        __syncthreads();
    }
    for (int idx = tid; idx < dk * GDN_STATE_COLS; idx += GDN_CHUNK_THREADS) {
        int i = idx / GDN_STATE_COLS, j = idx % GDN_STATE_COLS;
        if (j < width) s_global[(i64)i * dv + j] = ss[i * GDN_TILE_LD + j];
    }
#endif
}
