// Products with stored weights: embedding rows and `x · wᵀ` for every
// storage type, accumulated in f32.
//
// One warp computes one weight row for a tile of T tokens, so the row is
// read once per tile. Each lane walks the same columns in the same order
// whatever T and the number of tokens, so within these kernels a token's
// result does not depend on the batch it came in. One token takes the
// linear_vector kernels below, and from 16 tokens on q4, q8 and bf16
// products take gemm.cu's tensor-core kernels (a prefill's routed experts
// moe_prefill.cu's), which round differently: prefill and decode agree to
// f32 rounding (each output within 1e-5 of Σ|w·x|), not bit for bit;
// repeating the same calls gives identical results.

// Launch geometry comes from the host: compile.rs passes the constants of
// geometry.rs as -D options, so a launch and its kernel cannot disagree.
#if !defined(LINEAR_WARPS) || !defined(VEC_ROWS) || !defined(VEC_WARPS) || \
    !defined(ROWS_PER_WARP) || !defined(MAX_JOBS)
#error "linear.cu: launch geometry missing (compile.rs passes geometry.rs as -D options)"
#endif

// Rows of `table` for `tokens`, dequantized: out is [n, cols].
extern "C" __global__ void embed(const u8* codes, const u16* scales, const u16* biases,
                                 int dtype, const u32* tokens, float* out, int n,
                                 int rows, int cols) {
    await_inputs();
    i64 total = (i64)n * cols;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (i64)gridDim.x * blockDim.x) {
        int t = (int)(i / cols);
        int c = (int)(i % cols);
        u32 token = tokens[t];
        // The host checks the ids; the guard only keeps a bad one in bounds.
        out[i] = token < (u32)rows ? dequantize(codes, scales, biases, dtype, token, c, cols)
                                   : 0.0f;
    }
}

