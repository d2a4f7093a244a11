// Routed experts of many tokens at once (prefill) on the tensor cores,
// grouped by expert: three launches per layer (or per group of experts
// when they are streamed) instead of a handful per expert.
//
// The host sorts the slots (token · top_k + rank) by expert, ascending,
// and cuts each expert's run of slots into tiles of at most MP_BN slots.
// A tile is four u32 {e, start, count, 0}: expert `table[e]`'s slots
// `slots[start .. start + count)`, which are rows start.. of `act`. Then
//   moe_prefill_gate_up_*: act[start + j, r] = expert_act(gate · x[token], up · x[token])
//   moe_prefill_down_*:    y[slot, r] = down · act[start + j] + down bias
//   moe_prefill_combine:   out[t] = Σ_k weights[t, k] · y[t · top_k + k], k in order
// Grids: (tiles, ceil(rows / rows per block)); a block reads its weight
// tile once for up to MP_BN slots of one expert. Nothing is accumulated
// across blocks, so the results do not depend on which experts came in
// the same launch (the streaming path launches a few experts at a time,
// a resident layer all of them; the outputs are identical).
//
// Numerics and data layout are gemm.cu's (see its header): activations
// split into two bf16 halves, quantized weights as centred integer codes
// with the affine map applied per 64-column group in f32, mma.sync
// m16n8k16 with f32 accumulation, a fresh accumulator per 64-column stage.
// Every output is the same sequence of operations whatever the tile it is
// in, so its error bound is gemm.cu's.
//
// Block: MP_THREADS = 4 warps over MP_BM = 128 shared weight rows × MP_BN =
// 32 slots; warp w owns 32 weight rows (two 16-row MMA tiles) × all 32
// slots (four 8-slot tiles). For gate/up the 128 rows are 64 rows of gate
// then the same 64 rows of up, and warp w takes rows 16w..16w+15 of each,
// so one thread holds gate and up of the same (row, slot) and applies
// silu(gate) · up in registers.

// MP_BM weight rows per block in shared memory, MP_BN slots per tile,
// MP_THREADS threads (4 warps, each 32 weight rows × 32 slots).
// Launch geometry comes from the host: compile.rs passes the constants of
// geometry.rs as -D options, so a launch and its kernel cannot disagree.
#if !defined(MP_BM) || !defined(MP_BN) || !defined(MP_THREADS)
#error "moe_prefill.cu: launch geometry missing (compile.rs passes geometry.rs as -D options)"
#endif

struct MoePrefillShared {
    u16 w[MP_BM][GEMM_LD];   // weights as bf16 (gemm.cu's column order)
    u16 hi[MP_BN][GEMM_LD];  // bf16(x)
    u16 lo[MP_BN][GEMM_LD];  // bf16(x - hi)
    float scale[MP_BM];      // the stage's group: scale of each row
    float bias[MP_BM];       // and bias + centre · scale
    float xsum[MP_BN];       // Σ x over the stage's columns, per slot
    int in_row[MP_BN];       // the input row of each slot of the tile, -1 past its end
};

// The weight matrices of a block: shared rows below `split` are rows
// r0.. of matrix 0, the others rows r0.. of matrix 1. `tiled`: both
// matrices' codes are tiled (moe.cu; gate and up have one shape, so
// they are stored alike).
struct MoeMatrices {
    const u8* codes[2];
    const u16* scales[2];
    const u16* biases[2];
    bool tiled;
};

// The weight matrices of an expert whose buffer starts at `base`: gate
// and up (GATE_UP), or down twice.
template <bool GATE_UP>
__device__ __forceinline__ MoeMatrices moe_matrices(const u8* base, ExpertPart pa,
                                                    ExpertPart pb) {
    const ExpertPart second = GATE_UP ? pb : pa;
    MoeMatrices m;
    m.codes[0] = base + pa.offset;
    m.scales[0] = (const u16*)(m.codes[0] + pa.scales);
    m.biases[0] = (const u16*)(m.codes[0] + pa.biases);
    m.codes[1] = base + second.offset;
    m.scales[1] = (const u16*)(m.codes[1] + second.scales);
    m.biases[1] = (const u16*)(m.codes[1] + second.biases);
    m.tiled = pa.tiled;
    return m;
}

// Block (blockIdx.x, blockIdx.y)'s work: tile blockIdx.x's expert, its
// matrices, its first sorted slot and slot count, and the first row of
// each matrix the block computes (shared rows below SPLIT are of matrix
// 0, the others of matrix 1).
template <bool GATE_UP>
struct MoeTile {
    static constexpr int SPLIT = GATE_UP ? MP_BM / 2 : MP_BM;
    u32 expert;
    int start, count, r0;
    MoeMatrices m;
    __device__ __forceinline__ MoeTile(const unsigned long long* table, const u32* tiles,
                                       ExpertPart pa, ExpertPart pb) {
        const u32* tile = tiles + 4 * (i64)blockIdx.x;
        expert = tile[0];
        start = (int)tile[1];
        count = (int)tile[2];
        r0 = blockIdx.y * SPLIT;
        m = moe_matrices<GATE_UP>((const u8*)table[expert], pa, pb);
    }
};

// The input row of slot j of a tile (its first sorted slot `start`,
// `count` slots): for gate/up the slot's token, for down its sorted
// position (act's row); -1 past the tile's end.
template <bool GATE_UP>
__device__ __forceinline__ int moe_input_row(const u32* slots, int start, int count, int top_k,
                                             int j) {
    if (j >= count) return -1;
    return GATE_UP ? (int)(slots[start + j] / (u32)top_k) : start + j;
}

#if __CUDA_ARCH__ >= 800

