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
// gdn_chunk_prepare computes them for every (head, chunk) in parallel.
// gdn_chunk_state then walks the chunks in order, a block per (head,
// GDN_STATE_COLS columns of S), the columns being independent: it keeps
// each chunk's S0 and U. gdn_chunk_output computes O from them, again for
// every (head, chunk, columns) in parallel.
//
// Rows of q, k, v, W and S are moved as float4 and fetched into registers
// ahead of use: the host takes this path only when dk and dv are multiples
// of 4 (so are then every row start) and at most GDN_MAX_DIM.
//
// Products run as three TF32 MMAs per step (hi·hi + hi·lo + lo·hi of the
// operands split as x = hi + lo, both TF32): about f32 accuracy, which the
// tests hold these kernels to. Rows past the last token of a partial chunk
// are zeros (k = q = v = 0, β = 0, log decay 0), which leaves U, O and S
// as they would be without them.

// GDN_CHUNK tokens per chunk, GDN_CHUNK_THREADS threads per block, head
// dimensions up to GDN_MAX_DIM, GDN_STATE_COLS state columns per block.
// Launch geometry comes from the host: compile.rs passes the constants of
// geometry.rs as -D options, so a launch and its kernel cannot disagree.
#if !defined(GDN_CHUNK) || !defined(GDN_CHUNK_THREADS) || !defined(GDN_MAX_DIM) || \
    !defined(GDN_STATE_COLS)
#error "gdn_chunked.cu: launch geometry missing (compile.rs passes geometry.rs as -D options)"
#endif

// Row stride of U and of the state tile: ≡ 8 (mod 32) words, so the B
// fragment's loads (k = lane % 4 rows apart, n = lane / 4 columns) hit 32
// different banks.
#define GDN_TILE_LD (GDN_STATE_COLS + 8)
#define GDN_TRI_LD (GDN_CHUNK + 4)

#if __CUDA_ARCH__ >= 800

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
        for (int r = 0; r < 4; ++r) split_tf32(av[r], ah[r], al[r]);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            u32 bh[2], bl[2];
            split_tf32(b(k0 + i, nt * 8 + g), bh[0], bl[0]);
            split_tf32(b(k0 + i + 4, nt * 8 + g), bh[1], bl[1]);
            mma_3xtf32(acc[nt], ah, al, bh, bl);
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

// Where the chunked kernels keep a (head, chunk)'s W_v (then U)
// [GDN_CHUNK, dv], W_k [GDN_CHUNK, dk], M [GDN_CHUNK, GDN_CHUNK], g
// [GDN_CHUNK] and S0 [dk, dv] in the work buffer (each array over all heads
// and chunks, head-major). The host sizes the buffer the same way.
struct GdnChunkWork {
    float* wv;
    float* wk;
    float* m;
    float* g;
    float* s0;
};

__device__ __forceinline__ GdnChunkWork gdn_chunk_work(float* work, int value_heads, int chunks,
                                                       int h, int c, int dk, int dv) {
    i64 pieces = (i64)value_heads * chunks;
    i64 piece = (i64)h * chunks + c;
    i64 rows = pieces * GDN_CHUNK, row = piece * GDN_CHUNK;
    GdnChunkWork w;
    w.wv = work + row * dv;
    w.wk = work + rows * dv + row * dk;
    w.m = work + rows * (dv + dk) + row * GDN_CHUNK;
    w.g = work + rows * (dv + dk + GDN_CHUNK) + row;
    w.s0 = work + rows * (dv + dk + GDN_CHUNK + 1) + piece * dk * dv;
    return w;
}