// out[t, r] = Σ_c x[t, c] · w[r, c] for r < rows, t < n; x is [n, cols],
// out [n, rows]. Grid: (ceil(rows / LINEAR_WARPS), ceil(n / T)).
template <int DT, int T>
__device__ __forceinline__ void linear_tile(const u8* codes, const u16* scales,
                                            const u16* biases, const float* x, float* out,
                                            int rows, int cols, int n) {
    int warp = threadIdx.x / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    i64 r = (i64)blockIdx.x * LINEAR_WARPS + warp;
    int t0 = blockIdx.y * T;
    // Whole warps leave together; the kernel has no block-wide barrier.
    if (r >= rows || t0 >= n) return;
    int tokens = min(T, n - t0);
    const float* xt = x + (i64)t0 * cols;
    float acc[T];
#pragma unroll
    for (int i = 0; i < T; ++i) acc[i] = 0.0f;

    if (DT == DT_F32 || DT == DT_BF16) {
        for (int c = lane; c < cols; c += WARP_SIZE) {
            float w = DT == DT_F32 ? ((const float*)codes)[r * cols + c]
                                   : bf16_to_float(((const u16*)codes)[r * cols + c]);
#pragma unroll
            for (int i = 0; i < T; ++i) {
                if (i < tokens) acc[i] = fmaf(w, xt[(i64)i * cols + c], acc[i]);
            }
        }
    } else {
        // Quantized rows are read a 32-bit word at a time: eight 4-bit
        // codes (lowest nibble first) or four 8-bit codes, all in one group.
        const int per_word = DT == DT_Q4 ? 8 : 4;
        const int bits = DT == DT_Q4 ? 4 : 8;
        const u32 mask = DT == DT_Q4 ? 15u : 255u;
        int groups = cols / GROUP_SIZE;
        int words = cols / per_word;
        const u32* row = (const u32*)(codes + r * (i64)(cols / (8 / bits)));
        const u16* row_scales = scales + r * groups;
        const u16* row_biases = biases + r * groups;
        for (int wi = lane; wi < words; wi += WARP_SIZE) {
            u32 packed = row[wi];
            int c0 = wi * per_word;
            float scale = bf16_to_float(row_scales[c0 / GROUP_SIZE]);
            float bias = bf16_to_float(row_biases[c0 / GROUP_SIZE]);
            float w[8];
#pragma unroll
            for (int j = 0; j < per_word; ++j) {
                w[j] = fmaf((float)((packed >> (bits * j)) & mask), scale, bias);
            }
#pragma unroll
            for (int i = 0; i < T; ++i) {
                if (i < tokens) {
                    const float* xr = xt + (i64)i * cols + c0;
#pragma unroll
                    for (int j = 0; j < per_word; ++j) acc[i] = fmaf(w[j], xr[j], acc[i]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < T; ++i) {
        float v = warp_sum(acc[i]);
        if (lane == 0 && i < tokens) out[(i64)(t0 + i) * rows + r] = v;
    }
}

#define LINEAR_KERNEL(name, DT, T)                                                        \
    extern "C" __global__ void __launch_bounds__(LINEAR_WARPS * WARP_SIZE)                \
        name(const u8* codes, const u16* scales, const u16* biases, const float* x,       \
             float* out, int rows, int cols, int n) {                                     \
        await_inputs();                                                                   \
        linear_tile<DT, T>(codes, scales, biases, x, out, rows, cols, n);                 \
    }

LINEAR_KERNEL(linear_f32_t1, DT_F32, 1)
LINEAR_KERNEL(linear_f32_t8, DT_F32, 8)
LINEAR_KERNEL(linear_bf16_t1, DT_BF16, 1)
LINEAR_KERNEL(linear_bf16_t8, DT_BF16, 8)
LINEAR_KERNEL(linear_q8_t1, DT_Q8, 1)
LINEAR_KERNEL(linear_q8_t8, DT_Q8, 8)
LINEAR_KERNEL(linear_q4_t1, DT_Q4, 1)
LINEAR_KERNEL(linear_q4_t8, DT_Q4, 8)

// ---- One token: rows read a 32-bit word per lane at a time -------------
//
// Decode is a matrix-vector product bound by how fast weights stream from
// memory. A warp reads 128 consecutive bytes of a row per step (one word
// per lane, bypassing L1, which keeps x), several steps in flight, and
// dequantizes in registers with f32 accumulation. Narrow per-lane words
// keep each lane's slice of x short, so x is read from L1 in few
// transactions (a 16-byte word per lane would make the lanes' x slices
// 128 bytes apart: one transaction per lane). A warp takes R rows that
// share x, reading each x value once for all of them. Lanes walk the row
// in a fixed order and the warp's sum is a fixed butterfly: the result
// depends only on the row and x.

// Columns one 32-bit word of a row holds. A word of q2 or q3 bit planes
// holds 16 columns: byte k at shift 2s is column 16s + 4·(word % 4) + k
// of the group; q3 words come with their 16 high bits (PackedWord).
#define WORD_COLS(DT)                                                                 \
    ((DT) == DT_Q2 || (DT) == DT_Q3        ? 16                                        \
     : (DT) == DT_Q4 || (DT) == DT_MXFP4 ? 8                                         \
     : (DT) == DT_Q8                     ? 4                                         \
     : (DT) == DT_BF16                   ? 2                                         \
                                         : 1)
// Words per lane in flight per row, by kernel, and the blocks per SM the
// compiler keeps registers for (1: no constraint). Tunable for experiments
// through MOEFLUX_CUDA_DEFINES (compile.rs).
#ifndef WORD_UNROLL
#define WORD_UNROLL 4
#endif
#ifndef LINEAR_SPLIT_UNROLL
#define LINEAR_SPLIT_UNROLL WORD_UNROLL
#endif
#ifndef LINEAR_ROWS_UNROLL
#define LINEAR_ROWS_UNROLL WORD_UNROLL
#endif
#ifndef LINEAR_MIN_BLOCKS
#define LINEAR_MIN_BLOCKS 1
#endif

// Bytes of a stored row of `cols` values.
__device__ __forceinline__ i64 row_bytes(int dt, int cols) {
    return dt == DT_Q2   ? cols / 4
           : dt == DT_Q3 ? (i64)cols * 3 / 8
           : dt == DT_Q4 || dt == DT_MXFP4 ? cols / 2
           : dt == DT_Q8 ? cols
           : dt == DT_BF16 ? 2 * (i64)cols
                           : 4 * (i64)cols;
}

// What a lane loads per word: the 32-bit word, and for q3 also the 16
// high bits of its columns (bit 4s + k: byte k at shift 2s).
template <int DT>
struct PackedWord {
    typedef u32 T;
};
template <>
struct PackedWord<DT_Q3> {
    typedef uint2 T;
};

// The high bits of plane word `sub` (0-3) of a q3 group from the group's
// u64 of high bits (h0: columns 0-31, h1: 32-63): columns 16s + 4 sub + k
// to bit 4s + k.
__device__ __forceinline__ u32 q3_word_high(u32 h0, u32 h1, int sub) {
    u32 a = (h0 >> (4 * sub)) & 0x000F000Fu;  // planes 0 and 1
    u32 b = (h1 >> (4 * sub)) & 0x000F000Fu;  // planes 2 and 3
    return ((a | (a >> 12)) & 0xFFu) | (((b | (b >> 12)) & 0xFFu) << 8);
}

// A word of a weight row: read once, so not kept in L1.
__device__ __forceinline__ u32 load_streaming(const void* p) {
    u32 v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// Byte k of `word` as a float, exactly: the bits 0x4B0000qq are 2^23 + qq.
__device__ __forceinline__ float byte_value(u32 word, int k) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | (u32)k)) - 8388608.0f;
}

// 4-bit codes as the floats 16 + q, one byte permute each. Each byte of
// the prepared word holds 0x80 | q << 3, so with 0x41 above it the f32
// bits are 0x41 (0x80 | q << 3) 00 00: exponent 2^4, the code in the top
// mantissa bits, i.e. exactly 16 + q. even_codes/odd_codes prepare the
// even columns (low nibbles) and the odd ones (high nibbles) of a word.
__device__ __forceinline__ u32 even_codes(u32 w) { return ((w << 3) & 0x78787878u) | 0x80808080u; }
__device__ __forceinline__ u32 odd_codes(u32 w) { return ((w >> 1) & 0x78787878u) | 0x80808080u; }
// Byte k of a prepared word as 16 + q.
__device__ __forceinline__ float code16(u32 prepared, int k) {
    return __uint_as_float(__byte_perm(prepared, 0x4100u, 0x5044u | ((u32)k << 8)));
}

// One stored row: its codes (or values), and for quantized types the
// scales and biases of its groups.
struct WeightRow {
    const u8* codes;
    const u16* scales;
    const u16* biases;
};

__device__ __forceinline__ WeightRow weight_row(int dt, const u8* codes, const u16* scales,
                                                const u16* biases, i64 r, int cols) {
    i64 groups = cols / GROUP_SIZE;
    WeightRow row = {codes + r * row_bytes(dt, cols), scales + r * groups, biases + r * groups};
    return row;
}

// The x values word `word` of a row multiplies (x at the row's first
// column; aligned to a word's columns).
template <int DT>
__device__ __forceinline__ void word_x(const float* x, int word, float (&v)[WORD_COLS(DT)]) {
    const int c0 = word * WORD_COLS(DT);
    if (DT == DT_F32) {
        v[0] = x[c0];
    } else if (DT == DT_BF16) {
        float2 a = *(const float2*)(x + c0);
        v[0] = a.x;
        v[1] = a.y;
    } else if (DT == DT_Q8) {
        float4 a = *(const float4*)(x + c0);
        v[0] = a.x;
        v[1] = a.y;
        v[2] = a.z;
        v[3] = a.w;
    } else if (DT == DT_Q2 || DT == DT_Q3) {
        // Columns 16s + 4·(word % 4) .. + 4 of the word's group, s = 0..3.
        const float* g = x + (i64)(word / 4) * GROUP_SIZE + 4 * (word % 4);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            float4 a = *(const float4*)(g + 16 * s);
            v[4 * s] = a.x;
            v[4 * s + 1] = a.y;
            v[4 * s + 2] = a.z;
            v[4 * s + 3] = a.w;
        }
    } else {
        float4 a = *(const float4*)(x + c0);
        float4 c = *(const float4*)(x + c0 + 4);
        v[0] = a.x;
        v[1] = a.y;
        v[2] = a.z;
        v[3] = a.w;
        v[4] = c.x;
        v[5] = c.y;
        v[6] = c.z;
        v[7] = c.w;
    }
}

// The low 32 bits of a packed word (the word itself but for q3).
__device__ __forceinline__ u32 plane_word(u32 w) { return w; }
__device__ __forceinline__ u32 plane_word(uint2 w) { return w.x; }
__device__ __forceinline__ u32 high_word(u32) { return 0u; }
__device__ __forceinline__ u32 high_word(uint2 w) { return w.y; }

// acc += word w of `row` · its x values v.
template <int DT>
__device__ __forceinline__ void dot_word(const WeightRow& row, typename PackedWord<DT>::T packed,
                                         int word, const float (&v)[WORD_COLS(DT)], float& acc) {
    const int c0 = word * WORD_COLS(DT);
    const u32 w = plane_word(packed);
    if (DT == DT_Q2 || DT == DT_Q3) {
        // w·x = s·Σ q·x + b·Σ x over the word's 16 columns, q exact
        // (byte_value): the affine map once per word, no offset whose
        // cancellation would cost accuracy at 4 or 8 levels.
        int group = word / 4;
        float s = bf16_to_float(row.scales[group]);
        float b = bf16_to_float(row.biases[group]);
        u32 high = high_word(packed);
        float dot = 0.0f, sum = 0.0f;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            u32 q = (w >> (2 * p)) & 0x03030303u;
            if (DT == DT_Q3) {
                u32 h = (high >> (4 * p)) & 15u;
                q |= ((h & 1u) << 2) | ((h & 2u) << 9) | ((h & 4u) << 16) | ((h & 8u) << 23);
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                dot = fmaf(byte_value(q, k), v[4 * p + k], dot);
                sum += v[4 * p + k];
            }
        }
        acc = fmaf(s, dot, fmaf(b, sum, acc));
        return;
    }
    if (DT == DT_MXFP4) {
        // Columns c0..c0+7 (low nibble first) of one block of 32: the
        // e2m1 values' dot, then the block's power of two (exact).
        const u8* exponents = (const u8*)row.scales;
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            u32 byte = (w >> (8 * k)) & 0xffu;
            dot = fmaf(e2m1_value(byte & 15u), v[2 * k], dot);
            dot = fmaf(e2m1_value(byte >> 4), v[2 * k + 1], dot);
        }
        acc = fmaf(e8m0_scale(exponents[c0 / MXFP4_BLOCK]), dot, acc);
        return;
    }
    if (DT == DT_F32) {
        acc = fmaf(__uint_as_float(w), v[0], acc);
    } else if (DT == DT_BF16) {
        acc = fmaf(__uint_as_float(w << 16), v[0], acc);
        acc = fmaf(__uint_as_float(w & 0xffff0000u), v[1], acc);
    } else {
        int group = c0 / GROUP_SIZE;
        float s = bf16_to_float(row.scales[group]);
        float b = bf16_to_float(row.biases[group]);
        if (DT == DT_Q8) {
            // Columns c0..c0+3, lowest byte first.
            acc = fmaf(fmaf(byte_value(w, 0), s, b), v[0], acc);
            acc = fmaf(fmaf(byte_value(w, 1), s, b), v[1], acc);
            acc = fmaf(fmaf(byte_value(w, 2), s, b), v[2], acc);
            acc = fmaf(fmaf(byte_value(w, 3), s, b), v[3], acc);
        } else {
            // Columns c0..c0+7, two per byte, low nibble first: the low
            // nibbles are the even columns. w·x = s·(16 + q)·x + (b - 16 s)·x,
            // so the dot runs over 16 + q (one permute a weight, see
            // code16) and the affine map is applied once per word: about
            // a quarter fewer instructions a weight than dequantizing each
            // one, which bounds these kernels (a load-only pass over the
            // same rows streams 2.3 times faster on an H100).
            u32 even = even_codes(w);
            u32 odd = odd_codes(w);
            float dot = code16(even, 0) * v[0];
            dot = fmaf(code16(odd, 0), v[1], dot);
            dot = fmaf(code16(even, 1), v[2], dot);
            dot = fmaf(code16(odd, 1), v[3], dot);
            dot = fmaf(code16(even, 2), v[4], dot);
            dot = fmaf(code16(odd, 2), v[5], dot);
            dot = fmaf(code16(even, 3), v[6], dot);
            dot = fmaf(code16(odd, 3), v[7], dot);
            float sum = v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
            acc = fmaf(s, dot, fmaf(fmaf(-16.0f, s, b), sum, acc));
        }
    }
}