// The bf16 pair (q_a - centre, q_b - centre) of two codes at bits 0-1 or
// 0-2 (q_a) and 16-18 (q_b) of `v`: as q4_pair, 128 + q from the bits
// under an exponent of 2^7, then one exact fma subtracting 128 + centre.
template <int DT>
__device__ __forceinline__ u32 low_bit_pair(u32 v) {
    const u32 minus = DT == DT_Q2 ? 0xc302c302u : 0xc304c304u;  // -(128 + centre)
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n"
        : "=r"(r)
        : "r"(v | 0x43004300u), "r"(0x3f803f80u), "r"(minus));
    return r;
}

// A q2 or q3 group (its plane bytes `planes`, q3's high bits `high`) as 64
// bf16 centred codes in the shared column order: run m of 8 columns
// (8m .. 8m + 7) is plane m / 2 of bytes 8·(m % 2) .. + 7, and its pairs
// (c + k, c + k + 4) are byte k of the run's two words.
template <int DT>
__device__ __forceinline__ void store_low_bit_group(u16* dst, uint4 planes, uint2 high) {
    const u32 words[4] = {planes.x, planes.y, planes.z, planes.w};
    const u64 h = ((u64)high.y << 32) | high.x;
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        const int plane = m / 2;
        const u32 a = words[2 * (m % 2)], b = words[2 * (m % 2) + 1];
        const u32 hbits = (u32)(h >> (8 * m)) & 0xffu;  // columns 8m .. 8m + 7
        u32 out[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            // Byte k of a in bits 0-15, byte k of b in bits 16-31.
            const u32 pair = __byte_perm(a, b, k | (k << 4) | ((k + 4) << 8) | ((k + 4) << 12));
            u32 q = (pair >> (2 * plane)) & 0x00030003u;
            if (DT == DT_Q3) q |= (((hbits >> k) & 1u) << 2) | (((hbits >> (k + 4)) & 1u) << 18);
            out[k] = low_bit_pair<DT>(q);
        }
        store16(dst + 8 * m, make_uint4(out[0], out[1], out[2], out[3]));
    }
}

// A block of 32 MXFP4 codes (a 16-byte load) as bf16 values in the shared
// column order: each word is a run of 8 columns, nibble j column c + j, and
// the pairs (c + k, c + k + 4) its nibbles k and k + 4. e2m1 · 2^k has two
// significant bits, so the bf16 is the f32's upper half, exactly.
__device__ __forceinline__ void store_mxfp4_block(u16* dst, uint4 codes, float scale) {
    const u32 words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
    for (int run = 0; run < 4; ++run) {
        u32 out[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float a = e2m1_value((words[run] >> (4 * k)) & 15u) * scale;
            const float b = e2m1_value((words[run] >> (4 * k + 16)) & 15u) * scale;
            out[k] = bf16x2_exact(a, b);
        }
        store16(dst + 8 * run, make_uint4(out[0], out[1], out[2], out[3]));
    }
}

// One stage in flight between global and shared memory (gemm.cu's
// GemmStage for this block shape, with gathered input rows).
template <int DT>
struct MoeStage {
    static constexpr bool LOW_BIT = DT == DT_Q2 || DT == DT_Q3;
    // 16-byte vectors of a row's stage; a q3 stage is its 16 plane bytes
    // (read as two 8-byte halves: q3 groups are 8-byte aligned) and
    // `high`, the group's 8 bytes of high bits.
    // MXFP4 rows are values (exact in bf16), like bf16 ones: a vector is
    // one block of 32 codes, `exponents` its power of two.
    static_assert(DT != DT_Q4, "q4 experts take the pipelined kernels below");
    static constexpr int ROW_VECS = LOW_BIT ? 1 : DT == DT_MXFP4 ? 2 : DT == DT_Q8 ? 4 : 8;
    static constexpr int VECS = MP_BM * ROW_VECS / MP_THREADS;
    static constexpr int VEC_COLS = GEMM_BK / ROW_VECS;
    static constexpr float CENTRE = DT == DT_Q2 ? 2.0f : DT == DT_Q3 ? 4.0f : 128.0f;
    static constexpr bool QUANTIZED = LOW_BIT || DT == DT_Q8;
    // Runs of 8 activations per thread: slots tid/8 + 16·j, columns
    // 8·(tid%8)..+7 of the stage.
    static constexpr int RUNS = MP_BN * 8 / MP_THREADS;

    uint4 w[VECS];
    uint2 high[VECS];
    u8 exponents[VECS];
    float4 x[RUNS][2];
    u16 scale, bias;  // shared row tid's, quantized only

