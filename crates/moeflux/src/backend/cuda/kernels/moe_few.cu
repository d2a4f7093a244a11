// Routed experts of a few tokens per expert (a decode step of several
// sequences, a check of drafted tokens), grouped by expert on the device.
//
// moe_group_slots sorts a call's slots (token · top_k + rank) by expert
// without the host: the experts' slot counts, their first sorted
// positions and tiles of at most `tile_slots` slots ({expert, first
// sorted slot, slots, 0}, moe_prefill.cu's tiles), and the number of
// tiles, which the kernels after it read from the device. The host sizes
// their grids for the most tiles a call can have; blocks past the count
// return at once. So a layer's experts need no round trip to the host,
// and a step of several tokens can be recorded (graph.rs).
//
// moe_few_gate_up_q4 and moe_few_down_q4 then run each tile of up to
// FEW_SLOTS slots of one expert. A warp takes a 16-row tile of the
// expert's matrix over all of its columns (matvec_tc.cu's scheme: the
// weights go from the loads straight into mma.sync m16n8k16 as exact
// centred codes, no staging in shared memory), and the block stages its
// slots' inputs once in shared memory as the MMAs' B operand; tiled
// codes (moe.cu) put a warp's load of one group in 256 contiguous bytes.
// The numerics are gemm.cu's: an input is split into hi = bf16(x) and
// lo = bf16(x - hi), and the affine map is applied per 64-column group
// in f32, Σ w·x = scale · Σ (q - 8)·x + (bias + 8·scale) · Σ x. B's eight
// columns are four tokens' (hi, lo): column 2j is token j's hi, 2j + 1
// its lo, so lane (g, t) of the C fragment holds rows g and g + 8 of
// token t in (c0 + c1) and (c2 + c3). A tile of up to 8 slots is two
// such column tiles; the weights are read once for all of them.
//
// Each output is the same sequence of operations whichever other slots
// share its tile, so results do not depend on the grouping; every
// output is written by one block (act by sorted position, y by slot),
// and moe_prefill_combine sums a token's y rows in rank order.
//
// sm_80+ only (bf16 mma); elsewhere the few-token kernels are empty and
// the host takes the per-expert path.

// GROUP_THREADS: threads of moe_group_slots (one block). FEW_WARPS: warps
// per block of the few-token kernels; FEW_SLOTS: most slots per tile
// (two MMA column tiles of four tokens); FEW_DOWN_TILES: 16-row tiles each
// warp of moe_few_down_q4 takes.
// Launch geometry comes from the host: compile.rs passes the constants of
// geometry.rs as -D options, so a launch and its kernel cannot disagree.
#if !defined(GROUP_THREADS) || !defined(FEW_WARPS) || !defined(FEW_SLOTS) || \
    !defined(FEW_DOWN_TILES)
#error "moe_few.cu: launch geometry missing (compile.rs passes geometry.rs as -D options)"
#endif

// Groups (of 64 columns) whose weights a warp loads before using any:
// gate and up each, and down.
#ifndef FEW_GATE_UP_GROUPS
#define FEW_GATE_UP_GROUPS 4
#endif
#ifndef FEW_DOWN_GROUPS
#define FEW_DOWN_GROUPS 6
#endif
#if FEW_GATE_UP_GROUPS % 2 || FEW_DOWN_GROUPS % 2
#error "moe_few.cu: the weights are loaded two groups at a time (FEW_*_GROUPS even)"
#endif
// 1: each row's scales (and biases) of four groups in one 8-byte load
// where aligned (load_few_batch); 0: two groups a load.
#ifndef FEW_QUAD_SCALES
#define FEW_QUAD_SCALES 1
#endif
// 1: tiles of tiled matrices (moe.cu) with whole quads of groups (a
// multiple of 256 columns) and 8-byte aligned scales and biases take
// few_quads, whose loads and their addresses are set once per tile and
// whose column tiles are a template parameter; 0: every tile takes the
// general loop.
#ifndef FEW_FAST
#define FEW_FAST 1
#endif
// Quads of groups (four groups of 64 columns) a warp loads before using
// any in few_quads: gate and up each, and down.
#ifndef FEW_GATE_UP_QUADS
#define FEW_GATE_UP_QUADS 1
#endif
#ifndef FEW_DOWN_QUADS
#define FEW_DOWN_QUADS 1
#endif
// Blocks a multiprocessor holds at once, which bounds the registers of
// the two expert kernels: two (128 registers), where unbounded gate/up
// took 147 and the device held one block of it, 8 warps a multiprocessor.
#ifndef FEW_EXPERT_MIN_BLOCKS
#define FEW_EXPERT_MIN_BLOCKS 2
#endif

