// Products of a few tokens with q4 matrices on the tensor cores: a decode
// step of several sequences, a check of drafted tokens.
//
// gemm.cu's tiles are 64 tokens wide and stage the weights through shared
// memory, so a product of 16 tokens fills a quarter of each tile and
// waits on its barriers: 20 µs for a 4096 × 2048 matrix whose 4.7 MB the
// device reads in under 2. Here, as in moe_few.cu, a warp takes a 16-row
// tile and its weights go from the loads straight into mma.sync m16n8k16
// as exact centred codes (matvec_tc.cu's scheme), with no barrier between
// them. The tokens are the MMAs' B operand (hi = bf16(x), lo = bf16(x -
// hi), four tokens' (hi, lo) to the eight columns of an MMA), and Σ x per
// 64-column group serves the affine map, Σ w·x = scale · Σ (q - 8)·x +
// (bias + 8·scale) · Σ x, as in gemm.cu.
//
// The grid is (blocks of FEW_LINEAR_WARPS row tiles over the launch's
// matrices, passes of up to FEW_LINEAR_TOKENS tokens, splits of the
// columns). A matrix of a layer has too few tiles to keep the device's
// loads in flight, so the columns are split over blocks and
// sum_split_parts adds the parts in order. A block stages its split's B
// registers in shared memory while its warps' first weights are on their
// way (read from global memory instead, every MMA waited on L2 in turn:
// 36 µs a launch). Each output is the same sequence of operations for a
// launch of the same shape whatever the other tokens, so repeated runs
// are identical.
//
// sm_80+ only (bf16 mma); the host takes gemm.rs or linear.cu elsewhere.

#if !defined(FEW_LINEAR_WARPS) || !defined(FEW_LINEAR_TOKENS)
#error "linear_few.cu: launch geometry missing (compile.rs passes geometry.rs as -D options)"
#endif

// Groups (of 64 columns) whose weights a warp loads before using any.
#ifndef FEW_LINEAR_BATCH
#define FEW_LINEAR_BATCH 2
#endif
#if FEW_LINEAR_BATCH % 2
#error "linear_few.cu: the weights are loaded two groups at a time (FEW_LINEAR_BATCH even)"
#endif
// Blocks a multiprocessor holds at once, which bounds the registers.
#ifndef FEW_LINEAR_MIN_BLOCKS
#define FEW_LINEAR_MIN_BLOCKS 3
#endif

// uint2 of shared memory a token's staged B registers take in a block of
// linear_few_q4_* whose split has `count` groups: 32 a group, and 64 bytes
// of padding so that the four tokens an MMA reads fall on both halves of
// the banks. The block's dynamic shared memory: FEW_LINEAR_TOKENS such
// rows, then Σ x of each group of the split for FEW_LINEAR_TOKENS tokens
// (linear_few.rs sizes it the same way). Tokens past the call's are
// zeros.
__device__ __forceinline__ int few_linear_stride(int count) { return count * 32 + 8; }

#if __CUDA_ARCH__ >= 800

// Loads groups [g0, min(g0 + FEW_LINEAR_BATCH, end)) of the tile whose
// lane rows are `row_g` and `row_g8`, two at a time (load_tc_pair).
__device__ __forceinline__ void load_few_linear_batch(TcPair (&w)[FEW_LINEAR_BATCH / 2],
                                                      const WeightRow& row_g,
                                                      const WeightRow& row_g8, int g0, int end,
                                                      int t) {
#pragma unroll
    for (int b = 0; b < FEW_LINEAR_BATCH / 2; ++b) {
        if (g0 + 2 * b < end) w[b] = load_tc_pair(row_g, row_g8, g0 + 2 * b, end, t);
    }
}

