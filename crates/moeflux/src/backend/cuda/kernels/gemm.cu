// Tensor-core products `x · wᵀ` for many tokens at once (prefill):
// out[t, r] = Σ_c x[t, c] · w[r, c] for x f32 [n, cols] and w stored as q4,
// q8 or bf16 [rows, cols]; out is f32 [n, rows]. gemm.rs decides when these
// run instead of linear.cu's kernels.
//
// Accuracy (the results must stay within f32 rounding of the CPU's exact
// f32 sums) comes from keeping every operand exact or nearly so:
// - activations are split x = hi + lo with hi = bf16(x) and lo = bf16(x - hi)
//   (both rounded to nearest): 16 significant bits, |x - hi - lo| ≤ 2^-17 |x|.
//   Each step runs two MMAs, (w, hi) and (w, lo), into one f32 accumulator;
// - q4 and q8 weights enter the MMAs as their integer codes, centred (q - 8,
//   q - 128: exact in bf16), and the affine map is applied per 64-column
//   group in f32:  Σ w·x = scale · Σ (q - c)·x + (bias + c·scale) · Σ x
//   (c·scale is exact, c being a power of two). Centring keeps the
//   integer sums, and so their rounding, near the size of Σ |w·x|;
// - bf16 weights are exact as they are.
// The MMA products are exact; the tensor cores accumulate in f32. Each
// 64-column stage accumulates into fresh registers that are then added to
// the running sums in ordinary f32 arithmetic, which bounds how long an
// accumulation runs inside the tensor cores.
//
// Tiles: a block computes 128 weight rows (the MMA's M) × 64 tokens (N),
// 64 columns (K, one quantization group) per stage; 8 warps as 4 (rows) ×
// 2 (tokens), each 32 rows × 32 tokens = 2 × 4 MMA tiles of m16n8k16.
// Stages pass through registers into one shared-memory buffer: the global
// loads of stage k+1 are issued before the MMAs of stage k and stored
// (converted to bf16) after them. Weights and activations are converted
// once per block as they are stored, so the MMA loop is ldmatrix + mma.
//
// Column order: inside every aligned run of 8 columns c..c+7, shared memory
// holds them in the order c, c+4, c+1, c+5, c+2, c+6, c+3, c+7 (position p
// holds column c + p/2 + 4·(p%2)), for weights and activations alike; a
// product over k does not depend on the order of k. This order lets eight
// 4-bit codes of one 32-bit word become four bf16 pairs with two logic ops
// each (nibbles j and j+4 are 16 bits apart).
//
// Fragments of mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (PTX
// ISA, "Matrix Fragments for mma.m16n8k16"), with g = lane / 4 and
// i = lane % 4; a 32-bit register holds two bf16, the lower k in its low
// half:
//   A (16 × 16, rows × k): a0 = (g, 2i..2i+1), a1 = (g+8, 2i..2i+1),
//                          a2 = (g, 2i+8..2i+9), a3 = (g+8, 2i+8..2i+9)
//   B (16 × 8, k × n):     b0 = (k 2i..2i+1, n g), b1 = (k 2i+8..2i+9, n g)
//   C (16 × 8, f32):       c0 = (g, 2i), c1 = (g, 2i+1),
//                          c2 = (g+8, 2i), c3 = (g+8, 2i+1)
// ldmatrix.x4 (no .trans) loads four 8 × 8 b16 matrices whose row
// addresses come from lanes 0-7, 8-15, 16-23 and 24-31; lane l receives in
// register j the pair (row l/4, columns 2(l%4), 2(l%4)+1) of matrix j. So
// with weights stored [row][k]: matrices (rows 0-7, k 0-7), (rows 8-15,
// k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) give a0..a3; and with
// activations stored [token][k] (B's columns are tokens): (tokens 0-7, k 0-7),
// (tokens 0-7, k 8-15), (tokens 8-15, k 0-7), (tokens 8-15, k 8-15) give b0,
// b1 of two neighbouring 8-token tiles.
//
// sm_80+ only (bf16 mma and conversions); on older devices the kernels are
// empty and gemm.rs never launches them.

// GEMM_BM weight rows and GEMM_BN tokens per block, GEMM_THREADS threads
// (8 warps: 4 along the rows, 2 along the tokens).
// Launch geometry comes from the host: compile.rs passes the constants of
// geometry.rs as -D options, so a launch and its kernel cannot disagree.
#if !defined(GEMM_BM) || !defined(GEMM_BN) || !defined(GEMM_THREADS)
#error "gemm.cu: launch geometry missing (compile.rs passes geometry.rs as -D options)"
#endif
#define GEMM_BK 64             // columns per stage (GROUP_SIZE)
// Shared row stride in bf16: 144 bytes, so the eight 16-byte rows an
// ldmatrix matrix reads start 4 banks apart and hit all 32 banks once.
#define GEMM_LD (GEMM_BK + 8)

struct GemmShared {
    u16 w[GEMM_BM][GEMM_LD];   // weights as bf16: centred codes, or values
    u16 hi[GEMM_BN][GEMM_LD];  // bf16(x)
    u16 lo[GEMM_BN][GEMM_LD];  // bf16(x - hi)
    float scale[GEMM_BM];      // the stage's group: scale of each row
    float bias[GEMM_BM];       // and bias + centre · scale
    float xsum[GEMM_BN];       // Σ x over the stage's columns, per token
};

#if __CUDA_ARCH__ >= 800

__device__ __forceinline__ u32 shared_address(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p))
                 : "memory");
}