// The inclusive sum of two counts over the block's threads, in thread
// order; `scratch` is 32 pairs of shared memory. The block's totals are
// in scratch[warps - 1] until the next call. Every thread must call it.
__device__ __forceinline__ int2 block_inclusive_scan2(int2 v, int2* scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int warps = blockDim.x / WARP_SIZE;
    for (int offset = 1; offset < WARP_SIZE; offset <<= 1) {
        const int a = __shfl_up_sync(FULL_MASK, v.x, offset);
        const int b = __shfl_up_sync(FULL_MASK, v.y, offset);
        if (lane >= offset) {
            v.x += a;
            v.y += b;
        }
    }
    __syncthreads();  // an earlier call may still be reading scratch
    if (lane == WARP_SIZE - 1) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int2 w = lane < warps ? scratch[lane] : make_int2(0, 0);
        for (int offset = 1; offset < WARP_SIZE; offset <<= 1) {
            const int a = __shfl_up_sync(FULL_MASK, w.x, offset);
            const int b = __shfl_up_sync(FULL_MASK, w.y, offset);
            if (lane >= offset) {
                w.x += a;
                w.y += b;
            }
        }
        if (lane < warps) scratch[lane] = w;
    }
    __syncthreads();
    if (warp > 0) {
        v.x += scratch[warp - 1].x;
        v.y += scratch[warp - 1].y;
    }
    return v;
}

