// A KV cache's keys and values in the encodings of KvType (backend/kv.rs),
// bit for bit as the host defines them: each side (keys, or values) is
// `data`, rows `[capacity, kv_heads · head_dim]` of f32 values, bf16 bits
// or int8 codes, and for q8 `scales`, an f32 per KV_Q8_BLOCK values of a
// row (null for the other types). The attention kernels (attention.cu) are
// compiled once per encoding and read every value as the cache holds it,
// in f32: a q8 value is its code times its block's scale.

#if !defined(KV_Q8_BLOCK)
#error "kv_cache.cu: KV_Q8_BLOCK missing (compile.rs passes geometry.rs as -D options)"
#endif

// A q8 block is one warp's values: the quantization takes its maximum with
// a warp reduction.
static_assert(KV_Q8_BLOCK == WARP_SIZE, "a q8 block is a warp's 32 values");

#define KV_F32 0
#define KV_BF16 1
#define KV_Q8 2
// Bytes of one value (a q8 code; its scale aside).
#define KV_BYTES(KV) ((KV) == KV_F32 ? 4 : (KV) == KV_BF16 ? 2 : 1)
// Values in one 16-byte load.
#define KV_PER_LOAD(KV) (16 / KV_BYTES(KV))

// x rounded to bf16 (to nearest, ties to even; a NaN stays a NaN), as its
// bits: kv::round_bf16.
__device__ __forceinline__ u16 kv_round_bf16(float x) {
    const u32 bits = __float_as_uint(x);
    if (x != x) return (u16)((bits >> 16) | 0x40u);
    return (u16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// One q8 block, a value per lane of a whole warp: the block's scale
// (max|x| / 127, every lane) into `scale`, and this lane's code
// (round(x / scale), ties to even; 0 when the block is all zeros), as
// kv::quantize_q8 computes them.
__device__ __forceinline__ float kv_quantize_q8(float x, float* scale) {
    *scale = warp_max(fabsf(x)) / 127.0f;
    return *scale > 0.0f ? fminf(fmaxf(rintf(x / *scale), -127.0f), 127.0f) : 0.0f;
}

// Keys or values of a cache, read as f32; indices count values
// (row · kv_width + column).
template <int KV>
struct KvSide {
    const u8* data;
    const float* scales;

    __device__ __forceinline__ float at(i64 i) const {
        if (KV == KV_F32) return ((const float*)data)[i];
        if (KV == KV_BF16) return bf16_to_float(((const u16*)data)[i]);
        return (float)((const signed char*)data)[i] * scales[i / KV_Q8_BLOCK];
    }

    // Value i's bits as the cache holds them (f32 or bf16 bits, or a q8
    // code), loaded apart from their conversion (`value`), so a warp can
    // issue a batch of loads before it waits for any (warp_values in
    // attention.cu).
    __device__ __forceinline__ u32 bits(i64 i) const {
        if (KV == KV_F32) return ((const u32*)data)[i];
        if (KV == KV_BF16) return ((const u16*)data)[i];
        return (u32)(int)((const signed char*)data)[i];
    }

    // The value of `bits` (KvSide::bits) with its block's `scale`
    // (KvSide::load_scale), as `at` computes it.
    static __device__ __forceinline__ float value(u32 bits, float scale) {
        if (KV == KV_F32) return __uint_as_float(bits);
        if (KV == KV_BF16) return bf16_to_float((u16)bits);
        return (float)(int)bits * scale;
    }

    // Values i to i + 3 (i a multiple of 4).
    __device__ __forceinline__ float4 quad(i64 i) const {
        return quad_at(data + (i / 4) * (4 * KV_BYTES(KV)),
                       KV == KV_Q8 ? scales + i / KV_Q8_BLOCK : nullptr);
    }

    // The four values the cache's bytes at `at` hold (aligned to their
    // size), in f32; a q8 block's codes times the scale at `scale` (read
    // only for q8).
    static __device__ __forceinline__ float4 quad_at(const u8* at, const float* scale) {
        if (KV == KV_F32) return *(const float4*)at;
        if (KV == KV_BF16) {
            const uint2 w = *(const uint2*)at;
            return make_float4(bf16_to_float((u16)(w.x & 0xffffu)), bf16_to_float((u16)(w.x >> 16)),
                               bf16_to_float((u16)(w.y & 0xffffu)), bf16_to_float((u16)(w.y >> 16)));
        }
        const char4 c = *(const char4*)at;
        const float s = *scale;
        return make_float4((float)c.x * s, (float)c.y * s, (float)c.z * s, (float)c.w * s);
    }

    // The 16 bytes holding values i to i + KV_PER_LOAD(KV) - 1 (i a
    // multiple of KV_PER_LOAD(KV)), loaded; kv_unpack turns them into
    // values.
    __device__ __forceinline__ uint4 load(i64 i) const {
        return ((const uint4*)data)[i / KV_PER_LOAD(KV)];
    }

    // The scale kv_unpack needs for the values load(i) loaded (1 but for
    // q8).
    __device__ __forceinline__ float load_scale(i64 i) const {
        return KV == KV_Q8 ? scales[i / KV_Q8_BLOCK] : 1.0f;
    }
};

// The value of the signed byte `k` of `w`.
__device__ __forceinline__ float kv_code(u32 w, int k) {
    return (float)((int)(w << (24 - 8 * k)) >> 24);
}

// A 16-byte load of KvSide::load as its KV_PER_LOAD(KV) values, q8 codes
// times `scale` (KvSide::load_scale).
template <int KV>
__device__ __forceinline__ void kv_unpack(uint4 raw, float scale, float* x) {
    const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        if (KV == KV_F32) {
            x[w] = __uint_as_float(words[w]);
        } else if (KV == KV_BF16) {
            x[2 * w] = bf16_to_float((u16)(words[w] & 0xffffu));
            x[2 * w + 1] = bf16_to_float((u16)(words[w] >> 16));
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k) x[4 * w + k] = kv_code(words[w], k) * scale;
        }
    }
}

