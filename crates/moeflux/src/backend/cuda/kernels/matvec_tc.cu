// One token's routed expert down projections (q4) on the tensor cores.
//
// moe.cu's moe_down gives each warp one expert row of `inter` columns, a
// few 4-bit words per lane, so its warps are short-lived and spend much of
// their time unpacking codes on CUDA cores (about five instructions a
// weight). Here a warp takes a 16-row tile of one expert's down matrix
// over all of its columns, and the codes go straight into mma.sync
// m16n8k16 as exact bf16 (centred, q - 8: gemm.cu's q4_pair). The token is
// the MMA's B operand: column 0 holds bf16(x), column 1 bf16(x - hi) and
// column 2 the bf16 of what is still left, so hi + mid + lo carries 24
// significant bits of x, and the sum of the three output columns is the
// f32 product up to the tensor cores' f32 accumulation (measured within
// 3e-7 of moe_down's results relative to the largest output). As in
// gemm.cu the affine map is applied per 64-column group in f32:
// Σ w·x = scale · Σ (q - 8)·x + (bias + 8·scale) · Σ x.
//
// Which weights a lane holds: a tile-group is 16 rows × one 64-column
// group (32 bytes per row); lane (g = lane / 4, t = lane % 4) loads bytes
// 8t..8t+7 of rows g and g + 8, i.e. columns 16t .. 16t + 15 of the group,
// two 32-bit words. Step s (0..3) of the group feeds the MMA's k slots 2t,
// 2t+1, 2t+8, 2t+9 (see gemm.cu for the fragment layout) with nibbles
// (s, s+4) of word 0 and of word 1: columns 16t + s, 16t + s + 4,
// 16t + 8 + s, 16t + 12 + s. The B operand follows the same order; it
// depends only on x, so each warp stages it once in shared memory (the "B
// table": per group and step, the two registers of lanes 0-11; lanes 12-31
// hold B's columns 3-7, which are zero).
//
// H100, 8 of 128 experts of the 30B shape: 7.5 µs a launch against 9.7 µs
// for moe_down; the same scheme for gate/up and the dense products of a
// layer was slower than linear.cu's and moe.cu's CUDA-core kernels (whose
// loads are already in flight across many short warps). It also takes the
// one-token product of a matrix of many rows (linear_vector_tc_q4, the LM
// head: 79.0 vs 92.4 µs).
//
// sm_80+ only, like gemm.cu; elsewhere the kernel is empty and the host
// takes moe_down.

// Launch geometry comes from the host: compile.rs passes the constants of
// geometry.rs as -D options, so a launch and its kernel cannot disagree.
#if !defined(TC_B_LANES) || !defined(TC_DOWN_SPLIT) || !defined(TC_DOWN_MAX_WARPS) || \
    !defined(TC_VECTOR_WARPS)
#error "matvec_tc.cu: launch geometry missing (compile.rs passes geometry.rs as -D options)"
#endif

// TC_B_LANES: lanes whose B registers are not zero: columns 0-2 (g = 0, 1, 2).
// Groups (16 rows × 64 columns) whose loads a warp issues before using any.
#define TC_GROUPS_IN_FLIGHT 6

// u32 words of the B table for `groups` groups.
__device__ __forceinline__ int tc_table_words(int groups) { return groups * 4 * TC_B_LANES * 2; }

// u32 words of one expert's staged x: its B table, then Σ x per group,
// rounded up to an even count so the next table stays 8-byte aligned.
__device__ __forceinline__ int tc_staged_words(int groups) {
    return tc_table_words(groups) + groups + (groups & 1);
}

#if __CUDA_ARCH__ >= 800

// Splits x into three bf16 pairs (first in the low half): hi = bf16(x),
// mid = bf16(x - hi), lo = bf16(x - hi - mid); every subtraction is exact.
__device__ __forceinline__ void split3_pair(float a, float b, u32& hi, u32& mid, u32& lo) {
    hi = bf16x2_rn(a, b);
    a -= __uint_as_float(hi << 16);
    b -= __uint_as_float(hi & 0xffff0000u);
    mid = bf16x2_rn(a, b);
    a -= __uint_as_float(mid << 16);
    b -= __uint_as_float(mid & 0xffff0000u);
    lo = bf16x2_rn(a, b);
}