// Stages the B registers of tokens j0.. (`tokens` of them; zeros for the
// rest of the pass's `pass_tokens`) for groups [begin, begin + count) of x ([n, cols]):
// token jj's at staged + jj · stride, ((gg · 4 + s) · 2 + half) · 4 + t
// holding the hi (half 0) or lo (half 1) parts of columns 16t + s, + 4
// (first word) and 16t + 8 + s, + 12 (second word) of group gg
// (matvec_tc.cu's k order), and Σ x at sums[gg · FEW_LINEAR_TOKENS + jj].
// A half warp takes a (token, group) in turn, one lane per (t, s), and
// adds up its Σ x by shuffles.
__device__ __forceinline__ void stage_few_linear(const float* x, int cols, int j0, int tokens,
                                                 int pass_tokens, int begin, int count,
                                                 int stride, uint2* staged, float* sums) {
    const int half_warps = blockDim.x / 16, lane16 = threadIdx.x % 16;
    const int t = lane16 / 4, s = lane16 % 4;
    for (int p = threadIdx.x / 16; p < count * pass_tokens; p += half_warps) {
        const int jj = p % pass_tokens, gg = p / pass_tokens;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (jj < tokens) {
            const float* xg = x + (i64)(j0 + jj) * cols + (begin + gg) * GROUP_SIZE + 16 * t + s;
            v[0] = xg[0];
            v[1] = xg[4];
            v[2] = xg[8];
            v[3] = xg[12];
        }
        u32 hi0, lo0, hi1, lo1;
        split_pair(v[0], v[1], hi0, lo0);
        split_pair(v[2], v[3], hi1, lo1);
        uint2* step = staged + jj * stride + (gg * 4 + s) * 8;
        step[t] = make_uint2(hi0, hi1);
        step[4 + t] = make_uint2(lo0, lo1);
        float sum = (v[0] + v[1]) + (v[2] + v[3]);
        sum += __shfl_xor_sync(FULL_MASK, sum, 8);
        sum += __shfl_xor_sync(FULL_MASK, sum, 4);
        sum += __shfl_xor_sync(FULL_MASK, sum, 2);
        sum += __shfl_xor_sync(FULL_MASK, sum, 1);
        if (lane16 == 0) sums[gg * FEW_LINEAR_TOKENS + jj] = sum;
    }
}

// acc[nt][0] / acc[nt][1] (rows g and g + 8 of the tile; token 4·nt + t
// of the pass for lane (g, t)) += the tile's products over group `gg` of
// the block's split, for the first TILES column tiles: `lane_b` is the
// lane's B registers of column tile 0 at step 0 of group 0 (tiles
// `tile_stride` apart), `sums` the staged Σ x.
template <int TILES>
__device__ __forceinline__ void mma_few_linear_group(const TcGroup& w, const uint2* lane_b,
                                                     int tile_stride, const float* sums, int gg,
                                                     int t, float (&acc)[TILES][2]) {
    float c[TILES][4] = {};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const u32 a[4] = {q4_pair(w.row_g.x >> (4 * s)), q4_pair(w.row_g8.x >> (4 * s)),
                          q4_pair(w.row_g.y >> (4 * s)), q4_pair(w.row_g8.y >> (4 * s))};
#pragma unroll
        for (int nt = 0; nt < TILES; ++nt) {
            const uint2 b = lane_b[nt * tile_stride + gg * 32 + s * 8];
            mma_bf16(c[nt], a, b.x, b.y);
        }
    }
#pragma unroll
    for (int nt = 0; nt < TILES; ++nt) {
        const float xs = sums[gg * FEW_LINEAR_TOKENS + 4 * nt + t];
        acc[nt][0] = fmaf(w.scale_g, c[nt][0] + c[nt][1], fmaf(w.offset_g, xs, acc[nt][0]));
        acc[nt][1] = fmaf(w.scale_g8, c[nt][2] + c[nt][3], fmaf(w.offset_g8, xs, acc[nt][1]));
    }
}

#endif  // __CUDA_ARCH__ >= 800