    // Reads the stage starting at column k0; what lies outside the
    // matrices or past the tile's slots reads as zero.
    __device__ __forceinline__ void load(const MoeMatrices& m, int split, const float* x_in,
                                         const int* in_row, int rows, int cols, int r0,
                                         int k0) {
        const int tid = threadIdx.x;
        const i64 row_bytes = ::row_bytes(DT, cols);
        const int k0_bytes = (int)::row_bytes(DT, k0);
#pragma unroll
        for (int j = 0; j < VECS; ++j) {
            const int i = tid + j * MP_THREADS;
            const int row = i / ROW_VECS, part = i % ROW_VECS;
            const bool second = row >= split;
            const int r = r0 + row - (second ? split : 0);
            const u8* codes = second ? m.codes[1] : m.codes[0];
            const bool inside = r < rows && k0 + part * VEC_COLS < cols;
            const u8* p = codes + r * row_bytes + k0_bytes + part * 16;
            if (DT == DT_Q3) {
                const uint2 zero = make_uint2(0, 0);
                const uint2 a = inside ? *(const uint2*)p : zero;
                const uint2 b = inside ? *(const uint2*)(p + 8) : zero;
                high[j] = inside ? *(const uint2*)(p + 16) : zero;
                w[j] = make_uint4(a.x, a.y, b.x, b.y);
            } else {
                w[j] = inside ? *(const uint4*)p : make_uint4(0, 0, 0, 0);
                high[j] = make_uint2(0, 0);
            }
            if (DT == DT_MXFP4) {
                const u8* e = (const u8*)(second ? m.scales[1] : m.scales[0]);
                exponents[j] =
                    inside ? e[(i64)r * (cols / MXFP4_BLOCK) + (k0 + part * VEC_COLS) / MXFP4_BLOCK]
                           : 0;
            }
        }
#pragma unroll
        for (int j = 0; j < RUNS; ++j) {
            const int token = tid / 8 + (MP_THREADS / 8) * j;
            const int c = k0 + 8 * (tid % 8);
            const int src = in_row[token];
            if (src >= 0 && c < cols) {
                const float4* p = (const float4*)(x_in + (i64)src * cols + c);
                x[j][0] = p[0];
                x[j][1] = p[1];
            } else {
                x[j][0] = x[j][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
        if (QUANTIZED) {
            scale = bias = 0;
            const bool second = tid >= split;
            const int r = r0 + tid - (second ? split : 0);
            if (tid < MP_BM && r < rows) {
                const i64 at = (i64)r * (cols / GROUP_SIZE) + k0 / GROUP_SIZE;
                scale = (second ? m.scales[1] : m.scales[0])[at];
                bias = (second ? m.biases[1] : m.biases[0])[at];
            }
        }
    }

    // Converts the stage to bf16 in shared memory, with the group's
    // parameters and activation sums (as GemmStage::store).
    __device__ __forceinline__ void store(MoePrefillShared& sm) const {
        const int tid = threadIdx.x;
#pragma unroll
        for (int j = 0; j < VECS; ++j) {
            const int i = tid + j * MP_THREADS;
            const int row = i / ROW_VECS, part = i % ROW_VECS;
            u16* dst = &sm.w[row][part * VEC_COLS];
            if (LOW_BIT) {
                store_low_bit_group<DT>(dst, w[j], high[j]);
            } else if (DT == DT_MXFP4) {
                store_mxfp4_block(dst, w[j], e8m0_scale(exponents[j]));
            } else {
                store_weight_chunk<DT>(dst, w[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < RUNS; ++j) {
            const int token = tid / 8 + (MP_THREADS / 8) * j;
            const int col = 8 * (tid % 8);
            store_activation_run<QUANTIZED>(sm, token, col, x[j][0], x[j][1]);
        }
        if (QUANTIZED && tid < MP_BM) {
            const float s = bf16_to_float(scale);
            sm.scale[tid] = s;
            sm.bias[tid] = fmaf(CENTRE, s, bf16_to_float(bias));
        }
    }
};

// The shared row where warp `warp`'s MMA tile `mi` starts.
template <bool GATE_UP>
__device__ __forceinline__ int moe_tile_row(int warp, int mi) {
    return GATE_UP ? mi * (MP_BM / 2) + 16 * warp : 32 * warp + 16 * mi;
}

// y[slot, r] = down · act + down bias from a down block's accumulators:
// warp w's rows r0 + 32·w + 16·mi + g (+ 8), the tile's slots
// 8·nj + 2·i4 (+ 1) (sorted positions start.., `slots` their slot numbers).
__device__ __forceinline__ void store_down_tile(const float (&acc)[2][4][4], float* out,
                                                const u32* slots, int start, int count, int r0,
                                                int rows, u32 expert, const ExpertFfn& ffn) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int g = lane / 4, i4 = lane % 4;
#pragma unroll
    for (int nj = 0; nj < 4; ++nj) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int t = 8 * nj + 2 * i4 + e % 2;
            if (t >= count) continue;
            const i64 slot = slots[start + t];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const int r = r0 + 32 * warp + 16 * mi + g + 8 * (e / 2);
                if (r < rows) {
                    out[slot * rows + r] = acc[mi][nj][e] + expert_down_bias(ffn, expert, r, rows);
                }
            }
        }
    }
}

#endif  // __CUDA_ARCH__ >= 800

// One block: tile blockIdx.x (none past *tile_count when the tiles were
// made on the device, moe_few.cu), weight rows from blockIdx.y. GATE_UP: x is
// the layer input [n, cols], `a` gate and `b` up ([rows, cols] each),
// out is act [slots, rows] indexed by sorted position. Otherwise x is act
// [slots, cols] by sorted position, `a` down [rows, cols] (b unused), out
// is y [n · top_k, rows] indexed by slot.
template <int DT, bool GATE_UP>
__device__ __forceinline__ void moe_prefill_tc(const unsigned long long* __restrict__ table,
                                               const u32* __restrict__ tiles,
                                               const u32* __restrict__ tile_count,
                                               const u32* __restrict__ slots,
                                               const float* __restrict__ x,
                                               float* __restrict__ out, int rows, int cols,
                                               int top_k, ExpertPart pa, ExpertPart pb,
                                               ExpertFfn ffn) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) MoePrefillShared sm;
    if (tile_count && blockIdx.x >= *tile_count) return;
    const MoeTile<GATE_UP> tile(table, tiles, pa, pb);
    const int start = tile.start, count = tile.count, r0 = tile.r0, split = tile.SPLIT;
    const MoeMatrices& m = tile.m;
    const int tid = threadIdx.x;
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int g = lane / 4, i4 = lane % 4;
    if (tid < MP_BN) sm.in_row[tid] = moe_input_row<GATE_UP>(slots, start, count, top_k, tid);
    __syncthreads();