// The `slots` slots of a call (experts[i]: slot i's expert) sorted by
// expert, ascending, and within an expert by slot: sorted[] gets the slot
// ids, tiles[] the tiles ({expert, first sorted position, slots, 0}, at
// most `tile_slots` slots each; at most `max_tiles` written) and
// *tile_count their number. used_bytes (when given) grows by
// `expert_bytes` per distinct expert: the expert weights the call reads.
// One block of GROUP_THREADS threads; dynamic shared memory: three ints
// per expert and one per warp and expert (group_shared_bytes, grouped.rs).
// sm_80+, like the kernels that read its tiles.
//
// Each warp takes a contiguous run of the slots (a prompt chunk has
// thousands) and counts its experts; an expert's sorted run holds the
// warps' slots in warp order, so a warp places its own in slot order from
// its own cursor, with no other warp between.
extern "C" __global__ void __launch_bounds__(GROUP_THREADS)
    moe_group_slots(const u32* experts, int slots, int num_experts, int tile_slots,
                    int max_tiles, u32* sorted, u32* tiles, u32* tile_count, u64* used_bytes,
                    u64 expert_bytes) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    extern __shared__ int group_shared[];
    __shared__ int2 scratch[32];
    __shared__ int active;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int warps = blockDim.x / WARP_SIZE;
    int* count = group_shared;                    // slots per expert
    int* start = count + num_experts;             // first sorted position
    int* first_tile = start + num_experts;        // first tile
    int* cursor = first_tile + num_experts;       // [warps][experts]: a warp's place in a run
    for (int e = threadIdx.x; e < warps * num_experts; e += blockDim.x) cursor[e] = 0;
    if (threadIdx.x == 0) active = 0;
    __syncthreads();
    const int per_warp = (slots + warps - 1) / warps;
    const int run0 = min(slots, warp * per_warp), run1 = min(slots, run0 + per_warp);
    int* own = cursor + warp * num_experts;
    for (int i = run0 + lane; i < run1; i += WARP_SIZE) {
        const u32 e = experts[i];
        if (e < (u32)num_experts) atomicAdd(&own[e], 1);
    }
    __syncthreads();
    // Each expert's count, and each warp's cursor: the slots of the warps
    // before it.
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
        int c = 0;
        for (int w = 0; w < warps; ++w) {
            const int mine = cursor[w * num_experts + e];
            cursor[w * num_experts + e] = c;
            c += mine;
        }
        count[e] = c;
    }
    __syncthreads();
    // Exclusive sums of the counts and of the tiles, in expert order.
    int2 carry = make_int2(0, 0);
    for (int base = 0; base < num_experts; base += blockDim.x) {
        const int e = base + threadIdx.x;
        const int c = e < num_experts ? count[e] : 0;
        const int2 own_counts = make_int2(c, (c + tile_slots - 1) / tile_slots);
        const int2 inclusive = block_inclusive_scan2(own_counts, scratch);
        if (e < num_experts) {
            start[e] = carry.x + inclusive.x - own_counts.x;
            first_tile[e] = carry.y + inclusive.y - own_counts.y;
        }
        const int2 total = scratch[blockDim.x / WARP_SIZE - 1];
        carry.x += total.x;
        carry.y += total.y;
    }
    int used = 0;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
        const int c = count[e];
        used += c > 0;
        for (int j = 0; j * tile_slots < c; ++j) {
            const int t = first_tile[e] + j;
            if (t < max_tiles) {
                u32* tile = tiles + 4 * (i64)t;
                tile[0] = (u32)e;
                tile[1] = (u32)(start[e] + j * tile_slots);
                tile[2] = (u32)min(tile_slots, c - j * tile_slots);
                tile[3] = 0;
            }
        }
    }
    if (used) atomicAdd(&active, used);
    __syncthreads();
    if (threadIdx.x == 0) {
        *tile_count = (u32)min(carry.y, max_tiles);
        if (used_bytes) atomicAdd(used_bytes, (u64)active * expert_bytes);
    }
    // Placement of the warp's run, 32 slots a round: a slot's place is its
    // expert's start plus the warp's cursor plus the lanes before it that
    // share its expert; the first of them then moves the cursor on.
    const u32 before = (1u << lane) - 1u;
    for (int base = run0; base < run1; base += WARP_SIZE) {
        const int i = base + lane;
        const u32 e = i < run1 ? experts[i] : 0xffffffffu;
        const bool valid = e < (u32)num_experts;
        const u32 peers = __match_any_sync(FULL_MASK, e);
        const int at = valid ? start[e] + own[e] : 0;
        __syncwarp();
        if (valid) {
            sorted[at + __popc(peers & before)] = (u32)i;
            if ((peers & before) == 0u) own[e] += __popc(peers);
        }
        __syncwarp();
    }
#endif
}

#if __CUDA_ARCH__ >= 800

// The scales (or biases) at p of four groups as two bf16 pairs, in one
// 8-byte load where p is aligned to it.
__device__ __forceinline__ void load_bf16_quad(const u16* p, u32& low, u32& high) {
    if (((u64)p & 7u) == 0) {
        const uint2 v = *(const uint2*)p;
        low = v.x;
        high = v.y;
    } else {
        low = load_bf16_pair(p, true);
        high = load_bf16_pair(p + 2, true);
    }
}

// N pairs of groups of a tile in registers, pair[i] = groups g0 + 2i and
// g0 + 2i + 1 (those below `groups`) as load_tc_pair leaves them: every
// code load of the batch first, then the scales and biases, with
// FEW_QUAD_SCALES a row's of two pairs in one load each. A row's groups of
// codes are `step` bytes apart (code_group_step).
template <int N>
__device__ __forceinline__ void load_few_batch(TcPair (&pair)[N], const WeightRow& row_g,
                                               const WeightRow& row_g8, int g0, int groups,
                                               int t, int step) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        if (g0 + 2 * i >= groups) break;
        pair[i].load_codes(row_g, row_g8, g0 + 2 * i, groups, t, step);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int group = g0 + 2 * i;
        if (group >= groups) break;
        if (FEW_QUAD_SCALES && i % 2 == 1) continue;  // loaded with pair i - 1
        if (FEW_QUAD_SCALES && i + 1 < N && group + 4 <= groups) {
            load_bf16_quad(row_g.scales + group, pair[i].scale_g, pair[i + 1].scale_g);
            load_bf16_quad(row_g.biases + group, pair[i].bias_g, pair[i + 1].bias_g);
            load_bf16_quad(row_g8.scales + group, pair[i].scale_g8, pair[i + 1].scale_g8);
            load_bf16_quad(row_g8.biases + group, pair[i].bias_g8, pair[i + 1].bias_g8);
            continue;
        }
        // Alone: the last pairs, or every pair without FEW_QUAD_SCALES.