// Where q4_pair's nibble mask comes from. 2: a word of global memory,
// loaded once where a kernel first needs it and then held in a register;
// 1: constant memory, which the LOP3 takes as an operand; 0: an
// immediate, which beside 0x4300_4300 (one LOP3 takes one immediate)
// ptxas rebuilds in a register before each pair where registers are
// short. Against the immediate, 2 ran steps of 16 and 64 sequences 1.5%
// faster with one sequence's decode level; 1 ran them 2% faster but one
// sequence's decode 2.5% slower (docs/PERFORMANCE.md).
#ifndef Q4_NIBBLES_CONSTANT
#define Q4_NIBBLES_CONSTANT 2
#endif
#if Q4_NIBBLES_CONSTANT == 2
__device__ u32 q4_nibbles_word = 0x000f000fu;
#define q4_nibbles q4_nibbles_word
#elif Q4_NIBBLES_CONSTANT
__constant__ u32 q4_nibbles = 0x000f000fu;
#else
#define q4_nibbles 0x000f000fu
#endif

// Eight 4-bit codes (lowest nibble first: columns c..c+7) as bf16 q - 8 in
// the shared column order. (v & 0x000f000f) | 0x4300_4300 holds nibbles j
// and j+4 as the bf16 128 + q (exponent 2^7, the nibble in the low
// mantissa bits); one fma (· 1 - 136, exact) centres both.
__device__ __forceinline__ u32 q4_pair(u32 v) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n"
        : "=r"(r)
        : "r"((v & q4_nibbles) | 0x43004300u), "r"(0x3f803f80u), "r"(0xc308c308u));
    return r;
}

__device__ __forceinline__ uint4 q4_chunk(u32 word) {
    return make_uint4(q4_pair(word), q4_pair(word >> 4), q4_pair(word >> 8),
                      q4_pair(word >> 12));
}

// Byte `selector & 3` of `word` as the f32 q - 128: the bytes
// (q, 0, 0, 0x4b) are the f32 2^23 + q, and subtracting 2^23 + 128 is exact.
__device__ __forceinline__ float q8_centred(u32 word, u32 selector) {
    return __uint_as_float(__byte_perm(word, 0x4b000000u, selector)) - 8388736.0f;
}

// Eight 8-bit codes (columns c..c+3 in `a`, c+4..c+7 in `b`, lowest byte
// first) as bf16 q - 128 in the shared column order.
__device__ __forceinline__ uint4 q8_chunk(u32 a, u32 b) {
    return make_uint4(bf16x2_exact(q8_centred(a, 0x7440), q8_centred(b, 0x7440)),
                      bf16x2_exact(q8_centred(a, 0x7441), q8_centred(b, 0x7441)),
                      bf16x2_exact(q8_centred(a, 0x7442), q8_centred(b, 0x7442)),
                      bf16x2_exact(q8_centred(a, 0x7443), q8_centred(b, 0x7443)));
}

// Eight bf16 values (columns c..c+7, two per word) in the shared column
// order.
__device__ __forceinline__ uint4 bf16_chunk(uint4 v) {
    return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                      __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
}

__device__ __forceinline__ void store16(u16* p, uint4 v) { *(uint4*)p = v; }

// Stores a 16-byte load of stored weights (32 q4 codes, 16 q8 codes or
// 8 bf16 values) as bf16 at dst in a stage's shared memory.
template <int DT>
__device__ __forceinline__ void store_weight_chunk(u16* dst, uint4 w) {
    if (DT == DT_Q4) {
        store16(dst, q4_chunk(w.x));
        store16(dst + 8, q4_chunk(w.y));
        store16(dst + 16, q4_chunk(w.z));
        store16(dst + 24, q4_chunk(w.w));
    } else if (DT == DT_Q8) {
        store16(dst, q8_chunk(w.x, w.y));
        store16(dst + 8, q8_chunk(w.z, w.w));
    } else {
        store16(dst, bf16_chunk(w));
    }
}

// A run of 8 activations (a: columns c..c+3, b: c+4..c+7) split into hi
// and lo bf16 in the shared column order; with SUM, Σx over the 64-column
// group whose 8 runs the aligned, consecutive lanes around this one hold
// (every lane of the warp takes part), else 0.
template <bool SUM>
__device__ __forceinline__ float split_run(float4 a, float4 b, uint4& hi, uint4& lo) {
    split_pair(a.x, b.x, hi.x, lo.x);
    split_pair(a.y, b.y, hi.y, lo.y);
    split_pair(a.z, b.z, hi.z, lo.z);
    split_pair(a.w, b.w, hi.w, lo.w);
    if (!SUM) return 0.0f;
    float s = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
    s += __shfl_xor_sync(FULL_MASK, s, 4);
    s += __shfl_xor_sync(FULL_MASK, s, 2);
    s += __shfl_xor_sync(FULL_MASK, s, 1);
    return s;
}

// Stores 8 activations (a, b) of `token` from column `col` of a stage as
// their hi and lo bf16 halves; with QUANTIZED also the token's Σx over the
// stage. The 8 lanes holding one token's stage must be aligned and
// consecutive (threadIdx.x % 8 is the run), as every caller's layout has.
template <bool QUANTIZED, typename Shared>
__device__ __forceinline__ void store_activation_run(Shared& sm, int token, int col, float4 a,
                                                     float4 b) {
    uint4 hi, lo;
    const float s = split_run<QUANTIZED>(a, b, hi, lo);
    store16(&sm.hi[token][col], hi);
    store16(&sm.lo[token][col], lo);
    if (QUANTIZED && threadIdx.x % 8 == 0) sm.xsum[token] = s;
}