    // 8-slot tiles holding slots of the tile (block-uniform): the MMAs of
    // the others are skipped.
    const int tiles_n = min(4, (count + 7) / 8);

    // acc[mi][nj]: shared rows moe_tile_row(warp, mi) (+ g, + g+8), slots
    // 8·nj (+ 2·i4, +1), in the C fragment's order.
    float acc[2][4][4] = {};

    MoeStage<DT> stage;
    const int stages = (cols + GEMM_BK - 1) / GEMM_BK;
    stage.load(m, split, x, sm.in_row, rows, cols, r0, 0);
    stage.store(sm);
    __syncthreads();
    const int rows_of_warp[2] = {moe_tile_row<GATE_UP>(warp, 0),
                                 moe_tile_row<GATE_UP>(warp, 1)};
    for (int s = 0; s < stages; ++s) {
        if (s + 1 < stages) {
            stage.load(m, split, x, sm.in_row, rows, cols, r0, (s + 1) * GEMM_BK);
        }
        mma_stage<MoeStage<DT>::QUANTIZED>(sm, rows_of_warp, 0, tiles_n, acc);
        __syncthreads();  // every warp is done reading the stage
        if (s + 1 < stages) {
            stage.store(sm);
            __syncthreads();
        }
    }

    if (GATE_UP) {
        // acc[0] is gate, acc[1] up, of the same rows and slots.
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = r0 + 16 * warp + g + 8 * (e / 2);
                const int t = 8 * nj + 2 * i4 + e % 2;
                if (r < rows && t < count) {
                    out[(i64)(start + t) * rows + r] =
                        expert_act(ffn, tile.expert, r, rows, acc[0][nj][e], acc[1][nj][e]);
                }
            }
        }
    } else {
        store_down_tile(acc, out, slots, start, count, r0, rows, tile.expert, ffn);
    }
#endif  // __CUDA_ARCH__ >= 800
}

// The kernels of the other types (one pair per stored type; q4's come
// after them). Grids: gate/up
// (tiles, ceil(inter / 64)), down (tiles, ceil(hidden / 128)), `tiles` the
// most there can be when tile_count is given (null: all); MP_THREADS
// threads; static shared memory (29 KiB). The quantized types have whole
// 64-column groups; bf16 needs widths that are multiples of 8. sm_80+.
#define MOE_PREFILL_PARAMS                                                                 \
    const unsigned long long *table, const u32 *tiles, const u32 *tile_count,             \
        const u32 *slots, const float *x, float *out, int rows, int cols, int top_k,       \
        ExpertPart a, ExpertPart b, ExpertFfn ffn
#define MOE_PREFILL_ARGS table, tiles, tile_count, slots, x, out, rows, cols, top_k, a, b, ffn