// Stages groups [begin, end) of x (64 floats each) into the B table and
// Σ x per group, by threads `thread` of `threads` (a multiple of 32, all of
// a warp together). The caller synchronises before reading.
__device__ __forceinline__ void stage_tc_x(const float* x, int begin, int end, u32* table,
                                           float* sums, int thread, int threads) {
    // An item is (group, t, s): the four columns one lane of t takes at
    // step s, for each of the three parts.
    for (int item = thread; item < (end - begin) * 16; item += threads) {
        int group = begin + item / 16, t = (item / 4) % 4, s = item % 4;
        const float* xg = x + group * GROUP_SIZE + 16 * t + s;
        u32 hi0, mid0, lo0, hi1, mid1, lo1;
        split3_pair(xg[0], xg[4], hi0, mid0, lo0);
        split3_pair(xg[8], xg[12], hi1, mid1, lo1);
        uint2* step = (uint2*)table + (group * 4 + s) * TC_B_LANES;
        step[t] = make_uint2(hi0, hi1);
        step[4 + t] = make_uint2(mid0, mid1);
        step[8 + t] = make_uint2(lo0, lo1);
    }
    const int lane = thread % WARP_SIZE;
    for (int group = begin + thread / WARP_SIZE; group < end; group += threads / WARP_SIZE) {
        float v = x[group * GROUP_SIZE + lane] + x[group * GROUP_SIZE + WARP_SIZE + lane];
        v = warp_sum(v);
        if (lane == 0) sums[group] = v;
    }
}

// One tile's weights for one group, as lane (g, t) holds them: words 0 and
// 1 of rows g and g + 8, and those rows' scale and bias + 8 · scale.
struct TcGroup {
    uint2 row_g;
    uint2 row_g8;
    float scale_g, offset_g, scale_g8, offset_g8;
};

// Bytes L2 fetches from memory for a missed read of the tensor-core
// kernels' codes and the few-token kernels' scales (the loads' prefetch
// size: 64, 128 or 256; 0: no hint). A warp's loads take a 32-byte
// sector of each of eight rows' 128-byte lines, the line's other sectors
// following in the next three loads: 128 fetches the line at the first.
#ifndef CODE_L2_FETCH
#define CODE_L2_FETCH 128
#endif
#if CODE_L2_FETCH == 256
#define CODE_L2_HINT ".L2::256B"
#elif CODE_L2_FETCH == 128
#define CODE_L2_HINT ".L2::128B"
#elif CODE_L2_FETCH == 64
#define CODE_L2_HINT ".L2::64B"
#elif CODE_L2_FETCH == 0
#define CODE_L2_HINT ""
#else
#error "matvec_tc.cu: CODE_L2_FETCH must be 0, 64, 128 or 256"
#endif

__device__ __forceinline__ uint2 load_u64_streaming(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate" CODE_L2_HINT ".v2.u32 {%0, %1}, [%2];"
                 : "=r"(v.x), "=r"(v.y)
                 : "l"(p));
    return v;
}

// Loads group `group` of the tile whose lane rows are `row_g` and `row_g8`,
// a row's groups of codes `step` bytes apart (32; tiled experts: moe.cu).
__device__ __forceinline__ TcGroup load_tc_group(const WeightRow& row_g, const WeightRow& row_g8,
                                                 int group, int t, int step) {
    TcGroup w;
    w.row_g = load_u64_streaming(row_g.codes + group * step + 8 * t);
    w.row_g8 = load_u64_streaming(row_g8.codes + group * step + 8 * t);
    w.scale_g = bf16_to_float(row_g.scales[group]);
    w.offset_g = fmaf(8.0f, w.scale_g, bf16_to_float(row_g.biases[group]));
    w.scale_g8 = bf16_to_float(row_g8.scales[group]);
    w.offset_g8 = fmaf(8.0f, w.scale_g8, bf16_to_float(row_g8.biases[group]));
    return w;
}