// One stage in flight between global and shared memory, held in registers.
template <int DT>
struct GemmStage {
    // 16-byte vectors of a stage's weight row (64 columns) and per thread.
    static constexpr int ROW_VECS = DT == DT_Q4 ? 2 : DT == DT_Q8 ? 4 : 8;
    static constexpr int VECS = GEMM_BM * ROW_VECS / GEMM_THREADS;
    static constexpr int VEC_COLS = GEMM_BK / ROW_VECS;
    // The centre subtracted from the codes.
    static constexpr float CENTRE = DT == DT_Q4 ? 8.0f : 128.0f;
    static constexpr bool QUANTIZED = DT == DT_Q4 || DT == DT_Q8;

    uint4 w[VECS];
    // Two runs of 8 activations per thread: tokens tid/8 and tid/8 + 32,
    // columns 8·(tid%8)..+7 of the stage, as two float4 each.
    float4 x[2][2];
    u16 scale, bias;  // row tid's (threads < GEMM_BM), quantized only

    // Reads the stage starting at column k0; what lies outside the matrix
    // (rows ≥ rows, tokens ≥ n, columns ≥ cols) reads as zero.
    __device__ __forceinline__ void load(const u8* codes, const u16* scales,
                                         const u16* biases, const float* x_in, int rows,
                                         int cols, int n, int r0, int t0, int k0) {
        const int tid = threadIdx.x;
        const i64 row_bytes = DT == DT_Q4 ? cols / 2 : DT == DT_Q8 ? cols : 2 * (i64)cols;
        const int k0_bytes = DT == DT_Q4 ? k0 / 2 : DT == DT_Q8 ? k0 : 2 * k0;
#pragma unroll
        for (int j = 0; j < VECS; ++j) {
            int i = tid + j * GEMM_THREADS;
            int row = i / ROW_VECS, part = i % ROW_VECS;
            bool inside = r0 + row < rows && k0 + part * VEC_COLS < cols;
            w[j] = inside ? *(const uint4*)(codes + (r0 + row) * row_bytes + k0_bytes +
                                            part * 16)
                          : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            int token = tid / 8 + 32 * j;
            int c = k0 + 8 * (tid % 8);
            if (t0 + token < n && c < cols) {
                const float4* p = (const float4*)(x_in + (i64)(t0 + token) * cols + c);
                x[j][0] = p[0];
                x[j][1] = p[1];
            } else {
                x[j][0] = x[j][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
        if (QUANTIZED) {
            scale = bias = 0;
            if (tid < GEMM_BM && r0 + tid < rows) {
                i64 at = (i64)(r0 + tid) * (cols / GROUP_SIZE) + k0 / GROUP_SIZE;
                scale = scales[at];
                bias = biases[at];
            }
        }
    }

    // Converts the stage to bf16 in shared memory (column order as in the
    // header) with the group's parameters and activation sums.
    __device__ __forceinline__ void store(GemmShared& sm) const {
        const int tid = threadIdx.x;
#pragma unroll
        for (int j = 0; j < VECS; ++j) {
            int i = tid + j * GEMM_THREADS;
            int row = i / ROW_VECS, part = i % ROW_VECS;
            u16* dst = &sm.w[row][part * VEC_COLS];
            store_weight_chunk<DT>(dst, w[j]);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            int token = tid / 8 + 32 * j;
            int col = 8 * (tid % 8);
            store_activation_run<QUANTIZED>(sm, token, col, x[j][0], x[j][1]);
        }
        if (QUANTIZED && tid < GEMM_BM) {
            float s = bf16_to_float(scale);
            sm.scale[tid] = s;
            sm.bias[tid] = fmaf(CENTRE, s, bf16_to_float(bias));
        }
    }
};

// CALL(N) for the constant N equal to `tiles_n`, a warp's count of 8-token
// column tiles (0 to 4): the products below are compiled for each count so
// that a stage is one straight run of code.
#define SWITCH_TILES_N(tiles_n, CALL) \
    switch (tiles_n) {                \
        case 4:                       \
            CALL(4);                  \
            break;                    \
        case 3:                       \
            CALL(3);                  \
            break;                    \
        case 2:                       \
            CALL(2);                  \
            break;                    \
        case 1:                       \
            CALL(1);                  \
            break;                    \
        default:                      \
            CALL(0);                  \
    }

// One stage of a warp's tensor-core products, shared by linear_tc and the
// grouped expert kernels (moe_prefill.cu): two 16-row A tiles of weights,
// whose fragments load_a(mi, k, a) produces for tile mi at the stage's
// column k (a multiple of 16), against the first TILES_N 8-token tiles of
// the split activations (hi + lo) from token0, over the stage's GEMM_BK
// columns; the result is folded into acc, with the stage's scale and bias
// of rows[mi] + g (+ 8) for quantized weights (bias · Σx per token).
// Element e of a C fragment is row g + 8·(e / 2), token 2·i4 + e % 2 of
// its tile. `Shared` is the stage in shared memory (fields hi, lo, scale,
// bias, xsum). TILES_N is a constant so that the stage is one straight run
// of code whose loads and MMAs interleave.
template <bool QUANTIZED, int TILES_N, typename Shared, typename LoadA>
__device__ __forceinline__ void mma_stage_of(const Shared& sm, LoadA load_a,
                                             const int (&rows)[2], int token0,
                                             float (&acc)[2][4][4]) {
    if (TILES_N == 0) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, i4 = lane % 4;
    float part[2][4][4] = {};
    // B for 8-token tiles 2p and 2p+1: lanes 0-7 address tokens 0-7 at k,
    // 8-15 tokens 0-7 at k+8, 16-23 tokens 8-15 at k, 24-31 tokens 8-15 at
    // k+8; registers 0,1 are b0,b1 of tile 2p, registers 2,3 those of tile
    // 2p+1. The lane's address at p = 0, k = 0; the others are constant
    // offsets from it.
    const u16* b_lane = &sm.hi[token0 + (lane % 8) + 8 * (lane / 16)][8 * ((lane / 8) % 2)];
    const int lo_offset = (int)(&sm.lo[0][0] - &sm.hi[0][0]);
#pragma unroll
    for (int k = 0; k < GEMM_BK; k += 16) {
        u32 a[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) load_a(mi, k, a[mi]);
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            if (2 * p >= TILES_N) continue;
            const u16* b = b_lane + 16 * p * GEMM_LD + k;
            u32 bh[4], bl[4];
            ldmatrix_x4(bh, b);
            ldmatrix_x4(bl, b + lo_offset);
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                mma_bf16(part[mi][2 * p], a[mi], bh[0], bh[1]);
                mma_bf16(part[mi][2 * p], a[mi], bl[0], bl[1]);
                if (2 * p + 1 < TILES_N) {
                    mma_bf16(part[mi][2 * p + 1], a[mi], bh[2], bh[3]);
                    mma_bf16(part[mi][2 * p + 1], a[mi], bl[2], bl[3]);
                }
            }
        }
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = rows[mi] + g + 8 * h;
            float scale = 0.0f, bias = 0.0f;
            if (QUANTIZED) {
                scale = sm.scale[row];
                bias = sm.bias[row];
            }
#pragma unroll
            for (int nj = 0; nj < 4; ++nj) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& c = acc[mi][nj][2 * h + e];
                    const float v = part[mi][nj][2 * h + e];
                    if (QUANTIZED) {
                        const float xs = sm.xsum[token0 + 8 * nj + 2 * i4 + e];
                        c = fmaf(scale, v, fmaf(bias, xs, c));
                    } else {
                        c += v;
                    }
                }
            }
        }
    }
}