// Bytes from a row's group of q4 codes to its next: Q4_GROUP_BYTES row by
// row, CODE_TILE_ROWS · Q4_GROUP_BYTES tiled (expert codes, moe.cu).
__device__ __forceinline__ int code_step(bool tiled) {
    return tiled ? CODE_TILE_ROWS * Q4_GROUP_BYTES : Q4_GROUP_BYTES;
}

// Word `w` of a row (q3: its plane word, at byte 24·(w / 4) + 4·(w % 4),
// and the high bits of its columns from the group's last 8 bytes). TILED
// (q4 expert codes, moe.cu): the row's groups CODE_TILE_ROWS · 32 bytes
// apart.
template <int DT, bool TILED = false>
__device__ __forceinline__ typename PackedWord<DT>::T load_word(const u8* codes, int w) {
    if (TILED) return load_streaming(codes + (i64)(w / 8) * code_step(true) + 4 * (w % 8));
    return load_streaming(codes + 4 * (i64)w);
}

template <>
__device__ __forceinline__ uint2 load_word<DT_Q3, false>(const u8* codes, int w) {
    const u8* group = codes + (i64)(w / 4) * Q3_GROUP_BYTES;
    int sub = w % 4;
    u32 plane = load_streaming(group + 4 * sub);
    u32 h0 = load_streaming(group + 16);
    u32 h1 = load_streaming(group + 20);
    return make_uint2(plane, q3_word_high(h0, h1, sub));
}