#pragma unroll
        for (int k = 0; k < (FEW_QUAD_SCALES ? 2 : 1); ++k) {
            if (i + k >= N || group + 2 * k >= groups) break;
            pair[i + k].load_scales(row_g, row_g8, group + 2 * k, groups);
        }
    }
}

// Stages `count` input rows (row j at in_row[j] of x, `cols` wide) as the
// B table of the few-token kernels, and Σ x per row and 64-column group:
// table[((nt · groups + group) · 4 + s) · 32 + lane] holds lane (g, t)'s
// b0, b1 at step s of the group for column tile nt: row j = 4·nt + g / 2,
// its hi (g even) or lo (g odd) at columns 16t + s, + 4 (b0) and
// 16t + 8 + s, + 12 (b1) of the group (matvec_tc.cu's k order). Rows
// count.. of the last column tile are zero. sums[j · groups + group].
__device__ __forceinline__ void stage_few_rows(const float* x, const int* in_row, int count,
                                               int cols, int tiles_n, uint2* table,
                                               float* sums) {
    const int groups = cols / GROUP_SIZE;
    const int items = tiles_n * 4 * groups * 16;  // (row, group, t, s), s fastest
    // Whole warps take part in every round: the 16 items of a (row, group)
    // are one half-warp, which adds up its Σ x by shuffles.
    const int rounds = (items + WARP_SIZE - 1) / WARP_SIZE * WARP_SIZE;
    for (int item = threadIdx.x; item < rounds; item += blockDim.x) {
        const bool inside = item < items;
        const int j = item / (groups * 16);
        const int group = (item / 16) % groups;
        const int t = (item / 4) % 4, s = item % 4;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (inside && j < count) {
            const float* xg = x + (i64)in_row[j] * cols + group * GROUP_SIZE + 16 * t + s;
            v[0] = xg[0];
            v[1] = xg[4];
            v[2] = xg[8];
            v[3] = xg[12];
        }
        u32 hi0, lo0, hi1, lo1;
        split_pair(v[0], v[1], hi0, lo0);
        split_pair(v[2], v[3], hi1, lo1);
        if (inside) {
            const int nt = j / 4, g = 2 * (j % 4);
            uint2* step = table + ((nt * groups + group) * 4 + s) * WARP_SIZE;
            step[4 * g + t] = make_uint2(hi0, hi1);
            step[4 * (g + 1) + t] = make_uint2(lo0, lo1);
        }
        float sum = (v[0] + v[1]) + (v[2] + v[3]);
        sum += __shfl_xor_sync(FULL_MASK, sum, 8);
        sum += __shfl_xor_sync(FULL_MASK, sum, 4);
        sum += __shfl_xor_sync(FULL_MASK, sum, 2);
        sum += __shfl_xor_sync(FULL_MASK, sum, 1);
        if (inside && item % 16 == 0) sums[j * groups + group] = sum;
    }
}

// acc[m][nt][0] / acc[m][nt][1] (rows g and g + 8 of the tile, token
// 4·nt + t of lane (g, t)) += the products of matrix m's tile (w[m]) over
// one group, for the first NT column tiles: the group's B table at `b`
// (this lane's entry of step 0 of column tile 0; column tile nt `b_tile`
// entries on) and its Σ x at `xs` (column tile nt `xs_tile` on). The M
// matrices (gate and up: two) share each B fragment and Σ x read from
// shared memory.
template <int M, int NT>
__device__ __forceinline__ void mma_few_group_at(const TcGroup (&w)[M], const uint2* b,
                                                 int b_tile, const float* xs, int xs_tile,
                                                 float (&acc)[M][2][2]) {
    float c[M][NT][4] = {};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        u32 a[M][4];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            a[m][0] = q4_pair(w[m].row_g.x >> (4 * s));
            a[m][1] = q4_pair(w[m].row_g8.x >> (4 * s));
            a[m][2] = q4_pair(w[m].row_g.y >> (4 * s));
            a[m][3] = q4_pair(w[m].row_g8.y >> (4 * s));
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const uint2 bv = b[nt * b_tile + s * WARP_SIZE];
#pragma unroll
            for (int m = 0; m < M; ++m) mma_bf16(c[m][nt], a[m], bv.x, bv.y);
        }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const float x_sum = xs[nt * xs_tile];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            acc[m][nt][0] = fmaf(w[m].scale_g, c[m][nt][0] + c[m][nt][1],
                                 fmaf(w[m].offset_g, x_sum, acc[m][nt][0]));
            acc[m][nt][1] = fmaf(w[m].scale_g8, c[m][nt][2] + c[m][nt][3],
                                 fmaf(w[m].offset_g8, x_sum, acc[m][nt][1]));
        }
    }
}