// Two bf16 values from p[0] and p[1] (p[1] only where `second`), the first
// in the low half: one 4-byte load where p is aligned for it, so a row's
// scales (or biases) of two groups cost one load.
__device__ __forceinline__ u32 load_bf16_pair(const u16* p, bool second) {
    if (second && ((u64)p & 3u) == 0) return *(const u32*)p;
    return (u32)p[0] | (second ? (u32)p[1] << 16 : 0u);
}

// Groups `group` and `group + 1` (the second only where it is below
// `groups`) of the tile, as lane (g, t) holds them: the words of rows g
// and g + 8 per group, and each row's scales and biases of both groups
// as bf16 pairs (the first group's in the low half). Six loads a pair of
// groups rather than load_tc_group's twelve, and twelve registers in
// flight rather than sixteen; group(k) gives group + k as load_tc_group
// does.
struct TcPair {
    uint2 row_g[2], row_g8[2];
    u32 scale_g, bias_g, scale_g8, bias_g8;

    __device__ __forceinline__ static float half(u32 pair, int k) {
        return __uint_as_float(k == 0 ? pair << 16 : pair & 0xffff0000u);
    }

    __device__ __forceinline__ TcGroup group(int k) const {
        TcGroup w;
        w.row_g = row_g[k];
        w.row_g8 = row_g8[k];
        w.scale_g = half(scale_g, k);
        w.offset_g = fmaf(8.0f, w.scale_g, half(bias_g, k));
        w.scale_g8 = half(scale_g8, k);
        w.offset_g8 = fmaf(8.0f, w.scale_g8, half(bias_g8, k));
        return w;
    }

    // The words of the pair's groups in rows `g` and `g8` (load_tc_pair's
    // first four loads), a row's groups `step` bytes apart (load_tc_group).
    __device__ __forceinline__ void load_codes(const WeightRow& g, const WeightRow& g8,
                                               int group, int groups, int t, int step) {
        row_g[0] = load_u64_streaming(g.codes + group * step + 8 * t);
        row_g8[0] = load_u64_streaming(g8.codes + group * step + 8 * t);
        if (group + 1 < groups) {
            row_g[1] = load_u64_streaming(g.codes + (group + 1) * step + 8 * t);
            row_g8[1] = load_u64_streaming(g8.codes + (group + 1) * step + 8 * t);
        }
    }

    // Rows `g`'s and `g8`'s scales and biases of the pair's groups (its
    // last two).
    __device__ __forceinline__ void load_scales(const WeightRow& g, const WeightRow& g8,
                                                int group, int groups) {
        const bool second = group + 1 < groups;
        scale_g = load_bf16_pair(g.scales + group, second);
        bias_g = load_bf16_pair(g.biases + group, second);
        scale_g8 = load_bf16_pair(g8.scales + group, second);
        bias_g8 = load_bf16_pair(g8.biases + group, second);
    }
};

__device__ __forceinline__ TcPair load_tc_pair(const WeightRow& row_g, const WeightRow& row_g8,
                                               int group, int groups, int t) {
    TcPair w;
    w.load_codes(row_g, row_g8, group, groups, t, Q4_GROUP_BYTES);
    w.load_scales(row_g, row_g8, group, groups);
    return w;
}

// acc_g / acc_g8 (lanes with t = 0: rows g and g + 8) += the tile's
// products over one group, B table and Σ x at `table` and `sums`.
__device__ __forceinline__ void mma_tc_group(const TcGroup& w, const u32* table,
                                             const float* sums, int group, int lane,
                                             float& acc_g, float& acc_g8) {
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        u32 a[4] = {q4_pair(w.row_g.x >> (4 * s)), q4_pair(w.row_g8.x >> (4 * s)),
                    q4_pair(w.row_g.y >> (4 * s)), q4_pair(w.row_g8.y >> (4 * s))};
        uint2 b = lane < TC_B_LANES ? ((const uint2*)table)[(group * 4 + s) * TC_B_LANES + lane]
                                    : make_uint2(0u, 0u);
        mma_bf16(c, a, b.x, b.y);
    }
    // Columns 0 and 1 (hi, mid) are in lanes t = 0, column 2 (lo) in t = 1.
    float lo_g = __shfl_down_sync(FULL_MASK, c[0], 1);
    float lo_g8 = __shfl_down_sync(FULL_MASK, c[2], 1);
    float xs = sums[group];
    acc_g = fmaf(w.scale_g, c[0] + c[1] + lo_g, fmaf(w.offset_g, xs, acc_g));
    acc_g8 = fmaf(w.scale_g8, c[2] + c[3] + lo_g8, fmaf(w.offset_g8, xs, acc_g8));
}