// One batch of a lane's words: U words of each of R rows from word `base`
// on, a warp's lanes taking consecutive words (zero past `end`).
template <int DT, int R, int U, bool TILED>
__device__ __forceinline__ void load_words(const WeightRow* rows, int base, int end,
                                           typename PackedWord<DT>::T (&packed)[U][R]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        int w = base + u * WARP_SIZE;
#pragma unroll
        for (int i = 0; i < R; ++i) {
            packed[u][i] = w < end ? load_word<DT, TILED>(rows[i].codes, w)
                                   : typename PackedWord<DT>::T();
        }
    }
}

// The input of a one-token product whose RMSNorm the product applies
// itself (the `_normed` kernels below): the products run over
// x · (offset + weight), each lane adds up its columns' x² as it goes, and
// the sums are scaled by 1/sqrt(mean(x²) + eps) at the end. No barrier or
// extra memory round trip comes before the first product. `normed`, where
// block 0 stores the normalised x for the products after, may be null.
struct FusedNorm {
    const float* weight;
    float* normed;
    float eps;
    float offset;
};

// acc[i] += the batch load_words read from `base` · xs[i]. With NORMED
// (and SHARED_X) the x values are scaled by offset + norm.weight as they
// are read and their squares added to `squares`.
template <int DT, int R, int U, bool SHARED_X, bool NORMED>
__device__ __forceinline__ void dot_words(const WeightRow* rows, const float* const* xs,
                                          int base, int end,
                                          const typename PackedWord<DT>::T (&packed)[U][R],
                                          float* acc, const FusedNorm& norm, float& squares) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        int w = base + u * WARP_SIZE;
        if (w < end) {
            float v[WORD_COLS(DT)];
            if (SHARED_X) {
                word_x<DT>(xs[0], w, v);
                if (NORMED) {
                    float g[WORD_COLS(DT)];
                    word_x<DT>(norm.weight, w, g);
#pragma unroll
                    for (int j = 0; j < WORD_COLS(DT); ++j) {
                        squares = fmaf(v[j], v[j], squares);
                        v[j] *= norm.offset + g[j];
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < R; ++i) {
                if (!SHARED_X) word_x<DT>(xs[i], w, v);
                dot_word<DT>(rows[i], packed[u][i], w, v, acc[i]);
            }
        }
    }
}