// out_j[token, r] (+)= Σ_c w_j[r, c] · x[token, c] for x [n, cols] and up
// to MAX_JOBS q4 matrices of `cols` columns (job.first_block counts blocks
// of FEW_LINEAR_WARPS 16-row tiles), TILES column tiles of four tokens a
// pass (tokens past the call's are zeros). Grid: (those blocks,
// ceil(n / (4 · TILES)), splits); split z takes groups [z · split_groups,
// + split_groups), whose B registers for the pass's tokens the block
// stages in shared memory while its warps' first weights are on their
// way. With `partial` each split writes its sums there, split-major over
// the launch's outputs, for sum_split_parts; without (one split), the
// outputs directly, added to them with `accumulate`. Codes start 8-byte
// aligned (the host checks).
template <int TILES>
__device__ __forceinline__ void linear_few(const MatvecJobs& jobs, const float* x,
                                           float* partial, int n, int cols, int split_groups,
                                           int accumulate) {
#if __CUDA_ARCH__ >= 800
    extern __shared__ uint2 few_linear_shared[];
    const int index = block_job(jobs);
    const MatvecJob& job = jobs.job[index];
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const i64 first = ((i64)(blockIdx.x - job.first_block) * FEW_LINEAR_WARPS + warp) * 16;
    const bool active = first < job.rows;
    const int groups = cols / GROUP_SIZE;
    const int begin = blockIdx.z * split_groups, end = min(groups, begin + split_groups);
    const int count = end - begin;
    const int j0 = blockIdx.y * 4 * TILES;
    const int tokens = min(4 * TILES, n - j0);
    const i64 last = job.rows - 1;
    const WeightRow row_g =
        weight_row(DT_Q4, job.codes, job.scales, job.biases, min(first + g, last), cols);
    const WeightRow row_g8 =
        weight_row(DT_Q4, job.codes, job.scales, job.biases, min(first + g + 8, last), cols);
    TcPair w[FEW_LINEAR_BATCH / 2];
    if (active) load_few_linear_batch(w, row_g, row_g8, begin, end, t);
    const int stride = few_linear_stride(count);
    float* staged_sums = (float*)(few_linear_shared + FEW_LINEAR_TOKENS * stride);
    stage_few_linear(x, cols, j0, tokens, 4 * TILES, begin, count, stride, few_linear_shared,
                     staged_sums);
    __syncthreads();
    if (!active) return;
    const uint2* lane_b = few_linear_shared + (g / 2) * stride + (g % 2) * 4 + t;
    float acc[TILES][2] = {};
    for (int g0 = begin; g0 < end; g0 += FEW_LINEAR_BATCH) {
        if (g0 != begin) load_few_linear_batch(w, row_g, row_g8, g0, end, t);
#pragma unroll
        for (int b = 0; b < FEW_LINEAR_BATCH; ++b) {
            if (g0 + b < end) {
                mma_few_linear_group<TILES>(w[b / 2].group(b % 2), lane_b, 4 * stride,
                                            staged_sums, g0 + b - begin, t, acc);
            }
        }
    }
    const i64 total = outputs_before(jobs, jobs.count, n);
    float* split_out = partial ? partial + blockIdx.z * total + outputs_before(jobs, index, n)
                               : nullptr;
#pragma unroll
    for (int nt = 0; nt < TILES; ++nt) {
        const int jj = 4 * nt + t;
        if (jj >= tokens) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 r = first + g + 8 * h;
            if (r > last) continue;
            const i64 at = (i64)(j0 + jj) * job.rows + r;
            if (split_out) {
                split_out[at] = acc[nt][h];
            } else {
                job.out[at] = accumulate ? job.out[at] + acc[nt][h] : acc[nt][h];
            }
        }
    }
#endif
}

// One, two or four column tiles a pass (up to 4, 8 or FEW_LINEAR_TOKENS
// tokens).
#define LINEAR_FEW_Q4(NAME, TILES)                                                             \
    extern "C" __global__ void __launch_bounds__(FEW_LINEAR_WARPS * WARP_SIZE,                 \
                                                 FEW_LINEAR_MIN_BLOCKS)                        \
        NAME(MatvecJobs jobs, const float* x, float* partial, int n, int cols,                 \
             int split_groups, int accumulate) {                                               \
        await_inputs();                                                                        \
        linear_few<TILES>(jobs, x, partial, n, cols, split_groups, accumulate);                \
    }
LINEAR_FEW_Q4(linear_few_q4_1, 1)
LINEAR_FEW_Q4(linear_few_q4_2, 2)
LINEAR_FEW_Q4(linear_few_q4_4, FEW_LINEAR_TOKENS / 4)