// A batch of up to TC_GROUPS_IN_FLIGHT groups [g0, min(g0 + batch, end))
// of one tile (rows g / g + 8 at row_g / row_g8, groups `step` bytes
// apart): all loads issued, then all computed (acc_g / acc_g8 valid in
// lanes with t = 0).
struct TcBatch {
    TcGroup w[TC_GROUPS_IN_FLIGHT];

    __device__ __forceinline__ void load(const WeightRow& row_g, const WeightRow& row_g8,
                                         int g0, int end, int lane, int step) {
#pragma unroll
        for (int j = 0; j < TC_GROUPS_IN_FLIGHT; ++j) {
            if (g0 + j < end) w[j] = load_tc_group(row_g, row_g8, g0 + j, lane % 4, step);
        }
    }

    __device__ __forceinline__ void mma(const u32* table, const float* sums, int g0, int end,
                                        int lane, float& acc_g, float& acc_g8) const {
#pragma unroll
        for (int j = 0; j < TC_GROUPS_IN_FLIGHT; ++j) {
            if (g0 + j < end) mma_tc_group(w[j], table, sums, g0 + j, lane, acc_g, acc_g8);
        }
    }
};

#endif

// TC_DOWN_SPLIT (geometry.rs): warps per selected expert of moe_down_tc_q4
// (each takes a share of the groups); TC_DOWN_MAX_WARPS: its most warps per
// block (items (expert, share) beyond them are taken in turn).

// moe.cu's moe_down for q4 on the tensor cores: a block per 16-row tile of
// the output; item i = (expert i / TC_DOWN_SPLIT, share i % TC_DOWN_SPLIT)
// is that tile of the expert over its share of the groups (staged by the
// warp from the expert's act row into the expert's B table), warp w taking
// items w, w + warps, ...; the shares are added and the experts' sums
// weighted and added in order. Grid: ceil(hidden / 16) blocks of
// min(top_k · TC_DOWN_SPLIT, TC_DOWN_MAX_WARPS) warps. Dynamic shared
// memory: top_k · tc_staged_words(inter / 64) + 16 · top_k · TC_DOWN_SPLIT
// words. The down matrices' codes start 8-byte aligned (rows are read 8
// bytes at a time; the host checks).
extern "C" __global__ void __launch_bounds__(TC_DOWN_MAX_WARPS * WARP_SIZE)
    moe_down_tc_q4(const unsigned long long* table_of_experts, const u32* ids,
                   const float* weights, const float* act, float* out, int hidden, int inter,
                   int top_k, ExpertPart down, int accumulate, ExpertFfn ffn,
                   const u32* expert_ids) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    extern __shared__ u32 tc_shared[];
    const int groups = inter / GROUP_SIZE;
    const int per_expert = tc_staged_words(groups);
    float* partial = (float*)(tc_shared + top_k * per_expert);  // [top_k][split][16]
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int warps = blockDim.x / WARP_SIZE;
    const i64 first = (i64)blockIdx.x * 16;
    const i64 last = hidden - 1;
    for (int item = warp; item < top_k * TC_DOWN_SPLIT; item += warps) {
        const int k = item / TC_DOWN_SPLIT;
        const int2 share = warp_words(groups, item % TC_DOWN_SPLIT, TC_DOWN_SPLIT);
        u32* table = tc_shared + k * per_expert;
        float* sums = (float*)(table + tc_table_words(groups));
        const unsigned long long base = table_of_experts[ids[k]];
        WeightRow row_g = expert_row(DT_Q4, base, down, min(first + lane / 4, last), inter);
        WeightRow row_g8 = expert_row(DT_Q4, base, down, min(first + lane / 4 + 8, last), inter);
        // The first batch's weights are requested before x is staged.
        const int step = code_group_step(down);
        TcBatch batch;
        batch.load(row_g, row_g8, share.x, share.y, lane, step);
        stage_tc_x(act + (i64)k * inter, share.x, share.y, table, sums, lane, WARP_SIZE);
        __syncwarp();
        float acc_g = 0.0f, acc_g8 = 0.0f;
        batch.mma(table, sums, share.x, share.y, lane, acc_g, acc_g8);
        for (int g0 = share.x + TC_GROUPS_IN_FLIGHT; g0 < share.y; g0 += TC_GROUPS_IN_FLIGHT) {
            batch.load(row_g, row_g8, g0, share.y, lane, step);
            batch.mma(table, sums, g0, share.y, lane, acc_g, acc_g8);
        }
        if (lane % 4 == 0) {
            partial[item * 16 + lane / 4] = acc_g;
            partial[item * 16 + lane / 4 + 8] = acc_g8;
        }
    }
    __syncthreads();
    if (threadIdx.x < 16 && first + threadIdx.x < hidden) {
        float total = 0.0f;
        i64 r = first + threadIdx.x;
        for (int k = 0; k < top_k; ++k) {
            float expert = 0.0f;
            for (int part = 0; part < TC_DOWN_SPLIT; ++part) {
                expert += partial[(k * TC_DOWN_SPLIT + part) * 16 + threadIdx.x];
            }
            expert += expert_down_bias(ffn, expert_ids[k], r, hidden);
            total = fmaf(weights[k], expert, total);
        }
        out[r] = accumulate ? out[r] + total : total;
    }