// mma_few_group_at for group `group` of the B table (stage_few_rows'
// layout) and its first `tiles_n` column tiles.
template <int M>
__device__ __forceinline__ void mma_few_group(const TcGroup (&w)[M], const uint2* table,
                                              const float* sums, int group, int groups,
                                              int tiles_n, int lane, float (&acc)[M][2][2]) {
    const uint2* b = table + group * 4 * WARP_SIZE + lane;
    const float* xs = sums + (lane % 4) * groups + group;
    if (tiles_n == 1) {
        mma_few_group_at<M, 1>(w, b, groups * 4 * WARP_SIZE, xs, 4 * groups, acc);
    } else {
        mma_few_group_at<M, 2>(w, b, groups * 4 * WARP_SIZE, xs, 4 * groups, acc);
    }
}

// The words of one quad of groups of a 16-row tile as lane (g, t) holds
// them (rows g and g + 8, bytes 8t..8t+7 of each group), and each row's
// scales and biases of the quad, four bf16 in one 8-byte load each.
struct FewQuad {
    uint2 code_g[4], code_g8[4];
    uint2 scale_g, bias_g, scale_g8, bias_g8;

    // Group j of the quad as mma_few_group takes it.
    __device__ __forceinline__ TcGroup group(int j) const {
        const u32 s_g = j < 2 ? scale_g.x : scale_g.y, b_g = j < 2 ? bias_g.x : bias_g.y;
        const u32 s_g8 = j < 2 ? scale_g8.x : scale_g8.y;
        const u32 b_g8 = j < 2 ? bias_g8.x : bias_g8.y;
        TcGroup w;
        w.row_g = code_g[j];
        w.row_g8 = code_g8[j];
        w.scale_g = TcPair::half(s_g, j % 2);
        w.offset_g = fmaf(8.0f, w.scale_g, TcPair::half(b_g, j % 2));
        w.scale_g8 = TcPair::half(s_g8, j % 2);
        w.offset_g8 = fmaf(8.0f, w.scale_g8, TcPair::half(b_g8, j % 2));
        return w;
    }
};