// acc[i] += Σ this lane's share of rows[i] · xs[i] over the words
// [begin, end) of R rows (a word holds WORD_COLS(DT) columns; each x is
// aligned to a word's columns: 16 bytes for q4 and q8). U words per row
// (WORD_UNROLL unless a kernel tunes it) are loaded before any is used, so
// short ranges are in flight at once too. With SHARED_X every row takes
// xs[0]; NORMED as dot_words; TILED as load_word.
template <int DT, int R, bool SHARED_X, int U = WORD_UNROLL, bool NORMED = false,
          bool TILED = false>
__device__ __forceinline__ void dot_rows(const WeightRow* rows, const float* const* xs,
                                         int begin, int end, int lane, float* acc,
                                         const FusedNorm& norm = FusedNorm{},
                                         float* squares = nullptr) {
    float lane_squares = 0.0f;
    for (int base = begin + lane; base < end; base += U * WARP_SIZE) {
        typename PackedWord<DT>::T packed[U][R];
        load_words<DT, R, U, TILED>(rows, base, end, packed);
        dot_words<DT, R, U, SHARED_X, NORMED>(rows, xs, base, end, packed, acc, norm,
                                               lane_squares);
    }
    if (NORMED) *squares = lane_squares;
}

// 1/sqrt(mean(x²) + eps) from the sum of squares of `cols` values.
__device__ __forceinline__ float inverse_rms(float squares, int cols, float eps) {
    return 1.0f / sqrtf(squares / (float)cols + eps);
}