// mma_stage_of for the warp's first `tiles_n` (0 to 4) token tiles (none:
// nothing to add).
template <bool QUANTIZED, typename Shared, typename LoadA>
__device__ __forceinline__ void mma_stage_with(const Shared& sm, LoadA load_a,
                                               const int (&rows)[2], int token0, int tiles_n,
                                               float (&acc)[2][4][4]) {
#define MMA_STAGE_OF(N) mma_stage_of<QUANTIZED, N>(sm, load_a, rows, token0, acc)
    SWITCH_TILES_N(tiles_n, MMA_STAGE_OF)
#undef MMA_STAGE_OF
}

// mma_stage_with for weights staged as bf16 in sm.w (rows × k), whose A
// fragments come from ldmatrix: lanes 0-7 address rows 0-7 at k, 8-15 rows
// 8-15 at k, 16-23 rows 0-7 at k+8, 24-31 rows 8-15 at k+8.
template <bool QUANTIZED, typename Shared>
__device__ __forceinline__ void mma_stage(const Shared& sm, const int (&rows)[2], int token0,
                                          int tiles_n, float (&acc)[2][4][4]) {
    const int lane = threadIdx.x % WARP_SIZE;
    mma_stage_with<QUANTIZED>(
        sm,
        [&](int mi, int k, u32(&a)[4]) {
            ldmatrix_x4(a, &sm.w[rows[mi] + (lane % 8) + 8 * ((lane / 8) % 2)]
                                [k + 8 * (lane / 16)]);
        },
        rows, token0, tiles_n, acc);
}

// out[t, r] (+)= acc for a warp's MMA tiles of rows row0 + 16·mi (+ g,
// + g + 8) and tokens token0 + 8·nj (+ 2·i4, + 1), those inside `rows` × `n`.
__device__ __forceinline__ void store_warp_tiles(const float (&acc)[2][4][4], float* out,
                                                 int rows, int n, int row0, int token0,
                                                 bool accumulate) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, i4 = lane % 4;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = row0 + 16 * mi + g + 8 * (e / 2);
                const int t = token0 + 8 * nj + 2 * i4 + e % 2;
                if (r < rows && t < n) {
                    float* o = out + (i64)t * rows + r;
                    *o = accumulate ? *o + acc[mi][nj][e] : acc[mi][nj][e];
                }
            }
        }
    }
}