// Float4s per thread of a [GDN_CHUNK, ≤ GDN_MAX_DIM] block, of a state
// tile [≤ GDN_MAX_DIM, GDN_STATE_COLS], of a U tile [GDN_CHUNK,
// GDN_STATE_COLS] and of M.
#define GDN_FETCH (GDN_CHUNK * GDN_MAX_DIM / 4 / GDN_CHUNK_THREADS)
#define GDN_FETCH_STATE (GDN_MAX_DIM * GDN_STATE_COLS / 4 / GDN_CHUNK_THREADS)
#define GDN_FETCH_U (GDN_CHUNK * GDN_STATE_COLS / 4 / GDN_CHUNK_THREADS)
#define GDN_FETCH_M (GDN_CHUNK * GDN_CHUNK / 4 / GDN_CHUNK_THREADS)

// Fetches rows [0, valid) of a block of `cols` columns whose row t starts
// at src + t · stride (cols, stride and src 4-aligned) into registers,
// zeros for later rows; every load is issued before any is used.
template <int N>
__device__ __forceinline__ void gdn_fetch(float4 (&v)[N], const float* src, i64 stride, int valid,
                                          int cols) {
    int per_row = cols / 4;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        int idx = threadIdx.x + k * GDN_CHUNK_THREADS;
        int t = idx / per_row, j = (idx % per_row) * 4;
        v[k] = t < valid ? *(const float4*)(src + t * stride + j) : make_float4(0, 0, 0, 0);
    }
}

// Hands each fetched float4 of rows [0, rows) to f(t, j, value) (row t,
// columns j..j+3).
template <int N, typename F>
__device__ __forceinline__ void gdn_each_fetched(const float4 (&v)[N], int rows, int cols, F f) {
    int per_row = cols / 4;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        int idx = threadIdx.x + k * GDN_CHUNK_THREADS;
        if (idx < rows * per_row) f(idx / per_row, (idx % per_row) * 4, v[k]);
    }
}

// Every shared-memory row of these kernels starts 16-byte aligned (strides
// and buffer sizes are multiples of 4 floats), as does every column j of a
// fetch.
__device__ __forceinline__ void store4(float* p, float4 v) { *(float4*)p = v; }

// Zeros the padding of a [rows, cols] block of shared memory (stride ld)
// whose first [rows_set, cols_set] corner the fetches write: columns
// [cols_set, cols) of the first rows, then whole rows [rows_set, rows).
__device__ __forceinline__ void gdn_zero_padding(float* dst, int ld, int rows, int cols,
                                                 int rows_set, int cols_set) {
    int extra = cols - cols_set;
    for (int idx = threadIdx.x; idx < rows_set * extra; idx += GDN_CHUNK_THREADS) {
        dst[(idx / extra) * ld + cols_set + idx % extra] = 0.0f;
    }
    for (int idx = threadIdx.x; idx < (rows - rows_set) * cols; idx += GDN_CHUNK_THREADS) {
        dst[(rows_set + idx / cols) * ld + idx % cols] = 0.0f;
    }
}