// Block 0 stores x · inv · (offset + weight) for the products after.
__device__ __forceinline__ void store_normed(const float* x, int cols, const FusedNorm& norm,
                                             float inv) {
    if (blockIdx.x != 0 || !norm.normed) return;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        norm.normed[c] = x[c] * inv * (norm.offset + norm.weight[c]);
    }
}

// The words of a row that warp `warp` of `warps` takes: consecutive equal
// shares (each word stands alone, so any split is valid).
__device__ __forceinline__ int2 warp_words(int words, int warp, int warps) {
    return make_int2((int)((i64)words * warp / warps), (int)((i64)words * (warp + 1) / warps));
}

// VEC_ROWS and VEC_WARPS (geometry.rs): rows per block and warps per block
// of the one-token kernels: the warps of a block split the columns of its
// rows (many loads in flight even for a matrix of few rows), and their sums
// are added in warp order. MAX_JOBS: matrices one launch of linear_vector
// may cover.

// One matrix of a linear_vector launch: its blocks are
// first_block .. first_block + ceil(rows / VEC_ROWS).
struct MatvecJob {
    const u8* codes;
    const u16* scales;
    const u16* biases;
    float* out;
    int rows;
    int first_block;
};

struct MatvecJobs {
    MatvecJob job[MAX_JOBS];
    int count;
};

// The job (matrix) this block's rows belong to.
__device__ __forceinline__ int block_job(const MatvecJobs& jobs) {
    int j = 0;
    while (j + 1 < jobs.count && (int)blockIdx.x >= jobs.job[j + 1].first_block) ++j;
    return j;
}

// Elements of a launch's outputs over all its matrices (n rows each), and
// those before job `index`: where a job's part of split sums lies.
__device__ __forceinline__ i64 outputs_before(const MatvecJobs& jobs, int index, int n) {
    i64 before = 0;
    for (int j = 0; j < index; ++j) before += (i64)n * jobs.job[j].rows;
    return before;
}

// out_j (+)= the sum, in split order, of the `splits` parts of each of a
// launch's outputs that linear_few.cu's or gemm.cu's products over jobs
// wrote (split-major over the launch's outputs).
extern "C" __global__ void sum_split_parts(const float* partial, MatvecJobs jobs, int n,
                                           int splits, int accumulate) {
    await_inputs();
    const i64 total = outputs_before(jobs, jobs.count, n);
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (i64)gridDim.x * blockDim.x) {
        int index = 0;
        i64 before = 0;
        while (index + 1 < jobs.count && i >= before + (i64)n * jobs.job[index].rows) {
            before += (i64)n * jobs.job[index].rows;
            ++index;
        }
        float sum = 0.0f;
        for (int z = 0; z < splits; ++z) sum += partial[z * total + i];
        float* out = jobs.job[index].out + (i - before);
        *out = accumulate ? *out + sum : sum;
    }
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Asks L2 for the bytes [p, p + n), one 128-byte line per thread at a time.
__device__ __forceinline__ void prefetch_span(const void* p, i64 n) {
    for (i64 at = (i64)threadIdx.x * 128; at < n; at += (i64)blockDim.x * 128) {
        prefetch_l2((const u8*)p + at);
    }
}

