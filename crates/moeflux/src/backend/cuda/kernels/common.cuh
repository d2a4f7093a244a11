// Helpers shared by every moeflux kernel. NVRTC compiles the kernel files
// as one program with no headers: compile.rs puts this file first and the
// others after it, so nothing here may depend on the CUDA runtime headers.
//
// Conventions: activations are row-major f32 `[rows, cols]`; sizes that can
// exceed 2^31 elements are `long long`; every kernel bounds-checks its
// indices and loops grid-stride where the grid is capped.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// Storage types of a stored matrix (DType in Rust; see docs/FORMAT.md).
#define DT_F32 0
#define DT_BF16 1
#define DT_Q8 2
#define DT_Q4 3
// q3 and q2 (routed experts only): per group of 64, 16 bytes of bit
// planes (byte j: columns j, j+16, j+32, j+48 in bits 0-1, 2-3, 4-5, 6-7),
// then for q3 a little-endian u64 whose bit c is bit 2 of column c.
#define DT_Q3 4
#define DT_Q2 5
// MXFP4 (routed experts only): e2m1 codes packed as q4's, and in place of
// scales one e8m0 exponent byte per 32 columns (two per group of 64).
#define DT_MXFP4 6
#define MXFP4_BLOCK 32
// Input weights sharing one scale and bias in the quantized types.
#define GROUP_SIZE 64
// Bytes of one group of q4, q3 and q2 codes.
#define Q4_GROUP_BYTES 32
#define Q3_GROUP_BYTES 24
#define Q2_GROUP_BYTES 16

// Programmatic dependent launch (decode graphs, graph.rs): every kernel
// calls this before touching memory. It waits until the kernels this one
// depends on have finished and their writes are visible, then lets the next
// kernel's blocks start launching, so their launch overlaps this kernel's
// work instead of following it. On a plain launch both are no-ops.
__device__ __forceinline__ void await_inputs() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#if __CUDA_ARCH__ >= 800
// x rounded to TF32 (its upper 19 bits), for the TF32 MMAs.
__device__ __forceinline__ u32 to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// c += a · b, one m16n8k8 TF32 MMA (fragments as gdn_chunked.cu describes
// them).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// (hi, lo) of x as TF32 with x ≈ hi + lo (x - hi is exact in f32).
__device__ __forceinline__ void split_tf32(float x, u32& hi, u32& lo) {
    hi = to_tf32(x);
    lo = to_tf32(x - __uint_as_float(hi));
}

// c += a · b at about f32 accuracy: three TF32 MMAs of operands split by
// split_tf32, the small terms first. Callers split each fragment once and
// reuse it across the tiles it meets.
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const u32 (&ah)[4], const u32 (&al)[4],
                                           const u32 (&bh)[2], const u32 (&bl)[2]) {
    mma_tf32(c, al, bh);
    mma_tf32(c, ah, bl);
    mma_tf32(c, ah, bh);
}
#endif

#if __CUDA_ARCH__ >= 800
// bf16 MMAs and the conversions that feed them.
// c += a · b for one m16n8k16 tile (fragments as gemm.cu describes them).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (first, second) rounded to nearest bf16, first in the low half.
// cvt.rn.bf16x2.f32 d, a, b puts a in the upper half and b in the lower.
__device__ __forceinline__ u32 bf16x2_rn(float first, float second) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(second), "f"(first));
    return r;
}

// The upper halves of two f32 whose lower halves are zero (so the bf16 is
// exact), first in the low half.
__device__ __forceinline__ u32 bf16x2_exact(float first, float second) {
    return __byte_perm(__float_as_uint(first), __float_as_uint(second), 0x7632);
}

// Splits a pair of activations into hi = bf16(x) and lo = bf16(x - hi);
// x - hi is exact in f32.
__device__ __forceinline__ void split_pair(float first, float second, u32& hi, u32& lo) {
    hi = bf16x2_rn(first, second);
    float h0 = __uint_as_float(hi << 16);
    float h1 = __uint_as_float(hi & 0xffff0000u);
    lo = bf16x2_rn(first - h0, second - h1);
}
#endif