#endif
}

// TC_VECTOR_WARPS (geometry.rs): warps per block of linear_vector_tc_q4.

// One token's product with a q4 matrix of many rows (the LM head) on the
// tensor cores: each block stages x's B table and Σ x per group once, then
// its warps take 16-row tiles in turn (moe_down_tc_q4's per-tile scheme),
// so a tile costs no staging. out[r] = Σ_c w[r, c] · x[c]; cols a multiple
// of 64, rows 8-byte aligned (cols / 2 bytes). Dynamic shared memory:
// tc_staged_words(cols / 64) words. Grid: any number of blocks (a few per
// SM).
extern "C" __global__ void __launch_bounds__(TC_VECTOR_WARPS * WARP_SIZE)
    linear_vector_tc_q4(const u8* codes, const u16* scales, const u16* biases, const float* x,
                        float* out, int rows, int cols) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    extern __shared__ u32 tc_shared[];
    const int groups = cols / GROUP_SIZE;
    u32* table = tc_shared;
    float* sums = (float*)(table + tc_table_words(groups));
    stage_tc_x(x, 0, groups, table, sums, threadIdx.x, blockDim.x);
    __syncthreads();
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const i64 tiles = ((i64)rows + 15) / 16;
    for (i64 tile = (i64)blockIdx.x * TC_VECTOR_WARPS + warp; tile < tiles;
         tile += (i64)gridDim.x * TC_VECTOR_WARPS) {
        const i64 first = tile * 16;
        WeightRow row_g =
            weight_row(DT_Q4, codes, scales, biases, min(first + lane / 4, (i64)rows - 1), cols);
        WeightRow row_g8 = weight_row(DT_Q4, codes, scales, biases,
                                      min(first + lane / 4 + 8, (i64)rows - 1), cols);
        float acc_g = 0.0f, acc_g8 = 0.0f;
        for (int g0 = 0; g0 < groups; g0 += TC_GROUPS_IN_FLIGHT) {
            TcBatch batch;
            batch.load(row_g, row_g8, g0, groups, lane, Q4_GROUP_BYTES);
            batch.mma(table, sums, g0, groups, lane, acc_g, acc_g8);
        }
        if (lane % 4 == 0) {
            const i64 r = first + lane / 4;
            if (r < rows) out[r] = acc_g;
            if (r + 8 < rows) out[r + 8] = acc_g8;
        }
    }
#endif
}