// Asks L2 for the weights (codes, scales and biases) of the `per_block`
// rows this block of a one-token product reads. Weights do not depend on
// earlier kernels, so this runs before await_inputs: under programmatic
// launch the fetch overlaps the end of the kernel before.
template <int DT>
__device__ __forceinline__ void prefetch_block_rows(const MatvecJobs& jobs, int cols,
                                                    int per_block) {
    const MatvecJob& job = jobs.job[block_job(jobs)];
    i64 first = (i64)(blockIdx.x - job.first_block) * per_block;
    i64 count = min((i64)per_block, (i64)job.rows - first);
    if (count <= 0) return;
    prefetch_span(job.codes + first * row_bytes(DT, cols), count * row_bytes(DT, cols));
    if (DT == DT_Q4 || DT == DT_Q8) {
        i64 groups = cols / GROUP_SIZE;
        prefetch_span(job.scales + first * groups, count * groups * 2);
        prefetch_span(job.biases + first * groups, count * groups * 2);
    }
}

// out_j[r] (+)= Σ_c w_j[r, c] · x[c] for one token and up to MAX_JOBS
// matrices of the same type sharing x (one launch for q, k and v, say);
// cols is a multiple of WORD_COLS(DT). With `accumulate` the result is
// added to out (a residual connection) instead of stored. With NORMED the
// products take RMSNorm(x) (see FusedNorm).
template <int DT, bool NORMED>
__device__ __forceinline__ void linear_vector(const MatvecJobs& jobs, const float* x,
                                              int cols, int accumulate, const FusedNorm& norm) {
    __shared__ float partial[VEC_WARPS][VEC_ROWS];
    __shared__ float partial_squares[VEC_WARPS];
    const MatvecJob& job = jobs.job[block_job(jobs)];
    int warp = threadIdx.x / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    i64 first = (i64)(blockIdx.x - job.first_block) * VEC_ROWS;
    WeightRow w[VEC_ROWS];
    float acc[VEC_ROWS];
#pragma unroll
    for (int i = 0; i < VEC_ROWS; ++i) {
        // A row past the end repeats the last one; its sum is not written.
        i64 r = min(first + i, (i64)job.rows - 1);
        w[i] = weight_row(DT, job.codes, job.scales, job.biases, r, cols);
        acc[i] = 0.0f;
    }
    int2 range = warp_words(cols / WORD_COLS(DT), warp, VEC_WARPS);
    float squares = 0.0f;
    dot_rows<DT, VEC_ROWS, true, LINEAR_SPLIT_UNROLL, NORMED>(w, &x, range.x, range.y, lane,
                                                              acc, norm, &squares);
#pragma unroll
    for (int i = 0; i < VEC_ROWS; ++i) {
        float v = warp_sum(acc[i]);
        if (lane == 0) partial[warp][i] = v;
    }
    if (NORMED) {
        squares = warp_sum(squares);
        if (lane == 0) partial_squares[warp] = squares;
    }
    __syncthreads();
    float inv = 1.0f;
    if (NORMED) {
        float total = 0.0f;
        for (int k = 0; k < VEC_WARPS; ++k) total += partial_squares[k];
        inv = inverse_rms(total, cols, norm.eps);
    }
    if (threadIdx.x < VEC_ROWS && first + threadIdx.x < job.rows) {
        float v = 0.0f;
        for (int k = 0; k < VEC_WARPS; ++k) v += partial[k][threadIdx.x];
        if (NORMED) v *= inv;
        i64 r = first + threadIdx.x;
        job.out[r] = accumulate ? job.out[r] + v : v;
    }
    if (NORMED) store_normed(x, cols, norm, inv);
}

