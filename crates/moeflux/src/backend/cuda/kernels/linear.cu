// Products with stored weights: embedding rows and `x · wᵀ` for every
// storage type, accumulated in f32.
//
// One warp computes one weight row for a tile of T tokens, so the row is
// read once per tile. Each lane walks the same columns in the same order
// whatever T and the number of tokens, so a token's result does not depend
// on the batch it came in: prefill and decode agree bit for bit.

#define LINEAR_WARPS 4

// Rows of `table` for `tokens`, dequantized: out is [n, cols].
extern "C" __global__ void embed(const u8* codes, const u16* scales, const u16* biases,
                                 int dtype, const u32* tokens, float* out, int n,
                                 int rows, int cols) {
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