// The kernels' body for row tile `tile` (rows tile·GEMM_BM..) of a matrix
// of `rows` rows. Grid: (the launch's row tiles over its matrices,
// ceil(n / GEMM_BN), splits), GEMM_THREADS threads. Block z sums the
// stages z·split_stages .. (z+1)·split_stages into `out` [n, rows] (with
// `accumulate`, adding to it): with one split the matrix's output, with
// several its part of split z, which sum_split_parts adds up. A product of
// few tokens has too few tiles to fill the device otherwise. For DT_BF16,
// cols must be a multiple of 8; the quantized types have whole groups.
template <int DT>
__device__ __forceinline__ void linear_tc(const u8* __restrict__ codes,
                                          const u16* __restrict__ scales,
                                          const u16* __restrict__ biases,
                                          const float* __restrict__ x,
                                          float* __restrict__ out, int rows, int tile, int cols,
                                          int n, int split_stages, bool accumulate) {
    __shared__ __align__(16) GemmShared sm;
    const int warp = threadIdx.x / WARP_SIZE;
    const int r0 = tile * GEMM_BM, t0 = blockIdx.y * GEMM_BN;
    const int wm = (warp % 4) * 32;  // the warp's rows in the block: wm..wm+31
    const int wn = (warp / 4) * 32;  // and tokens: wn..wn+31
    // 8-token tiles of the warp holding tokens < n (warp-uniform): the MMAs
    // of the others are skipped (their results would not be stored).
    const int tiles_n = min(4, max(0, (n - t0 - wn + 7) / 8));

    // acc[mi][nj]: rows wm + 16·mi (+ g, + g+8), tokens wn + 8·nj (+ 2·i4, +1),
    // in the C fragment's order.
    float acc[2][4][4] = {};

    GemmStage<DT> stage;
    const int first = blockIdx.z * split_stages;
    const int stages = min((cols + GEMM_BK - 1) / GEMM_BK, first + split_stages);
    stage.load(codes, scales, biases, x, rows, cols, n, r0, t0, first * GEMM_BK);
    stage.store(sm);
    __syncthreads();
    const int rows_of_warp[2] = {wm, wm + 16};
    for (int s = first; s < stages; ++s) {
        if (s + 1 < stages) {
            stage.load(codes, scales, biases, x, rows, cols, n, r0, t0, (s + 1) * GEMM_BK);
        }
        mma_stage<GemmStage<DT>::QUANTIZED>(sm, rows_of_warp, wn, tiles_n, acc);
        __syncthreads();  // every warp is done reading the stage
        if (s + 1 < stages) {
            stage.store(sm);
            __syncthreads();
        }
    }

    store_warp_tiles(acc, out, rows, n, r0 + wm, t0 + wn, accumulate);
}

#endif  // __CUDA_ARCH__ >= 800

// Where a launch's block writes: its job's output, or with `partial` the
// job's part of split blockIdx.z there (split-major over the launch's
// outputs, as sum_split_parts reads them).
__device__ __forceinline__ float* block_output(const MatvecJobs& jobs, int index,
                                               float* partial, int n) {
    if (!partial) return jobs.job[index].out;
    return partial + blockIdx.z * outputs_before(jobs, jobs.count, n) +
           outputs_before(jobs, index, n);
}

// A launch's block: its job's matrix and output, then linear_tc.
template <int DT>
__device__ __forceinline__ void linear_tc_jobs(const MatvecJobs& jobs, const float* x,
                                               float* partial, int cols, int n,
                                               int split_stages, int accumulate) {
#if __CUDA_ARCH__ >= 800
    const int index = block_job(jobs);
    const MatvecJob& job = jobs.job[index];
    linear_tc<DT>(job.codes, job.scales, job.biases, x, block_output(jobs, index, partial, n),
                  job.rows, blockIdx.x - job.first_block, cols, n, split_stages,
                  !partial && accumulate);
#endif
}

// The kernels (one per stored type): out_j (+)= x · w_jᵀ for x [n, cols]
// and up to MAX_JOBS matrices of one type (job.first_block counts row
// tiles of GEMM_BM), out_j [n, rows_j]; the stages each split sums (all of
// them: one split); with several splits, `partial` for their parts.
#define LINEAR_TC(NAME, DT)                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)                            \
        NAME(MatvecJobs jobs, const float* x, float* partial, int cols, int n,               \
             int split_stages, int accumulate) {                                             \
        await_inputs();                                                                      \
        linear_tc_jobs<DT>(jobs, x, partial, cols, n, split_stages, accumulate);             \
    }
LINEAR_TC(linear_tc_q4, DT_Q4)
LINEAR_TC(linear_tc_q8, DT_Q8)
LINEAR_TC(linear_tc_bf16, DT_BF16)

// ---- q4 products with int8 activations (CudaOptions::activations = Int8) ----
//
// Prompts' q4 products (linear_tc_q4_i8 below, and the routed experts'
// moe_prefill_*_q4_i8), with the activations
// quantized per group of 64 inputs as the CPU's Int8Acts quantizes them
// (d = max|x| / 127, x̂ = x / d rounded to nearest even) and the products
// on the integer tensor cores (mma.sync m16n8k32, u8 codes × s8
// activations, exact s32 sums). Per group and (row, slot), w = s·q + b:
//   Σ w·x ≈ s·(d·Σ q·x̂ + c·(Σx − d·Σx̂)) + b·Σx,   c = 7.5 (the mean code),
// the CPU's formula: the rounding error e = x − d·x̂ enters only as
// s·Σ (q − c)·e, |e| ≤ d/2. A stage is one group: two MMAs a tile (the
// bf16 kernels take eight: four steps of k, each for hi and lo), then the
// affine map in f32.
//
// Fragments of m16n8k32 (PTX ISA, "Matrix Fragments for mma.m16n8k32",
// 8-bit types), g = lane / 4, i = lane % 4, four 8-bit values a register:
//   A: a0 = (row g, k 4i..4i+3), a1 = (g+8, 4i..), a2 = (g, 16+4i..),
//      a3 = (g+8, 16+4i..);  B: b0 = (k 4i..4i+3, slot g), b1 = (k 16+4i..,
//      slot g);  C as m16n8k16's.
// The order of k is free as long as A and B agree. MMA h (0, 1) of a group
// takes from lane (g, i) the stored word 2i + h of each of its rows (the
// run of columns 8·(2i + h) .. + 7, nibble j column + j): its low nibbles
// (columns + 0, 2, 4, 6) as k 4i.., its high nibbles (+ 1, 3, 5, 7) as
// k 16 + 4i... So the activations are stored each run of 8 columns as its
// even columns then its odd ones, and b0, b1 of MMA h are words 2h, 2h + 1
// of the lane's 16 bytes 16i.. of its slot's group.