// Grid (value_heads, chunks), GDN_CHUNK_THREADS threads; dynamic shared
// memory: K and Q rows (strides round_up(dk, 32) + 4 and
// round_up(max(dk, dv), 32) + 4, ≡ 4 mod 32 for the A fragments), L and
// the inverses of its diagonal blocks (stride GDN_TRI_LD), g and β. mod.rs
// sizes it the same way.
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
    float* ts = ls + GDN_CHUNK * GDN_TRI_LD;   // (I + L_bb)⁻¹ of the diagonal blocks
    float* gs = ts + GDN_CHUNK * GDN_TRI_LD;   // g
    float* betas = gs + GDN_CHUNK;             // β
    GdnChunkWork out = gdn_chunk_work(work, value_heads, chunks, h, c, dk, dv);
    const float* rows = mixed + (i64)t0 * channels;

    {
        float4 k4[GDN_FETCH], q4[GDN_FETCH];
        gdn_fetch(k4, rows + key_dim + key, channels, len, dk);
        gdn_fetch(q4, rows + key, channels, len, dk);
        gdn_each_fetched(k4, GDN_CHUNK, dk, [&](int t, int j, float4 v) { store4(&ks[t * ldk + j], v); });
        gdn_each_fetched(q4, GDN_CHUNK, dk, [&](int t, int j, float4 v) { store4(&xs[t * ldx + j], v); });
    }
    gdn_zero_padding(ks, ldk, GDN_CHUNK, dk8, GDN_CHUNK, dk);
    gdn_zero_padding(xs, ldx, GDN_CHUNK, dk8, GDN_CHUNK, dk);
    // V stays in registers until Q's place is free.
    float4 v4[GDN_FETCH];
    gdn_fetch(v4, rows + 2 * key_dim + h * dv, channels, len, dv);
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
    gdn_each_fetched(v4, GDN_CHUNK, dv, [&](int t, int j, float4 v) {
        float beta = betas[t];
        store4(&xs[t * ldx + j], make_float4(beta * v.x, beta * v.y, beta * v.z, beta * v.w));
    });
    gdn_zero_padding(xs, ldx, GDN_CHUNK, dv8, GDN_CHUNK, dv);
    // The inverses of L's four 16 × 16 diagonal blocks, D_b = (I + L_bb)⁻¹:
    // a lane of warps 0-1 per column of a block, held in registers:
    // x_t = [t = j] - Σ_{s<t} L_ts x_s.
    if (warp < 2) {
        int blk = (tid / 16) * 16, j = tid % 16;
        float x[16];
#pragma unroll
        for (int t = 0; t < 16; ++t) {
            float acc = t == j ? 1.0f : 0.0f;
#pragma unroll
            for (int s = 0; s < t; ++s) acc -= ls[(blk + t) * GDN_TRI_LD + blk + s] * x[s];
            x[t] = acc;
            ts[(blk + t) * GDN_TRI_LD + blk + j] = acc;
        }
    }
    __syncthreads();

    // W = (I + L)⁻¹ X for X = [β V | β Γ K], by block rows:
    // W_b = D_b (X_b - Σ_{c<b} L_bc W_c), W_b replacing X_b. A warp owns
    // 32 columns of X throughout, so only its own rows of W feed it and
    // no block barrier is needed.
    int units_v = (dv8 + 31) / 32, units = units_v + (dk8 + 31) / 32;
    for (int unit = warp; unit < units; unit += GDN_CHUNK_THREADS / WARP_SIZE) {
        bool is_v = unit < units_v;
        int c0 = (is_v ? unit : unit - units_v) * 32;
        int width = is_v ? dv : dk;
        int cols = is_v ? dv8 : dk8;
        float* rhs = is_v ? xs : ks;
        int ld = is_v ? ldx : ldk;
        float* dst = is_v ? out.wv : out.wk;
        auto rhs_b = [&](int k, int col) {
            int j = c0 + col;
            return j < cols ? rhs[k * ld + j] : 0.0f;
        };
        for (int blk = 0; blk < 4; ++blk) {
            float acc[4][4];
            zero(acc);
            warp_product(
                acc, blk * 16,
                [&](int r, int k) { return ls[(blk * 16 + r) * GDN_TRI_LD + k]; }, rhs_b);
            // Y = X_b - acc, into X_b's rows (only this warp reads them).
            warp_tile_each(acc, [&](int r, int col, float v) {
                int j = c0 + col;
                if (j < cols) rhs[(blk * 16 + r) * ld + j] -= v;
            });
            __syncwarp();
            zero(acc);
            warp_product(
                acc, 16, [&](int r, int k) { return ts[(blk * 16 + r) * GDN_TRI_LD + blk * 16 + k]; },
                [&](int k, int col) { return rhs_b(blk * 16 + k, col); });
            __syncwarp();
            warp_tile_each(acc, [&](int r, int col, float v) {
                int t = blk * 16 + r, j = c0 + col;
                if (j < cols) rhs[t * ld + j] = v;
                if (j < width) dst[(i64)t * width + j] = v;
            });
            __syncwarp();
        }
    }