// __ldg's read-only load, with matvec_tc.cu's L2 fetch size.
__device__ __forceinline__ uint2 load_u64_readonly(const void* p) {
    uint2 v;
    asm("ld.global.nc" CODE_L2_HINT ".v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// Lane (g, t)'s addresses in a 16-row tile of one tiled matrix (moe.cu)
// for few_quads: its bytes of row g and that row's scales, moved on a
// quad of groups at a time so every load of a quad is at a constant
// offset; row g + 8's and the biases are found from them, which keeps
// the registers of two matrices' addresses within the kernel's bound. A
// warp's load of one group reads 256 contiguous bytes.
struct FewRows {
    static constexpr int GROUP_STEP = CODE_TILE_ROWS * Q4_GROUP_BYTES;
    const u8* code_g;
    const u16* scales_g;
    int bias_offset;  // u16 elements from the scales to the biases

    __device__ __forceinline__ FewRows(const WeightRow& g, int t)
        : code_g(g.codes + 8 * t), scales_g(g.scales), bias_offset((int)(g.biases - g.scales)) {}

    // The quad `i` quads ahead, rows g and g + 8 `scale_rows` scales
    // apart: every code load first.
    __device__ __forceinline__ void load(FewQuad& q, int i, int scale_rows) const {
        const u8* code_g8 = code_g + 8 * Q4_GROUP_BYTES;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            q.code_g[j] = load_u64_streaming(code_g + (4 * i + j) * GROUP_STEP);
            q.code_g8[j] = load_u64_streaming(code_g8 + (4 * i + j) * GROUP_STEP);
        }
        const u16* scales_g8 = scales_g + scale_rows;
        q.scale_g = load_u64_readonly(scales_g + 4 * i);
        q.bias_g = load_u64_readonly(scales_g + bias_offset + 4 * i);
        q.scale_g8 = load_u64_readonly(scales_g8 + 4 * i);
        q.bias_g8 = load_u64_readonly(scales_g8 + bias_offset + 4 * i);
    }

    __device__ __forceinline__ void advance(int quads) {
        code_g += 4 * GROUP_STEP * quads;
        scales_g += 4 * quads;
    }
};

// acc[0] / acc[1] += gate's / up's 16-row tile (lane rows gate_g, gate_g8,
// up_g, up_g8) times the B table, FEW_GATE_UP_GROUPS groups loaded at a
// time: any count of groups, any alignment of scales.
__device__ __forceinline__ void few_gate_up_groups(const WeightRow& gate_g,
                                                   const WeightRow& gate_g8,
                                                   const WeightRow& up_g, const WeightRow& up_g8,
                                                   const uint2* table, const float* sums,
                                                   int groups, int tiles_n, int lane, int step,
                                                   float (&acc)[2][2][2]) {
    for (int g0 = 0; g0 < groups; g0 += FEW_GATE_UP_GROUPS) {
        TcPair wg[FEW_GATE_UP_GROUPS / 2], wu[FEW_GATE_UP_GROUPS / 2];
        load_few_batch(wg, gate_g, gate_g8, g0, groups, lane % 4, step);
        load_few_batch(wu, up_g, up_g8, g0, groups, lane % 4, step);
#pragma unroll
        for (int j = 0; j < FEW_GATE_UP_GROUPS; ++j) {
            if (g0 + j < groups) {
                const TcGroup w[2] = {wg[j / 2].group(j % 2), wu[j / 2].group(j % 2)};
                mma_few_group(w, table, sums, g0 + j, groups, tiles_n, lane, acc);
            }
        }
    }
}

// Whether a warp's 16-row tile of a matrix stored as `part` suits
// few_quads: tiled (so every tile has all 16 rows), whole quads of
// groups, and scales and biases at 8-byte boundaries (then every row's
// are, as a row's are 8·quads bytes).
__device__ __forceinline__ bool few_quads_fit(const WeightRow& row, const ExpertPart& part,
                                              int groups) {
    return FEW_FAST && part.tiled && groups % 4 == 0 &&
           (((u64)row.scales | (u64)row.biases) & 7u) == 0;
}

// acc[m][nt] += matrix m's 16-row tile (rows[m]) times the first NT column
// tiles of the B table (stage_few_rows' layout), over all `groups` groups
// (a multiple of four), QUADS quads of groups loaded at a time: the
// products of the general loop in the same order, with each load's
// address a constant offset from pointers moved once per batch and the
// column tiles fixed at compile time.
template <int M, int NT, int QUADS>
__device__ __forceinline__ void few_quads(FewRows (&rows)[M], const uint2* table,
                                          const float* sums, int groups, int lane,
                                          float (&acc)[M][2][2]) {
    const int quads = groups / 4;
    const int scale_rows = 8 * groups;  // from row g's scales to row g + 8's
    const int b_tile = groups * 4 * WARP_SIZE, xs_tile = 4 * groups;
    const uint2* b = table + lane;
    const float* xs = sums + (lane % 4) * groups;
    for (int q0 = 0; q0 < quads; q0 += QUADS) {
        FewQuad batch[QUADS][M];
#pragma unroll
        for (int i = 0; i < QUADS; ++i) {
            if (q0 + i < quads) {
#pragma unroll
                for (int m = 0; m < M; ++m) rows[m].load(batch[i][m], i, scale_rows);
            }
        }
#pragma unroll
        for (int i = 0; i < QUADS; ++i) {
            if (q0 + i >= quads) break;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                TcGroup w[M];
#pragma unroll
                for (int m = 0; m < M; ++m) w[m] = batch[i][m].group(j);
                mma_few_group_at<M, NT>(w, b + (4 * i + j) * 4 * WARP_SIZE, b_tile,
                                        xs + 4 * i + j, xs_tile, acc);
            }
        }
#pragma unroll
        for (int m = 0; m < M; ++m) rows[m].advance(QUADS);
        b += QUADS * 16 * WARP_SIZE;
        xs += 4 * QUADS;
    }
}