// Activations quantized for the int8 kernels: `codes` [rows, cols] int8,
// each run of 8 columns as its evens then its odds; `params` [rows,
// cols / 64]: d, c·(Σx − d·Σx̂), Σx and 0 of each group.
struct Q8Rows {
    u8* codes;
    float4* params;
};

#if !defined(I8_STAGES) || !defined(GEMM_I8_STAGE_BYTES)
#error "gemm.cu: int8 pipeline geometry missing (geometry.rs)"
#endif

// A group's quantization from its largest magnitude `peak`: x̂ = x · the
// scale this returns, rounded to nearest even (the CPU's Int8Acts: 127 /
// peak, 0 for a group of zeros).
__device__ __forceinline__ float q8_inverse_step(float peak) {
    return peak > 0.0f ? 127.0f / peak : 0.0f;
}

// A group's Q8Rows params from its largest magnitude, Σx and Σx̂:
// d = peak / 127 and the correction c·(Σx − d·Σx̂), c = 7.5 (the mean
// 4-bit code).
__device__ __forceinline__ float4 q8_params(float peak, float sum, int code_sum) {
    const float d = peak / 127.0f;
    return make_float4(d, 7.5f * (sum - d * (float)code_sum), sum, 0.0f);
}

// The four bytes of the low 8 bits of a, b, c, d, in that order.
__device__ __forceinline__ u32 pack_bytes(int a, int b, int c, int d) {
    return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

#if __CUDA_ARCH__ >= 800
// Calls body(i, inside, a, b) for each run i of 8 columns of x [rows,
// cols] (cols a multiple of 64), a and b its halves: a thread takes a run,
// the 8 lanes of a group its runs, and the grid strides by whole warps so
// every lane of a group is present for its shuffles (past the last run
// `inside` is false and a, b are zeros). quantize_activations_q4 and
// moe_prefill.cu's split_activations.
template <typename Body>
__device__ __forceinline__ void for_each_run(const float* x, int rows, int cols, Body body) {
    const i64 runs = (i64)rows * (cols / 8);
    const int lane = threadIdx.x % WARP_SIZE;
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x - lane; first < runs;
         first += step) {
        const i64 i = first + lane;
        const bool inside = i < runs;
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
        if (inside) {
            a = ((const float4*)(x + 8 * i))[0];
            b = ((const float4*)(x + 8 * i))[1];
        }
        body(i, inside, a, b);
    }
}
#endif

// x [rows, cols] as Q8Rows, cols a multiple of 64 (for_each_run's runs).
extern "C" __global__ void quantize_activations_q4(const float* x, Q8Rows out, int rows,
                                                   int cols) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    const int lane = threadIdx.x % WARP_SIZE;
    for_each_run(x, rows, cols, [&](i64 i, bool inside, float4 a, float4 b) {
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        float peak = 0.0f, sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            peak = fmaxf(peak, fabsf(v[j]));
            sum += v[j];
        }
#pragma unroll
        for (int o = 1; o < 8; o *= 2) {
            peak = fmaxf(peak, __shfl_xor_sync(FULL_MASK, peak, o));
            sum += __shfl_xor_sync(FULL_MASK, sum, o);
        }
        const float inv = q8_inverse_step(peak);
        int q[8], qsum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            q[j] = __float2int_rn(v[j] * inv);
            qsum += q[j];
        }
#pragma unroll
        for (int o = 1; o < 8; o *= 2) qsum += __shfl_xor_sync(FULL_MASK, qsum, o);
        if (inside) {
            *(uint2*)(out.codes + 8 * i) =
                make_uint2(pack_bytes(q[0], q[2], q[4], q[6]), pack_bytes(q[1], q[3], q[5], q[7]));
            if (lane % 8 == 0) out.params[i / 8] = q8_params(peak, sum, qsum);
        }
    });
#endif
}

#if __CUDA_ARCH__ >= 800

// d = a · b + c for one m16n8k32 tile of u8 (a) and s8 (b) values.
__device__ __forceinline__ void mma_u8s8(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1,
                                         const int (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]),
          "r"(c[2]), "r"(c[3]));
}

// The A fragment of one MMA from the words of rows g (`top`) and g + 8
// (`bottom`): low nibbles, then high ones (the header's k order).
__device__ __forceinline__ void q4_u8_fragment(u32 top, u32 bottom, u32 (&a)[4]) {
    a[0] = top & 0x0f0f0f0fu;
    a[1] = bottom & 0x0f0f0f0fu;
    a[2] = (top >> 4) & 0x0f0f0f0fu;
    a[3] = (bottom >> 4) & 0x0f0f0f0fu;
}

// Position of column c of a group in the int8 layout (evens, then odds, of
// each run of 8).
__device__ __forceinline__ int q8_position(int c) {
    return (c & ~7) + 4 * (c & 1) + ((c & 7) >> 1);
}

// A stage of the int8 kernels: a group of BM rows' codes as stored (32
// bytes a row: a fragment's reads of 8 bytes at 8·i from rows g hit every
// bank once), BN slots' (tokens') int8 activations and params, and the
// rows' scales and biases.
template <int BM, int BN>
struct I8Stage {
    u8 w[BM][GROUP_SIZE / 2];
    u8 x[BN][GROUP_SIZE];
    float4 xp[BN];
    float scale[BM];
    float bias[BM];
};