#endif
}

// The inputs of one chunk of gdn_chunk_state, fetched a chunk ahead.
struct GdnStateInputs {
    float4 wk[GDN_FETCH];   // W_k
    float4 k[GDN_FETCH];    // K
    float4 wv[GDN_FETCH_U]; // the block's columns of W_v
    float g;                // g of token threadIdx.x (< GDN_CHUNK)
    float g_last;
};

__device__ __forceinline__ void gdn_state_fetch(GdnStateInputs& in, const float* mixed,
                                                float* work, int n, int channels, int key_heads,
                                                int value_heads, int dk, int dv, int h, int c,
                                                int col0, int width) {
    int chunks = (n + GDN_CHUNK - 1) / GDN_CHUNK;
    int t0 = c * GDN_CHUNK;
    int key = (h / (value_heads / key_heads)) * dk;
    GdnChunkWork w = gdn_chunk_work(work, value_heads, chunks, h, c, dk, dv);
    gdn_fetch(in.wk, w.wk, dk, GDN_CHUNK, dk);
    gdn_fetch(in.k, mixed + (i64)t0 * channels + key_heads * dk + key, channels,
              min(GDN_CHUNK, n - t0), dk);
    gdn_fetch(in.wv, w.wv + col0, dv, GDN_CHUNK, width);
    in.g = w.g[threadIdx.x % GDN_CHUNK];
    in.g_last = w.g[GDN_CHUNK - 1];
}