#if __CUDA_ARCH__ >= 800
// Asynchronous copies from global to shared memory (cp.async): the data
// does not pass through registers, so a kernel can keep several stages in
// flight without holding them. `valid` false fills the destination with
// zeros (the source is not read). A commit closes the group of copies
// issued since the last one; copy_async_wait<N> returns once at most N
// groups are still in flight (the thread's own copies only: a barrier
// makes them visible to the block).
__device__ __forceinline__ void copy_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :
                 : "r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void copy_async8(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n"
                 :
                 : "r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "r"(valid ? 8 : 0)
                 : "memory");
}

__device__ __forceinline__ void copy_async4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :
                 : "r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ void copy_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void copy_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

__device__ __forceinline__ float bf16_to_float(u16 v) {
    return __int_as_float(((u32)v) << 16);
}

// The e2m1 value of a 4-bit code: bit 3 the sign, bits 1-2 the exponent,
// bit 0 the mantissa (0, 0.5, 1, 1.5, 2, 3, 4, 6).
__device__ __forceinline__ float e2m1_value(u32 q) {
    const u32 e = (q >> 1) & 3u, m = q & 1u;
    const float magnitude = e == 0 ? 0.5f * (float)m : __uint_as_float(((126u + e) << 23) | (m << 22));
    return (q & 8u) ? -magnitude : magnitude;
}

// 2^(e - 127) of an e8m0 exponent byte (0: 2^-127, below f32's normal range).
__device__ __forceinline__ float e8m0_scale(u32 e) {
    return __uint_as_float(e == 0 ? 0x00400000u : e << 23);
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// torch's softplus (beta 1, threshold 20).
__device__ __forceinline__ float softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(FULL_MASK, v, offset);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    }
    return v;
}

// Sum over the block, returned to every thread. blockDim.x must be a
// multiple of 32; `scratch` is 32 floats of shared memory. Every thread of
// the block must call it (it synchronises).
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x % WARP_SIZE;
    int warp = threadIdx.x / WARP_SIZE;
    int warps = blockDim.x / WARP_SIZE;
    v = warp_sum(v);
    __syncthreads();  // an earlier call may still be reading scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? scratch[lane] : 0.0f);
}

// Maximum over the block; same contract as block_sum.
__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x % WARP_SIZE;
    int warp = threadIdx.x / WARP_SIZE;
    int warps = blockDim.x / WARP_SIZE;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? scratch[lane] : NEG_INF);
}

// Element (row, col) of a stored matrix as f32: `q * scale + bias` for the
// quantized types (q * scale is exact, so one fma rounds like the CPU's
// multiply then add).
__device__ __forceinline__ float dequantize(const u8* codes, const u16* scales,
                                            const u16* biases, int dtype, i64 row,
                                            int col, int cols) {
    i64 at = row * cols + col;
    if (dtype == DT_F32) return ((const float*)codes)[at];
    if (dtype == DT_BF16) return bf16_to_float(((const u16*)codes)[at]);
    if (dtype == DT_MXFP4) {
        u8 pair = codes[at / 2];
        u32 q = (col & 1) ? (u32)(pair >> 4) : (u32)(pair & 15);
        const u8* exponents = (const u8*)scales;
        return e2m1_value(q) * e8m0_scale(exponents[at / MXFP4_BLOCK]);
    }
    i64 group = row * (cols / GROUP_SIZE) + col / GROUP_SIZE;
    float scale = bf16_to_float(scales[group]);
    float bias = bf16_to_float(biases[group]);
    u32 q;
    if (dtype == DT_Q8) {
        q = codes[at];
    } else if (dtype == DT_Q4) {
        u8 pair = codes[at / 2];
        q = (col & 1) ? (u32)(pair >> 4) : (u32)(pair & 15);
    } else {
        const u8* g = codes + group * (dtype == DT_Q3 ? Q3_GROUP_BYTES : Q2_GROUP_BYTES);
        int c = col % GROUP_SIZE;
        q = (g[c % 16] >> (2 * (c / 16))) & 3u;
        if (dtype == DT_Q3) q |= ((g[16 + c / 8] >> (c % 8)) & 1u) << 2;
    }
    return fmaf((float)q, scale, bias);
}