extern "C" __global__ void __launch_bounds__(MP_THREADS, 3)
    moe_prefill_gate_up_q8(MOE_PREFILL_PARAMS) {
    await_inputs();
    moe_prefill_tc<DT_Q8, true>(MOE_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(MP_THREADS, 3)
    moe_prefill_gate_up_bf16(MOE_PREFILL_PARAMS) {
    await_inputs();
    moe_prefill_tc<DT_BF16, true>(MOE_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(MP_THREADS, 3)
    moe_prefill_gate_up_q3(MOE_PREFILL_PARAMS) {
    await_inputs();
    moe_prefill_tc<DT_Q3, true>(MOE_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(MP_THREADS, 3)
    moe_prefill_gate_up_q2(MOE_PREFILL_PARAMS) {
    await_inputs();
    moe_prefill_tc<DT_Q2, true>(MOE_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(MP_THREADS, 3)
    moe_prefill_down_q3(MOE_PREFILL_PARAMS) {
    await_inputs();
    moe_prefill_tc<DT_Q3, false>(MOE_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(MP_THREADS, 3)
    moe_prefill_down_q2(MOE_PREFILL_PARAMS) {
    await_inputs();
    moe_prefill_tc<DT_Q2, false>(MOE_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(MP_THREADS, 3)
    moe_prefill_gate_up_mxfp4(MOE_PREFILL_PARAMS) {
    await_inputs();
    moe_prefill_tc<DT_MXFP4, true>(MOE_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(MP_THREADS, 3)
    moe_prefill_down_mxfp4(MOE_PREFILL_PARAMS) {
    await_inputs();
    moe_prefill_tc<DT_MXFP4, false>(MOE_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(MP_THREADS, 3)
    moe_prefill_down_q8(MOE_PREFILL_PARAMS) {
    await_inputs();
    moe_prefill_tc<DT_Q8, false>(MOE_PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(MP_THREADS, 3)
    moe_prefill_down_bf16(MOE_PREFILL_PARAMS) {
    await_inputs();
    moe_prefill_tc<DT_BF16, false>(MOE_PREFILL_ARGS);
}

// ---- q4: stages copied asynchronously, codes widened in registers ----
//
// q4 experts (the format prefill mostly meets) take kernels whose stages
// never pass through registers, so a block keeps MP_STAGES of them in
// flight and holds only its accumulators:
// - the activations come split already (split_activations below; gate/up
//   writes act split for down): hi and lo bf16 rows in gemm.cu's column
//   order and Σx per 64-column group (split_run, as the other kernels
//   stage them); a stage copies the rows of its tile's slots as they are;
// - the codes are copied as stored, 32 bytes a row per stage, and each
//   warp widens the codes of its own A fragments to bf16 (q4_pair) right
//   before its MMAs: lane (g, i) needs, of rows g and g + 8, the pair of
//   columns (c + i, c + i + 4) of each run of 8 columns, which q4_pair
//   takes from the run's 32-bit word shifted by 4·i;
// - the rows' scales and biases are read a stage ahead into registers and
//   stored the stage after, so their loads overlap a stage of MMAs.
// The products are mma_stage_with's, the same operations as the other
// types' kernels; only how the operands reach the tensor cores differs.
// One __syncthreads per stage: it makes stage s visible and frees the
// buffer of stage s - 1 for the copies of stage s + MP_STAGES - 1.
#if !defined(MP_STAGES) || !defined(MP_Q4_STAGE_BYTES)
#error "moe_prefill.cu: q4 pipeline geometry missing (geometry.rs)"
#endif

// Blocks per multiprocessor the q4 kernels' registers are bounded for
// (a tuning define: 4 caps them at 128 registers, which spills).
#ifndef MP_Q4_MIN_BLOCKS
#define MP_Q4_MIN_BLOCKS 3
#endif

// Bytes of a staged q4 row: the stage's 32 bytes of codes and 16 of
// padding, so the 8-byte reads of one fragment's eight rows (48 bytes
// apart) fall in distinct banks.
#define MQ_ROW_BYTES 48

// Activations split for the tensor cores, as the q4 kernels read them:
// `hi`, `lo` [rows, cols] bf16 in gemm.cu's column order and `sums`
// [rows, cols / 64] f32, Σx over each group of 64 columns.
struct SplitRows {
    u16* hi;
    u16* lo;
    float* sums;
};

struct MoeQ4Stage {
    u8 w[MP_BM][MQ_ROW_BYTES];  // codes as stored
    u16 hi[MP_BN][GEMM_LD];      // the tile's slots' activations, split
    u16 lo[MP_BN][GEMM_LD];
    float scale[MP_BM];  // each row's scale, and bias + 8 · scale
    float bias[MP_BM];
    float xsum[MP_BN];  // Σx of each slot over the stage's columns
};
static_assert(sizeof(MoeQ4Stage) == MP_Q4_STAGE_BYTES,
              "geometry.rs's MP_Q4_STAGE_BYTES must be the size of MoeQ4Stage");
static_assert(MP_STAGES >= 3, "scales are stored one stage after they are read");
static_assert(MP_THREADS == MP_BM, "a thread reads one row's scale and bias");
static_assert(MP_BM / 2 == GROUP_SIZE, "a gate/up block makes one group of act's columns");

// x [rows, cols] split (SplitRows); cols a multiple of 64 (gemm.cu's
// for_each_run's runs).
extern "C" __global__ void split_activations(const float* x, SplitRows out, int rows, int cols) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    const int lane = threadIdx.x % WARP_SIZE;
    for_each_run(x, rows, cols, [&](i64 i, bool inside, float4 a, float4 b) {
        uint4 hi, lo;
        const float s = split_run<true>(a, b, hi, lo);
        if (inside) {
            store16(out.hi + 8 * i, hi);
            store16(out.lo + 8 * i, lo);
            if (lane % 8 == 0) out.sums[i / 8] = s;
        }
    });
#endif
}

#if __CUDA_ARCH__ >= 800

// The q4 kernels' body. GATE_UP: x is the layer input split, `a` gate and
// `b` up; act (written) is silu(gate)·up split, by sorted position.
// Otherwise x is act split, `a` down (b unused), and out is y
// [n · top_k, rows] by slot. Dynamic shared memory: MP_STAGES stages.
template <bool GATE_UP>
__device__ __forceinline__ void moe_prefill_q4(const unsigned long long* __restrict__ table,
                                               const u32* __restrict__ tiles,
                                               const u32* __restrict__ tile_count,
                                               const u32* __restrict__ slots, SplitRows x,
                                               float* __restrict__ out, SplitRows act,
                                               int rows, int cols, int top_k, ExpertPart pa,
                                               ExpertPart pb, ExpertFfn ffn) {
    extern __shared__ __align__(16) u8 moe_q4_shared[];
    MoeQ4Stage* stages = (MoeQ4Stage*)moe_q4_shared;
    __shared__ int in_row[MP_BN];
    __shared__ float warp_sums[MP_THREADS / WARP_SIZE][MP_BN];
    if (tile_count && blockIdx.x >= *tile_count) return;
    const MoeTile<GATE_UP> tile(table, tiles, pa, pb);
    const int start = tile.start, count = tile.count, r0 = tile.r0, split = tile.SPLIT;
    const MoeMatrices& m = tile.m;
    const int tid = threadIdx.x;
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int g = lane / 4, i4 = lane % 4;
    if (tid < MP_BN) in_row[tid] = moe_input_row<GATE_UP>(slots, start, count, top_k, tid);
    __syncthreads();

    const int groups = cols / GROUP_SIZE;  // = stages
    const i64 row_bytes = cols / 2;
    // What this thread copies, worked out once (a stage moves each source
    // along its row): codes of shared rows tid / 2 and tid / 2 + 64 (half
    // `tid % 2` of the stage's 32 bytes); activation pieces tid % 8 of
    // slots tid / 16 + 8·j, hi or lo by (tid / 8) % 2; Σx of slot tid; the
    // scale and bias of shared row tid. An invalid source is copied as
    // zeros: its pointer moves along as the others do, never read.
    const u8* codes_from[2];
    bool codes_valid[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int row = tid / 2 + (MP_BM / 2) * j;
        const bool second = row >= split;
        const int r = r0 + row - (second ? split : 0);
        codes_valid[j] = r < rows;
        codes_from[j] = code_row(second ? m.codes[1] : m.codes[0], codes_valid[j] ? r : 0,
                                 row_bytes, m.tiled) +
                        16 * (tid % 2);
    }
    const int group_step = code_step(m.tiled);
    const bool low = (tid / 8) % 2;
    const u16* act_from[MP_BN / 8];
    bool act_valid[MP_BN / 8];
#pragma unroll
    for (int j = 0; j < MP_BN / 8; ++j) {
        const int src = in_row[tid / 16 + 8 * j];
        act_valid[j] = src >= 0;
        act_from[j] = (low ? x.lo : x.hi) + (act_valid[j] ? (i64)src * cols + 8 * (tid % 8) : 0);
    }
    const int sum_src = tid < MP_BN ? in_row[tid] : -1;
    const float* sum_from = x.sums + (sum_src >= 0 ? (i64)sum_src * groups : 0);
    const u16 *scale_from, *bias_from;
    bool params_valid;
    {
        const bool second = tid >= split;
        const int r = r0 + tid - (second ? split : 0);
        params_valid = r < rows;
        const i64 at = params_valid ? (i64)r * groups : 0;
        scale_from = (second ? m.scales[1] : m.scales[0]) + at;
        bias_from = (second ? m.biases[1] : m.biases[0]) + at;
    }
    static_assert(2 * MP_BM / MP_THREADS == 2 && 16 * MP_BN / MP_THREADS == MP_BN / 8,
                  "the copies' layout above");
    // Queues the copies of stage s (none past the last) and closes the group.
    const auto issue = [&](int s) {
        if (s < groups) {
            MoeQ4Stage& st = stages[s % MP_STAGES];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                copy_async16(&st.w[tid / 2 + (MP_BM / 2) * j][16 * (tid % 2)],
                             codes_from[j] + group_step * s, codes_valid[j]);
            }
#pragma unroll
            for (int j = 0; j < MP_BN / 8; ++j) {
                u16* dst = low ? st.lo[tid / 16 + 8 * j] : st.hi[tid / 16 + 8 * j];
                copy_async16(dst + 8 * (tid % 8), act_from[j] + GEMM_BK * s, act_valid[j]);
            }
            if (tid < MP_BN) copy_async4(&st.xsum[tid], sum_from + s, sum_src >= 0);
        }
        copy_async_commit();
    };
    // Row tid's scale and bias of stage s (zero past the matrix or the stages).
    const auto read_params = [&](int s, u16& scale, u16& bias) {
        scale = bias = 0;
        if (s < groups && params_valid) {
            scale = __ldg(scale_from + s);
            bias = __ldg(bias_from + s);
        }
    };
    const auto store_params = [&](int s, u16 scale, u16 bias) {
        MoeQ4Stage& st = stages[s % MP_STAGES];
        const float f = bf16_to_float(scale);
        st.scale[tid] = f;
        st.bias[tid] = fmaf(8.0f, f, bf16_to_float(bias));
    };

    const int tiles_n = min(4, (count + 7) / 8);
    const int rows_of_warp[2] = {moe_tile_row<GATE_UP>(warp, 0),
                                 moe_tile_row<GATE_UP>(warp, 1)};
    float acc[2][4][4] = {};
    // The first stages' parameters are all read before any is stored.
    u16 first_scales[MP_STAGES - 1], first_biases[MP_STAGES - 1];
#pragma unroll
    for (int s = 0; s < MP_STAGES - 1; ++s) {
        issue(s);
        read_params(s, first_scales[s], first_biases[s]);
    }
#pragma unroll
    for (int s = 0; s < MP_STAGES - 1; ++s) store_params(s, first_scales[s], first_biases[s]);
    u16 next_scale = 0, next_bias = 0;  // of stage s + MP_STAGES - 2
    for (int s = 0; s < groups; ++s) {
        copy_async_wait<MP_STAGES - 2>();
        __syncthreads();
        if (s > 0) store_params(s + MP_STAGES - 2, next_scale, next_bias);
        issue(s + MP_STAGES - 1);
        read_params(s + MP_STAGES - 1, next_scale, next_bias);
        const MoeQ4Stage& st = stages[s % MP_STAGES];
        mma_stage_with<true>(
            st,
            [&](int mi, int k, u32(&a)[4]) {
                const u8* top = &st.w[rows_of_warp[mi] + g][k / 2];
                const uint2 t = *(const uint2*)top;                      // row g
                const uint2 b = *(const uint2*)(top + 8 * MQ_ROW_BYTES);  // row g + 8
                const int shift = 4 * i4;
                a[0] = q4_pair(t.x >> shift);
                a[1] = q4_pair(b.x >> shift);
                a[2] = q4_pair(t.y >> shift);
                a[3] = q4_pair(b.y >> shift);
            },
            rows_of_warp, 0, tiles_n, acc);
    }
    copy_async_wait<0>();

    if (GATE_UP) {
        // acc[0] is gate, acc[1] up, of rows r0 + 16·warp + g (+ 8). act's
        // column r sits at position 2·(r % 4) + (r / 4) % 2 of its run of 8.
        float sums[4][2] = {};
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = r0 + 16 * warp + g + 8 * (e / 2);
                const int t = 8 * nj + 2 * i4 + e % 2;
                if (r < rows && t < count) {
                    const float v =
                        expert_act(ffn, tile.expert, r, rows, acc[0][nj][e], acc[1][nj][e]);
                    u32 hi, lo;
                    split_pair(v, 0.0f, hi, lo);
                    const i64 at =
                        (i64)(start + t) * rows + (r & ~7) + 2 * (r & 3) + ((r >> 2) & 1);
                    act.hi[at] = (u16)hi;
                    act.lo[at] = (u16)lo;
                    sums[nj][e % 2] += v;
                }
            }
        }
        // Σ over the block's 64 rows (one group of down's columns) per slot:
        // over g in the warp, then over the warps in order.
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float v = sums[nj][e];
                v += __shfl_xor_sync(FULL_MASK, v, 4);
                v += __shfl_xor_sync(FULL_MASK, v, 8);
                v += __shfl_xor_sync(FULL_MASK, v, 16);
                if (g == 0) warp_sums[warp][8 * nj + 2 * i4 + e] = v;
            }
        }
        __syncthreads();
        if (tid < count) {
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < MP_THREADS / WARP_SIZE; ++w) v += warp_sums[w][tid];
            act.sums[(i64)(start + tid) * (rows / GROUP_SIZE) + blockIdx.y] = v;
        }
    } else {
        store_down_tile(acc, out, slots, start, count, r0, rows, tile.expert, ffn);
    }
}

#endif  // __CUDA_ARCH__ >= 800

// The q4 kernels. Grids as the other types'; MP_THREADS threads;
// MP_STAGES · MP_Q4_STAGE_BYTES of dynamic shared memory. sm_80+.
// ROWS: how the kernels take their activations (SplitRows, or the int8
// kernels' Q8Rows below).
#define MOE_Q4_PARAMS(ROWS)                                                           \
    const unsigned long long *table, const u32 *tiles, const u32 *tile_count,         \
        const u32 *slots, ROWS x, float *out, ROWS act, int rows, int cols,            \
        int top_k, ExpertPart a, ExpertPart b, ExpertFfn ffn
#define MOE_Q4_ARGS table, tiles, tile_count, slots, x, out, act, rows, cols, top_k, a, b, ffn

extern "C" __global__ void __launch_bounds__(MP_THREADS, MP_Q4_MIN_BLOCKS)
    moe_prefill_gate_up_q4(MOE_Q4_PARAMS(SplitRows)) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    moe_prefill_q4<true>(MOE_Q4_ARGS);
#endif
}

extern "C" __global__ void __launch_bounds__(MP_THREADS, MP_Q4_MIN_BLOCKS)
    moe_prefill_down_q4(MOE_Q4_PARAMS(SplitRows)) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    moe_prefill_q4<false>(MOE_Q4_ARGS);
#endif
}

// ---- q4 with int8 activations (CudaOptions::activations = Int8) ----
//
// The q4 kernels' tiles and grids with the products of gemm.cu's int8
// section (i8_products: the activations quantized per group of 64 inputs
// as the CPU's int8 activations are, the integer tensor cores); gate/up
// writes act quantized the same way for down (quantize_activations_q4's
// layout and parameters).

#if !defined(MP_I8_STAGE_BYTES)
#error "moe_prefill.cu: int8 stage size missing (geometry.rs)"
#endif

#if __CUDA_ARCH__ >= 800

typedef I8Stage<MP_BM, MP_BN> MoeI8Stage;
static_assert(sizeof(MoeI8Stage) == MP_I8_STAGE_BYTES,
              "geometry.rs's MP_I8_STAGE_BYTES must be the size of I8Stage<MP_BM, MP_BN>");

// The int8 kernels' body. GATE_UP: x is the layer input quantized, `a`
// gate and `b` up; act (written) is silu(gate)·up quantized, by sorted
// position. Otherwise x is act, `a` down (b unused), and out is y
// [n · top_k, rows] by slot. Dynamic shared memory: I8_STAGES stages.
template <bool GATE_UP>
__device__ __forceinline__ void moe_prefill_q4_i8(const unsigned long long* __restrict__ table,
                                                  const u32* __restrict__ tiles,
                                                  const u32* __restrict__ tile_count,
                                                  const u32* __restrict__ slots, Q8Rows x,
                                                  float* __restrict__ out, Q8Rows act, int rows,
                                                  int cols, int top_k, ExpertPart pa,
                                                  ExpertPart pb, ExpertFfn ffn) {
    extern __shared__ __align__(16) u8 moe_i8_shared[];
    MoeI8Stage* stages = (MoeI8Stage*)moe_i8_shared;
    __shared__ int in_row[MP_BN];
    __shared__ float warp_max[MP_THREADS / WARP_SIZE][MP_BN];
    __shared__ float warp_sums[MP_THREADS / WARP_SIZE][MP_BN];
    __shared__ int warp_codes[MP_THREADS / WARP_SIZE][MP_BN];
    if (tile_count && blockIdx.x >= *tile_count) return;
    const MoeTile<GATE_UP> tile(table, tiles, pa, pb);
    const int start = tile.start, count = tile.count, r0 = tile.r0, split = tile.SPLIT;
    const MoeMatrices& m = tile.m;
    const int tid = threadIdx.x;
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int g = lane / 4, i4 = lane % 4;
    if (tid < MP_BN) in_row[tid] = moe_input_row<GATE_UP>(slots, start, count, top_k, tid);
    __syncthreads();

    const int groups = cols / GROUP_SIZE;  // = stages
    const i64 row_bytes = cols / 2;
    // gemm.cu's I8Sources: codes of shared rows tid / 2 and tid / 2 + 64
    // (below `split` of matrix 0, the others of matrix 1), the activations
    // and params of the tile's slots by their input rows.
    I8Sources<MP_BM, MP_BN, MP_THREADS> src;
#pragma unroll
    for (int j = 0; j < I8Sources<MP_BM, MP_BN, MP_THREADS>::CODE_PIECES; ++j) {
        const int p = tid + MP_THREADS * j;
        const int row = p / 2;
        const bool second = row >= split;
        const int r = r0 + row - (second ? split : 0);
        src.codes_valid[j] = r < rows;
        src.codes[j] = code_row(second ? m.codes[1] : m.codes[0], r < rows ? r : 0, row_bytes,
                                m.tiled) +
                       16 * (p % 2);
    }
    src.code_step = code_step(m.tiled);
    const int act_src = in_row[tid / 4];
    src.act_valid = act_src >= 0;
    src.act = x.codes + (act_src >= 0 ? (i64)act_src * cols + 16 * (tid % 4) : 0);
    const int param_src = tid < MP_BN ? in_row[tid] : -1;
    src.params_valid = param_src >= 0;
    src.params = x.params + (param_src >= 0 ? (i64)param_src * groups : 0);
    {
        const bool second = tid >= split;
        const int r = r0 + tid - (second ? split : 0);
        src.row_valid = r < rows;
        const i64 at = src.row_valid ? (i64)r * groups : 0;
        src.scale = (second ? m.scales[1] : m.scales[0]) + at;
        src.bias = (second ? m.biases[1] : m.biases[0]) + at;
    }

    const int tiles_n = min(4, (count + 7) / 8);
    const int rows_of_warp[2] = {moe_tile_row<GATE_UP>(warp, 0),
                                 moe_tile_row<GATE_UP>(warp, 1)};
    float acc[2][4][4] = {};
    i8_products<MP_BM, MP_BN, MP_THREADS, I8_STAGES>(stages, src, 0, groups, rows_of_warp, 0,
                                                    tiles_n, acc);

    if (GATE_UP) {
        // acc[0] is gate, acc[1] up, of rows r0 + 16·warp + g (+ 8): the
        // block's 64 rows are group blockIdx.y of act's columns, quantized
        // per slot as quantize_activations_q4 does.
        float v[4][4];
        float peak[4][2] = {}, sum[4][2] = {};
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = r0 + 16 * warp + g + 8 * (e / 2);
                const int t = 8 * nj + 2 * i4 + e % 2;
                v[nj][e] = r < rows && t < count ? expert_act(ffn, tile.expert, r, rows,
                                                              acc[0][nj][e], acc[1][nj][e])
                                                 : 0.0f;
                peak[nj][e % 2] = fmaxf(peak[nj][e % 2], fabsf(v[nj][e]));
                sum[nj][e % 2] += v[nj][e];
            }
        }
        // Each slot's max and Σ over the block's rows: over g in the warp,
        // then over the warps in order.
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float mx = peak[nj][e], s = sum[nj][e];
#pragma unroll
                for (int o = 4; o < WARP_SIZE; o *= 2) {
                    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
                    s += __shfl_xor_sync(FULL_MASK, s, o);
                }
                if (g == 0) {
                    warp_max[warp][8 * nj + 2 * i4 + e] = mx;
                    warp_sums[warp][8 * nj + 2 * i4 + e] = s;
                }
            }
        }
        __syncthreads();
        int qsum[4][2] = {};
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int t = 8 * nj + 2 * i4 + e;
                float mx = 0.0f;
#pragma unroll
                for (int w = 0; w < MP_THREADS / WARP_SIZE; ++w) mx = fmaxf(mx, warp_max[w][t]);
                const float inv = q8_inverse_step(mx);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = r0 + 16 * warp + g + 8 * h;
                    const int q = __float2int_rn(v[nj][2 * h + e] * inv);
                    qsum[nj][e] += q;
                    if (r < rows && t < count) {
                        act.codes[(i64)(start + t) * rows + (r & ~63) + q8_position(r & 63)] =
                            (u8)q;
                    }
                }
                int qs = qsum[nj][e];
#pragma unroll
                for (int o = 4; o < WARP_SIZE; o *= 2) qs += __shfl_xor_sync(FULL_MASK, qs, o);
                if (g == 0) warp_codes[warp][t] = qs;
            }
        }
        __syncthreads();
        if (tid < count) {
            float mx = 0.0f, s = 0.0f;
            int qs = 0;
#pragma unroll
            for (int w = 0; w < MP_THREADS / WARP_SIZE; ++w) {
                mx = fmaxf(mx, warp_max[w][tid]);
                s += warp_sums[w][tid];
                qs += warp_codes[w][tid];
            }
            act.params[(i64)(start + tid) * (rows / GROUP_SIZE) + blockIdx.y] =
                q8_params(mx, s, qs);
        }
    } else {
        store_down_tile(acc, out, slots, start, count, r0, rows, tile.expert, ffn);
    }
}

#endif  // __CUDA_ARCH__ >= 800

// The int8 kernels: grids as the q4 ones'; MP_THREADS threads;
// I8_STAGES · MP_I8_STAGE_BYTES of dynamic shared memory. sm_80+.

extern "C" __global__ void __launch_bounds__(MP_THREADS, MP_Q4_MIN_BLOCKS)
    moe_prefill_gate_up_q4_i8(MOE_Q4_PARAMS(Q8Rows)) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    moe_prefill_q4_i8<true>(MOE_Q4_ARGS);
#endif
}

extern "C" __global__ void __launch_bounds__(MP_THREADS, MP_Q4_MIN_BLOCKS)
    moe_prefill_down_q4_i8(MOE_Q4_PARAMS(Q8Rows)) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    moe_prefill_q4_i8<false>(MOE_Q4_ARGS);
#endif
}

// out[t, c] (+)= Σ_k weights[t · top_k + k] · y[t · top_k + k, c], k in
// order (as moe_down sums one token's experts); with `accumulate` added to
// out. Grid-stride over n · hidden.
extern "C" __global__ void moe_prefill_combine(const float* y, const float* weights,
                                               float* out, int n, int hidden, int top_k,
                                               int accumulate) {
    await_inputs();
    const i64 total = (i64)n * hidden;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / hidden;
        const i64 c = i % hidden;
        const float* w = weights + t * top_k;
        const float* ys = y + t * top_k * hidden + c;
        float s = 0.0f;
        for (int k = 0; k < top_k; ++k) s = fmaf(w[k], ys[(i64)k * hidden], s);
        out[i] = accumulate ? out[i] + s : s;
    }
}