// The chunks in order for GDN_STATE_COLS columns of a head's state:
// U = W_v - W_k S0 (kept in place of W_v), S0 kept for gdn_chunk_output,
// S = Γ_last S0 + Kᵀ diag(exp(g_last - g)) U. The next chunk's inputs are
// fetched while this one computes. Grid (value_heads,
// ceil(dv / GDN_STATE_COLS)), GDN_CHUNK_THREADS threads; dynamic shared
// memory: the state tile [round_up(dk, 16), GDN_TILE_LD], U [GDN_CHUNK,
// GDN_TILE_LD], W_k [GDN_CHUNK, round_up(dk, 32) + 4], Kᵀ
// [round_up(dk, 16), GDN_TRI_LD], and the update factors.
extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS)
    gdn_chunk_state(const float* mixed, float* work, float* state, int n, int channels,
                    int key_heads, int value_heads, int dk, int dv) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    extern __shared__ float shared[];
    int h = blockIdx.x, col0 = blockIdx.y * GDN_STATE_COLS;
    int chunks = (n + GDN_CHUNK - 1) / GDN_CHUNK;
    int tid = threadIdx.x, warp = tid / WARP_SIZE;
    int dk8 = round_up(dk, 8), dk16 = round_up(dk, 16);
    int ldk = round_up(dk, 32) + 4;
    float* ss = shared;                      // S[:, col0..]
    float* us = ss + dk16 * GDN_TILE_LD;     // W_v, then U
    float* wks = us + GDN_CHUNK * GDN_TILE_LD;
    float* kts = wks + GDN_CHUNK * ldk;      // Kᵀ
    float* fac = kts + dk16 * GDN_TRI_LD;    // exp(g_last - g_t)
    float* s_global = state + (i64)h * dk * dv + col0;
    int width = min(GDN_STATE_COLS, dv - col0);

    float4 s4[GDN_FETCH_STATE];
    gdn_fetch(s4, s_global, dv, dk, width);
    GdnStateInputs in;
    gdn_state_fetch(in, mixed, work, n, channels, key_heads, value_heads, dk, dv, h, 0, col0,
                    width);
    // What no fetch writes stays zero: padding rows and columns.
    gdn_zero_padding(ss, GDN_TILE_LD, dk16, GDN_STATE_COLS, dk, width);
    gdn_zero_padding(us, GDN_TILE_LD, GDN_CHUNK, GDN_STATE_COLS, GDN_CHUNK, width);
    gdn_zero_padding(wks, ldk, GDN_CHUNK, dk8, GDN_CHUNK, dk);
    gdn_zero_padding(kts, GDN_TRI_LD, dk16, GDN_CHUNK, dk, GDN_CHUNK);
    gdn_each_fetched(s4, dk, width, [&](int i, int j, float4 v) { store4(&ss[i * GDN_TILE_LD + j], v); });
    for (int c = 0; c < chunks; ++c) {
        GdnChunkWork w = gdn_chunk_work(work, value_heads, chunks, h, c, dk, dv);
        gdn_each_fetched(in.wk, GDN_CHUNK, dk,
                         [&](int t, int j, float4 v) { store4(&wks[t * ldk + j], v); });
        gdn_each_fetched(in.k, GDN_CHUNK, dk, [&](int t, int j, float4 v) {
            kts[j * GDN_TRI_LD + t] = v.x;
            kts[(j + 1) * GDN_TRI_LD + t] = v.y;
            kts[(j + 2) * GDN_TRI_LD + t] = v.z;
            kts[(j + 3) * GDN_TRI_LD + t] = v.w;
        });
        gdn_each_fetched(in.wv, GDN_CHUNK, width,
                         [&](int t, int j, float4 v) { store4(&us[t * GDN_TILE_LD + j], v); });
        float g_last = in.g_last;
        if (tid < GDN_CHUNK) fac[tid] = expf(g_last - in.g);
        __syncthreads();
        if (c + 1 < chunks) {
            gdn_state_fetch(in, mixed, work, n, channels, key_heads, value_heads, dk, dv, h,
                            c + 1, col0, width);
        }
        // S0 for gdn_chunk_output.
        int per_row = width / 4;
#pragma unroll
        for (int k = 0; k < GDN_FETCH_STATE; ++k) {
            int idx = tid + k * GDN_CHUNK_THREADS;
            int i = idx / per_row, j = (idx % per_row) * 4;
            if (i < dk) {
                const float* src = &ss[i * GDN_TILE_LD + j];
                *(float4*)(w.s0 + (i64)i * dv + col0 + j) = make_float4(src[0], src[1], src[2], src[3]);
            }
        }
        {
            // U = W_v - W_k S: 4 row tiles × 4 column tiles, a warp takes
            // a row tile and two column tiles.
            int rt = warp / 2, ct = (warp % 2) * 2;
            float acc[2][4];
            zero(acc);
            warp_product(
                acc, dk8, [&](int r, int k) { return wks[(rt * 16 + r) * ldk + k]; },
                [&](int k, int col) { return ss[k * GDN_TILE_LD + ct * 8 + col]; });
            warp_tile_each(acc, [&](int r, int col, float v) {
                int t = rt * 16 + r, j = ct * 8 + col;
                float u = us[t * GDN_TILE_LD + j] - v;
                us[t * GDN_TILE_LD + j] = u;
                if (j < width) w.wv[t * dv + col0 + j] = u;
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
                acc, GDN_CHUNK, [&](int r, int k) { return kts[(st * 16 + r) * GDN_TRI_LD + k]; },
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

// O = diag(Γ) Q S0 + M U for GDN_STATE_COLS columns of one (head, chunk).
// Grid (value_heads, chunks, ceil(dv / GDN_STATE_COLS)), GDN_CHUNK_THREADS
// threads; dynamic shared memory: Q [GDN_CHUNK, round_up(dk, 32) + 4], M
// [GDN_CHUNK, GDN_TRI_LD], S0 [round_up(dk, 8), GDN_TILE_LD], U
// [GDN_CHUNK, GDN_TILE_LD], g.
extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS)
    gdn_chunk_output(const float* mixed, float* work, float* out, int n, int channels,
                     int key_heads, int value_heads, int dk, int dv) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    extern __shared__ float shared[];
    int h = blockIdx.x, c = blockIdx.y, chunks = gridDim.y, col0 = blockIdx.z * GDN_STATE_COLS;
    int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    int t0 = c * GDN_CHUNK;
    int len = min(GDN_CHUNK, n - t0);
    int key = (h / (value_heads / key_heads)) * dk;
    int dk8 = round_up(dk, 8);
    int ldk = round_up(dk, 32) + 4;
    int width = min(GDN_STATE_COLS, dv - col0);
    float* qs = shared;
    float* ms = qs + GDN_CHUNK * ldk;
    float* ss = ms + GDN_CHUNK * GDN_TRI_LD;
    float* us = ss + dk8 * GDN_TILE_LD;
    float* gs = us + GDN_CHUNK * GDN_TILE_LD;
    GdnChunkWork w = gdn_chunk_work(work, value_heads, chunks, h, c, dk, dv);
    float4 q4[GDN_FETCH], m4[GDN_FETCH_M], s4[GDN_FETCH_STATE], u4[GDN_FETCH_U];
    gdn_fetch(q4, mixed + (i64)t0 * channels + key, channels, len, dk);
    gdn_fetch(m4, w.m, GDN_CHUNK, GDN_CHUNK, GDN_CHUNK);
    gdn_fetch(s4, w.s0 + col0, dv, dk, width);
    gdn_fetch(u4, w.wv + col0, dv, GDN_CHUNK, width);
    if (tid < GDN_CHUNK) gs[tid] = w.g[tid];
    gdn_zero_padding(qs, ldk, GDN_CHUNK, dk8, GDN_CHUNK, dk);
    gdn_zero_padding(ss, GDN_TILE_LD, dk8, GDN_STATE_COLS, dk, width);
    gdn_zero_padding(us, GDN_TILE_LD, GDN_CHUNK, GDN_STATE_COLS, GDN_CHUNK, width);
    gdn_each_fetched(q4, GDN_CHUNK, dk, [&](int t, int j, float4 v) { store4(&qs[t * ldk + j], v); });
    gdn_each_fetched(m4, GDN_CHUNK, GDN_CHUNK,
                     [&](int t, int s, float4 v) { store4(&ms[t * GDN_TRI_LD + s], v); });
    gdn_each_fetched(s4, dk, width, [&](int i, int j, float4 v) { store4(&ss[i * GDN_TILE_LD + j], v); });
    gdn_each_fetched(u4, GDN_CHUNK, width,
                     [&](int t, int j, float4 v) { store4(&us[t * GDN_TILE_LD + j], v); });
    __syncthreads();
    // 4 row tiles × 4 column tiles: a warp takes a row tile and two
    // column tiles.
    int rt = warp / 2, ct = (warp % 2) * 2;
    float acc[2][4];
    zero(acc);
    warp_product(
        acc, dk8, [&](int r, int k) { return qs[(rt * 16 + r) * ldk + k]; },
        [&](int k, int col) { return ss[k * GDN_TILE_LD + ct * 8 + col]; });
    float decay_lo = expf(gs[rt * 16 + lane / 4]), decay_hi = expf(gs[rt * 16 + lane / 4 + 8]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
        acc[nt][0] *= decay_lo;
        acc[nt][1] *= decay_lo;
        acc[nt][2] *= decay_hi;
        acc[nt][3] *= decay_hi;
    }
    warp_product(
        acc, (rt + 1) * 16, [&](int r, int k) { return ms[(rt * 16 + r) * GDN_TRI_LD + k]; },
        [&](int k, int col) { return us[k * GDN_TILE_LD + ct * 8 + col]; });
    warp_tile_each(acc, [&](int r, int col, float v) {
        int t = rt * 16 + r, j = ct * 8 + col;
        if (t < len && j < width) out[(i64)(t0 + t) * value_heads * dv + h * dv + col0 + j] = v;
    });
#endif
}