// The `head_dim` values `x` (f32) as a cache of type KV holds them, into
// `held` (f32; shared memory), and, when `data` is not null, encoded into
// the cache row there (`data` and `scales` at the head's first value and
// block). Every thread of the block calls it (a q8 block is a warp's);
// the caller synchronises before reading `held` with other threads.
template <int KV>
__device__ void kv_encode_row(const float* x, int head_dim, float* held, u8* data,
                              float* scales) {
    if (KV == KV_Q8) {
        const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
        for (int b = warp; b * KV_Q8_BLOCK < head_dim; b += blockDim.x / WARP_SIZE) {
            const int d = b * KV_Q8_BLOCK + lane;
            float scale;
            const float code = kv_quantize_q8(x[d], &scale);
            held[d] = code * scale;
            if (data) {
                ((signed char*)data)[d] = (signed char)code;
                if (lane == 0) scales[b] = scale;
            }
        }
    } else {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            const float v = x[d];
            if (KV == KV_F32) {
                held[d] = v;
                if (data) ((float*)data)[d] = v;
            } else {
                const u16 bits = kv_round_bf16(v);
                held[d] = bf16_to_float(bits);
                if (data) ((u16*)data)[d] = bits;
            }
        }
    }
}

// keys[start + t] = k[t], values[start + t] = v[t] for the n new rows of
// `width` (a multiple of KV_Q8_BLOCK for q8), encoded; `start` from
// `position` on the device when given. Grid-stride over the values (q8:
// over the blocks, a warp each).
template <int KV>
__device__ __forceinline__ void kv_store_rows(u8* keys, float* key_scales, u8* values,
                                              float* value_scales, const float* k,
                                              const float* v, i64 width, int n, i64 start) {
    const i64 total = (i64)n * width;
    const i64 thread = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 threads = (i64)gridDim.x * blockDim.x;
    if (KV == KV_Q8) {
        const int lane = threadIdx.x % WARP_SIZE;
        // Whole warps walk the blocks together (blockDim.x is a multiple
        // of 32), so every lane of a warp takes part in its reduction.
        for (i64 b = thread / WARP_SIZE; b * KV_Q8_BLOCK < total; b += threads / WARP_SIZE) {
            const i64 i = b * KV_Q8_BLOCK + lane;
            const i64 at = start * width + i;
            const i64 block = (start * width) / KV_Q8_BLOCK + b;
            float scale;
            float code = kv_quantize_q8(k[i], &scale);
            ((signed char*)keys)[at] = (signed char)code;
            if (lane == 0) key_scales[block] = scale;
            code = kv_quantize_q8(v[i], &scale);
            ((signed char*)values)[at] = (signed char)code;
            if (lane == 0) value_scales[block] = scale;
        }
    } else {
        for (i64 i = thread; i < total; i += threads) {
            const i64 at = start * width + i;
            if (KV == KV_F32) {
                ((float*)keys)[at] = k[i];
                ((float*)values)[at] = v[i];
            } else {
                ((u16*)keys)[at] = kv_round_bf16(k[i]);
                ((u16*)values)[at] = kv_round_bf16(v[i]);
            }
        }
    }
}

// One kernel per encoding: grid_stride(n · width) (Rust side).
#define KV_STORE_KERNEL(name, KV)                                                           \
    extern "C" __global__ void name(u8* keys, float* key_scales, u8* values,                \
                                    float* value_scales, const float* k, const float* v,    \
                                    i64 width, int n, i64 start, const u32* position) {     \
        await_inputs();                                                                     \
        if (position) start = *position;                                                    \
        kv_store_rows<KV>(keys, key_scales, values, value_scales, k, v, width, n, start);   \
    }

KV_STORE_KERNEL(kv_store_f32, KV_F32)
KV_STORE_KERNEL(kv_store_bf16, KV_BF16)
KV_STORE_KERNEL(kv_store_q8, KV_Q8)