// ROWS_PER_WARP (geometry.rs): rows per warp of linear_vector_rows.
// linear_vector with whole rows per warp (ROWS_PER_WARP of them, so a block
// covers VEC_WARPS · ROWS_PER_WARP rows) instead of columns split across the
// block's warps: longer-lived warps, no block-wide reduction; faster for
// matrices of many rows (the host chooses). With NORMED each warp sees all
// of x, so each finds the norm's scale alone.
template <int DT, bool NORMED>
__device__ __forceinline__ void linear_vector_rows(const MatvecJobs& jobs, const float* x,
                                                   int cols, int accumulate,
                                                   const FusedNorm& norm) {
    const MatvecJob& job = jobs.job[block_job(jobs)];
    int warp = threadIdx.x / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    i64 first = ((i64)(blockIdx.x - job.first_block) * VEC_WARPS + warp) * ROWS_PER_WARP;
    // Warps past the end leave, except in block 0 of a NORMED launch, which
    // stores the normalised x (they repeat the last row and write no sum).
    if (first >= job.rows && !(NORMED && blockIdx.x == 0)) return;
    WeightRow w[ROWS_PER_WARP];
    float acc[ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
        // A row past the end repeats the last one; its sum is not written.
        i64 r = min(first + i, (i64)job.rows - 1);
        w[i] = weight_row(DT, job.codes, job.scales, job.biases, r, cols);
        acc[i] = 0.0f;
    }
    float squares = 0.0f;
    dot_rows<DT, ROWS_PER_WARP, true, LINEAR_ROWS_UNROLL, NORMED>(
        w, &x, 0, cols / WORD_COLS(DT), lane, acc, norm, &squares);
    float inv = NORMED ? inverse_rms(warp_sum(squares), cols, norm.eps) : 1.0f;
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
        float v = warp_sum(acc[i]);
        if (NORMED) v *= inv;
        i64 r = first + i;
        if (lane == 0 && r < job.rows) job.out[r] = accumulate ? job.out[r] + v : v;
    }
    if (NORMED) store_normed(x, cols, norm, inv);
}

#define LINEAR_VECTOR_KERNEL(name, DT)                                                    \
    extern "C" __global__ void __launch_bounds__(VEC_WARPS * WARP_SIZE, LINEAR_MIN_BLOCKS)\
        name(MatvecJobs jobs, const float* x, int cols, int accumulate) {                 \
        prefetch_block_rows<DT>(jobs, cols, VEC_ROWS);                                    \
        await_inputs();                                                                   \
        linear_vector<DT, false>(jobs, x, cols, accumulate, FusedNorm{});                 \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(VEC_WARPS * WARP_SIZE, LINEAR_MIN_BLOCKS)\
        name##_rows(MatvecJobs jobs, const float* x, int cols, int accumulate) {          \
        prefetch_block_rows<DT>(jobs, cols, VEC_WARPS * ROWS_PER_WARP);                   \
        await_inputs();                                                                   \
        linear_vector_rows<DT, false>(jobs, x, cols, accumulate, FusedNorm{});            \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(VEC_WARPS * WARP_SIZE, LINEAR_MIN_BLOCKS)\
        name##_normed(MatvecJobs jobs, const float* x, int cols, int accumulate,          \
                      FusedNorm norm) {                                                   \
        prefetch_block_rows<DT>(jobs, cols, VEC_ROWS);                                    \
        prefetch_span(norm.weight, 4 * (i64)cols);                                        \
        await_inputs();                                                                   \
        linear_vector<DT, true>(jobs, x, cols, accumulate, norm);                         \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(VEC_WARPS * WARP_SIZE, LINEAR_MIN_BLOCKS)\
        name##_rows_normed(MatvecJobs jobs, const float* x, int cols, int accumulate,     \
                           FusedNorm norm) {                                              \
        prefetch_block_rows<DT>(jobs, cols, VEC_WARPS * ROWS_PER_WARP);                   \
        prefetch_span(norm.weight, 4 * (i64)cols);                                        \
        await_inputs();                                                                   \
        linear_vector_rows<DT, true>(jobs, x, cols, accumulate, norm);                    \
    }

LINEAR_VECTOR_KERNEL(linear_vector_f32, DT_F32)
LINEAR_VECTOR_KERNEL(linear_vector_bf16, DT_BF16)
LINEAR_VECTOR_KERNEL(linear_vector_q8, DT_Q8)
LINEAR_VECTOR_KERNEL(linear_vector_q4, DT_Q4)