// The tile of the block (blockIdx.y), or false when past the call's
// tiles: its expert, first sorted position and slot count.
struct FewTile {
    u32 expert;
    int start;
    int count;
};

__device__ __forceinline__ bool few_tile(const u32* tiles, const u32* tile_count, FewTile& tile) {
    if (blockIdx.y >= *tile_count) return false;
    const u32* t = tiles + 4 * (i64)blockIdx.y;
    tile.expert = t[0];
    tile.start = (int)t[1];
    tile.count = min((int)t[2], FEW_SLOTS);
    return true;
}

#endif  // __CUDA_ARCH__ >= 800

// Dynamic shared memory of the few-token kernels, for inputs of `cols`
// columns (groups = cols / 64): the B table of FEW_SLOTS rows,
// FEW_SLOTS / 4 · groups · 4 · 32 uint2, then FEW_SLOTS · groups floats of
// Σ x, then the FEW_SLOTS input rows (ints); grouped.rs sizes it the same
// way. No static shared memory: the host allows them the device's whole
// opt-in limit as dynamic shared memory.

// act[start + j, r] = expert_act(gate · x[slots[start + j] / top_k],
// up · ...) for the slots j of each tile, rows r of gate and up. Grid:
// (ceil(inter / (16 · FEW_WARPS)), the most tiles the call can have);
// warp w of block b takes rows 16 · (FEW_WARPS · b + w) .. + 15.
extern "C" __global__ void __launch_bounds__(FEW_WARPS * WARP_SIZE, FEW_EXPERT_MIN_BLOCKS)
    moe_few_gate_up_q4(const unsigned long long* table_of_experts, const u32* tiles,
                       const u32* tile_count, const u32* slots, const float* x, float* act,
                       int inter, int hidden, int top_k, ExpertPart gate, ExpertPart up,
                       ExpertFfn ffn) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    extern __shared__ uint2 few_shared[];
    FewTile tile;
    if (!few_tile(tiles, tile_count, tile)) return;
    const int groups = hidden / GROUP_SIZE;
    const int tiles_n = (tile.count + 3) / 4;
    float* sums = (float*)(few_shared + (FEW_SLOTS / 4) * groups * 4 * WARP_SIZE);
    int* in_row = (int*)(sums + FEW_SLOTS * groups);
    if (threadIdx.x < FEW_SLOTS) {
        in_row[threadIdx.x] =
            threadIdx.x < tile.count ? (int)(slots[tile.start + threadIdx.x] / (u32)top_k) : 0;
    }
    __syncthreads();
    stage_few_rows(x, in_row, tile.count, hidden, tiles_n, few_shared, sums);
    __syncthreads();
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const i64 first = ((i64)blockIdx.x * FEW_WARPS + warp) * 16;
    if (first >= inter) return;
    const unsigned long long base = table_of_experts[tile.expert];
    const i64 last = inter - 1;
    const WeightRow gate_g = expert_row(DT_Q4, base, gate, min(first + lane / 4, last), hidden);
    const WeightRow gate_g8 = expert_row(DT_Q4, base, gate, min(first + lane / 4 + 8, last), hidden);
    const WeightRow up_g = expert_row(DT_Q4, base, up, min(first + lane / 4, last), hidden);
    const WeightRow up_g8 = expert_row(DT_Q4, base, up, min(first + lane / 4 + 8, last), hidden);
    float acc[2][2][2] = {};  // gate, up
    if (few_quads_fit(gate_g, gate, groups) && few_quads_fit(up_g, up, groups)) {
        FewRows rows[2] = {FewRows(gate_g, lane % 4), FewRows(up_g, lane % 4)};
        if (tiles_n == 1) {
            few_quads<2, 1, FEW_GATE_UP_QUADS>(rows, few_shared, sums, groups, lane, acc);
        } else {
            few_quads<2, 2, FEW_GATE_UP_QUADS>(rows, few_shared, sums, groups, lane, acc);
        }
    } else {
        few_gate_up_groups(gate_g, gate_g8, up_g, up_g8, few_shared, sums, groups, tiles_n,
                           lane, code_group_step(gate), acc);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
        const int j = nt * 4 + lane % 4;
        if (nt >= tiles_n || j >= tile.count) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 r = first + lane / 4 + 8 * h;
            if (r < inter) {
                act[(i64)(tile.start + j) * inter + r] =
                    expert_act(ffn, tile.expert, r, inter, acc[0][nt][h], acc[1][nt][h]);
            }
        }
    }