// What thread `tid` of a block of THREADS copies into each stage, worked
// out once (a stage moves each source along its row): 16-byte pieces of
// codes (piece p = tid + THREADS·j is half p % 2 of row p / 2), 16 bytes of
// slot tid / 4's activations (piece tid % 4), slot tid's params (tid < BN)
// and row tid's scale and bias (tid < BM). A source that is not valid is
// copied as zeros: its pointer moves along as the others do, never read.
template <int BM, int BN, int THREADS>
struct I8Sources {
    static constexpr int CODE_PIECES = 2 * BM / THREADS;
    static_assert(4 * BN == THREADS && BM <= THREADS && CODE_PIECES >= 1,
                  "one piece of activations a thread, a row's parameters a thread");
    const u8* codes[CODE_PIECES];
    bool codes_valid[CODE_PIECES];
    int code_step;  // bytes from a row's group of codes to its next (code_step in linear.cu)
    const u8* act;
    bool act_valid;
    const float4* params;
    bool params_valid;
    const u16* scale;
    const u16* bias;
    bool row_valid;
};

// acc += the products of stages (groups) first .. last - 1 of the block's
// rows and slots: the warp's MMA tiles are rows rows[mi] .. + 15 (mi = 0,
// 1) × slots slot0 + 8·nj .. + 7 (nj < TILES_N), acc in the C fragment's
// order. STAGES stages in flight through cp.async; the rows' scales and
// biases are read a stage ahead into registers and stored the stage after.
// One __syncthreads per stage: it makes stage s visible and frees the
// buffer of stage s - 1 for the copies of stage s + STAGES - 1.
// TILES_N is a constant so that a stage is one straight run of code: the
// column tiles' loads, MMAs and scaling interleave instead of waiting on
// each other across branches.
template <int BM, int BN, int THREADS, int STAGES, int TILES_N>
__device__ __forceinline__ void i8_products_of(I8Stage<BM, BN>* stages,
                                               const I8Sources<BM, BN, THREADS>& src, int first,
                                               int last, const int (&rows)[2], int slot0,
                                               float (&acc)[2][4][4]) {
    static_assert(STAGES >= 3, "scales are stored one stage after they are read");
    const int tid = threadIdx.x;
    const int lane = tid % WARP_SIZE;
    const int g = lane / 4, i4 = lane % 4;
    // Queues the copies of stage s (none past the last) and closes the group.
    const auto issue = [&](int s) {
        if (s < last) {
            I8Stage<BM, BN>& st = stages[s % STAGES];
#pragma unroll
            for (int j = 0; j < I8Sources<BM, BN, THREADS>::CODE_PIECES; ++j) {
                const int p = tid + THREADS * j;
                copy_async16(&st.w[p / 2][16 * (p % 2)], src.codes[j] + src.code_step * s,
                             src.codes_valid[j]);
            }
            copy_async16(&st.x[tid / 4][16 * (tid % 4)], src.act + GROUP_SIZE * s,
                         src.act_valid);
            if (tid < BN) copy_async16(&st.xp[tid], src.params + s, src.params_valid);
        }
        copy_async_commit();
    };
    // Row tid's scale and bias of stage s (zero past the matrix or the stages).
    const auto read_params = [&](int s, u16& scale, u16& bias) {
        scale = bias = 0;
        if (s < last && src.row_valid) {
            scale = __ldg(src.scale + s);
            bias = __ldg(src.bias + s);
        }
    };
    const auto store_params = [&](int s, u16 scale, u16 bias) {
        if (tid < BM) {
            I8Stage<BM, BN>& st = stages[s % STAGES];
            st.scale[tid] = bf16_to_float(scale);
            st.bias[tid] = bf16_to_float(bias);
        }
    };
    const int zero[4] = {0, 0, 0, 0};
    // The first stages' parameters are all read before any is stored.
    u16 first_scales[STAGES - 1], first_biases[STAGES - 1];
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        issue(first + i);
        read_params(first + i, first_scales[i], first_biases[i]);
    }
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) store_params(first + i, first_scales[i], first_biases[i]);
    u16 next_scale = 0, next_bias = 0;  // of stage s + STAGES - 2
    for (int s = first; s < last; ++s) {
        copy_async_wait<STAGES - 2>();
        __syncthreads();
        if (s > first) store_params(s + STAGES - 2, next_scale, next_bias);
        issue(s + STAGES - 1);
        read_params(s + STAGES - 1, next_scale, next_bias);
        const I8Stage<BM, BN>& st = stages[s % STAGES];
        // a[mi][h]: MMA h's A fragment of row tile mi; the scales and
        // biases of its rows g (e / 2 = 0) and g + 8 (1).
        u32 a[2][2][4];
        float scale[2][2], bias[2][2];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
            const uint2 top = *(const uint2*)&st.w[rows[mi] + g][8 * i4];
            const uint2 bottom = *(const uint2*)&st.w[rows[mi] + g + 8][8 * i4];
            q4_u8_fragment(top.x, bottom.x, a[mi][0]);
            q4_u8_fragment(top.y, bottom.y, a[mi][1]);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                scale[mi][h] = st.scale[rows[mi] + g + 8 * h];
                bias[mi][h] = st.bias[rows[mi] + g + 8 * h];
            }
        }