#endif
}

// y[slot, r] = down · act[start + j] + the down bias, for the slots j of
// each tile (slot = slots[start + j]), rows r of down. Grid:
// (ceil(hidden / (16 · FEW_WARPS · FEW_DOWN_TILES)), the most tiles the
// call can have); warp w of block b takes the 16-row tiles
// FEW_DOWN_TILES · FEW_WARPS · b + w + FEW_WARPS · k.
extern "C" __global__ void __launch_bounds__(FEW_WARPS * WARP_SIZE, FEW_EXPERT_MIN_BLOCKS)
    moe_few_down_q4(const unsigned long long* table_of_experts, const u32* tiles,
                    const u32* tile_count, const u32* slots, const float* act, float* y,
                    int hidden, int inter, ExpertPart down, ExpertFfn ffn) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    extern __shared__ uint2 few_shared[];
    FewTile tile;
    if (!few_tile(tiles, tile_count, tile)) return;
    const int groups = inter / GROUP_SIZE;
    const int tiles_n = (tile.count + 3) / 4;
    float* sums = (float*)(few_shared + (FEW_SLOTS / 4) * groups * 4 * WARP_SIZE);
    int* in_row = (int*)(sums + FEW_SLOTS * groups);
    if (threadIdx.x < FEW_SLOTS) in_row[threadIdx.x] = tile.start + threadIdx.x;
    __syncthreads();
    stage_few_rows(act, in_row, tile.count, inter, tiles_n, few_shared, sums);
    __syncthreads();
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const unsigned long long base = table_of_experts[tile.expert];
    const i64 last = hidden - 1;
    for (int k = 0; k < FEW_DOWN_TILES; ++k) {
        const i64 first =
            (((i64)blockIdx.x * FEW_DOWN_TILES + k) * FEW_WARPS + warp) * 16;
        if (first >= hidden) break;
        const WeightRow row_g = expert_row(DT_Q4, base, down, min(first + lane / 4, last), inter);
        const WeightRow row_g8 =
            expert_row(DT_Q4, base, down, min(first + lane / 4 + 8, last), inter);
        float acc[1][2][2] = {};
        if (few_quads_fit(row_g, down, groups)) {
            FewRows rows[1] = {FewRows(row_g, lane % 4)};
            if (tiles_n == 1) {
                few_quads<1, 1, FEW_DOWN_QUADS>(rows, few_shared, sums, groups, lane, acc);
            } else {
                few_quads<1, 2, FEW_DOWN_QUADS>(rows, few_shared, sums, groups, lane, acc);
            }
        } else {
            for (int g0 = 0; g0 < groups; g0 += FEW_DOWN_GROUPS) {
                TcPair batch[FEW_DOWN_GROUPS / 2];
                load_few_batch(batch, row_g, row_g8, g0, groups, lane % 4,
                               code_group_step(down));
#pragma unroll
                for (int j = 0; j < FEW_DOWN_GROUPS; ++j) {
                    if (g0 + j < groups) {
                        const TcGroup w[1] = {batch[j / 2].group(j % 2)};
                        mma_few_group(w, few_shared, sums, g0 + j, groups, tiles_n, lane, acc);
                    }
                }
            }
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const int j = nt * 4 + lane % 4;
            if (nt >= tiles_n || j >= tile.count) continue;
            const i64 slot = slots[tile.start + j];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const i64 r = first + lane / 4 + 8 * h;
                if (r < hidden) {
                    y[slot * hidden + r] =
                        acc[0][nt][h] + expert_down_bias(ffn, tile.expert, r, hidden);
                }
            }
        }
    }
#endif
}