#pragma unroll
        for (int nj = 0; nj < TILES_N; ++nj) {
            const int slot = slot0 + 8 * nj;
            const uint4 b = *(const uint4*)&st.x[slot + g][16 * i4];
            // The slots slot + 2·i4 (+ 1) of the C fragment.
            const float4 p0 = st.xp[slot + 2 * i4], p1 = st.xp[slot + 2 * i4 + 1];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                int sums[4];
                mma_u8s8(sums, a[mi][0], b.x, b.y, zero);
                mma_u8s8(sums, a[mi][1], b.z, b.w, sums);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float4 p = e % 2 ? p1 : p0;
                    const float t = fmaf(p.x, (float)sums[e], p.y);
                    float& c = acc[mi][nj][e];
                    c = fmaf(scale[mi][e / 2], t, fmaf(bias[mi][e / 2], p.z, c));
                }
            }
        }
    }
    copy_async_wait<0>();
}

// i8_products_of for the warp's first `tiles_n` (0 to 4) column tiles.
template <int BM, int BN, int THREADS, int STAGES>
__device__ __forceinline__ void i8_products(I8Stage<BM, BN>* stages,
                                            const I8Sources<BM, BN, THREADS>& src, int first,
                                            int last, const int (&rows)[2], int slot0,
                                            int tiles_n, float (&acc)[2][4][4]) {
#define I8_PRODUCTS_OF(N) \
    i8_products_of<BM, BN, THREADS, STAGES, N>(stages, src, first, last, rows, slot0, acc)
    SWITCH_TILES_N(tiles_n, I8_PRODUCTS_OF)
#undef I8_PRODUCTS_OF
}

typedef I8Stage<GEMM_BM, GEMM_BN> GemmI8Stage;
static_assert(sizeof(GemmI8Stage) == GEMM_I8_STAGE_BYTES,
              "geometry.rs's GEMM_I8_STAGE_BYTES must be the size of I8Stage<GEMM_BM, GEMM_BN>");

// linear_tc for q4 rows and int8 activations: the block's row tile `tile`
// × GEMM_BN tokens from blockIdx.y, stages of split blockIdx.z. Dynamic
// shared memory: I8_STAGES stages.
__device__ __forceinline__ void linear_tc_q4_i8_tile(const u8* __restrict__ codes,
                                                     const u16* __restrict__ scales,
                                                     const u16* __restrict__ biases, Q8Rows x,
                                                     float* __restrict__ out, int rows, int tile,
                                                     int cols, int n, int split_stages,
                                                     bool accumulate) {
    extern __shared__ __align__(16) u8 linear_i8_shared[];
    GemmI8Stage* stages = (GemmI8Stage*)linear_i8_shared;
    const int tid = threadIdx.x, warp = tid / WARP_SIZE;
    const int r0 = tile * GEMM_BM, t0 = blockIdx.y * GEMM_BN;
    const int wm = (warp % 4) * 32;  // the warp's rows in the block: wm..wm+31
    const int wn = (warp / 4) * 32;  // and tokens: wn..wn+31
    const int tiles_n = min(4, max(0, (n - t0 - wn + 7) / 8));
    const int groups = cols / GROUP_SIZE;
    const i64 row_bytes = cols / 2;

    I8Sources<GEMM_BM, GEMM_BN, GEMM_THREADS> src;
#pragma unroll
    for (int j = 0; j < I8Sources<GEMM_BM, GEMM_BN, GEMM_THREADS>::CODE_PIECES; ++j) {
        const int p = tid + GEMM_THREADS * j;
        const int r = r0 + p / 2;
        src.codes_valid[j] = r < rows;
        src.codes[j] = codes + (r < rows ? r * row_bytes + 16 * (p % 2) : 0);
    }
    src.code_step = Q4_GROUP_BYTES;
    const int t = t0 + tid / 4;
    src.act_valid = t < n;
    src.act = x.codes + (t < n ? (i64)t * cols + 16 * (tid % 4) : 0);
    const int pt = t0 + tid;
    src.params_valid = tid < GEMM_BN && pt < n;
    src.params = x.params + (src.params_valid ? (i64)pt * groups : 0);
    const int pr = r0 + tid;
    src.row_valid = tid < GEMM_BM && pr < rows;
    src.scale = scales + (src.row_valid ? (i64)pr * groups : 0);
    src.bias = biases + (src.row_valid ? (i64)pr * groups : 0);

    float acc[2][4][4] = {};
    const int first = blockIdx.z * split_stages;
    const int last = min(groups, first + split_stages);
    const int rows_of_warp[2] = {wm, wm + 16};
    i8_products<GEMM_BM, GEMM_BN, GEMM_THREADS, I8_STAGES>(stages, src, first, last,
                                                          rows_of_warp, wn, tiles_n, acc);
    store_warp_tiles(acc, out, rows, n, r0 + wm, t0 + wn, accumulate);
}

#endif  // __CUDA_ARCH__ >= 800

// linear_tc_q4 with int8 activations (x as quantize_activations_q4 makes
// them): the same jobs, grid and splits; I8_STAGES · GEMM_I8_STAGE_BYTES of
// dynamic shared memory. sm_80+.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    linear_tc_q4_i8(MatvecJobs jobs, Q8Rows x, float* partial, int cols, int n,
                    int split_stages, int accumulate) {
    await_inputs();
#if __CUDA_ARCH__ >= 800
    const int index = block_job(jobs);
    const MatvecJob& job = jobs.job[index];
    linear_tc_q4_i8_tile(job.codes, job.scales, job.biases, x,
                         block_output(jobs, index, partial, n), job.rows,
                         blockIdx.x - job.first_block, cols, n, split_stages,
                         !partial && accumulate);
#endif
}
