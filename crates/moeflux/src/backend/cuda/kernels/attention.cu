// Causal grouped-query attention over a KV cache `[capacity, kv_heads ·
// head_dim]` that already holds the new keys and values, stored in any of
// kv_cache.cu's encodings: every kernel here is compiled once per encoding
// (KV) and reads the cache through KvSide, computing in f32 (but the
// grouped decode kernels on the tensor cores, which read bf16 and f32
// caches themselves and multiply bf16 pieces of f32 values).
//
// One block per (query token, head). Each of the block's W warps takes
// every W-th visible position and keeps a running (online) softmax: its
// maximum, the sum of exp(score - maximum) and the weighted sum of values;
// the warps' partial results are merged at the end. No buffer grows with
// the context. One token (decode) takes attend_decode below instead, and
// sixteen or more the tiled flash_attend.

// Launch geometry comes from the host: compile.rs passes the constants of
// geometry.rs as -D options, so a launch and its kernel cannot disagree.
#if !defined(ATTN_WARPS) || !defined(ATTN_MAX_PER_LANE) || !defined(DECODE_ATTN_WARPS) || \
    !defined(FA_WARPS) || !defined(FA_ROWS_PER_WARP) || !defined(FA_KEYS) || \
    !defined(FA_WORD_PAD) || !defined(GD_WARPS) || !defined(DECODE_ATTN_MAX_SPLITS)
#error "attention.cu: launch geometry missing (compile.rs passes geometry.rs as -D options)"
#endif

// ATTN_WARPS warps per block; head dimensions up to ATTN_MAX_PER_LANE · 32
// (checked on the host).

// `start` is the cache row of the first query, read from `position` on the
// device instead when that is given (a recorded step). Every kernel here
// also takes `window` (a query sees that many rows, its own included; 0:
// every row before it) and `sinks` (a logit per query head that joins the
// softmax's denominator with no value; null: none).
template <int KV>
__device__ __forceinline__ void attend(const float* q, KvSide<KV> keys, KvSide<KV> values,
                                       float* out, int n, int heads, int kv_heads, int head_dim,
                                       i64 start, float scale, int window, const float* sinks) {
    const int W = ATTN_WARPS;
    __shared__ float warp_max_score[W];
    __shared__ float warp_total[W];
    __shared__ float warp_acc[W][ATTN_MAX_PER_LANE * WARP_SIZE];
    int warp = threadIdx.x / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    int group = heads / kv_heads;
    i64 kv_width = (i64)kv_heads * head_dim;
    i64 q_width = (i64)heads * head_dim;

    for (i64 item = blockIdx.x; item < (i64)n * heads; item += gridDim.x) {
        i64 t = item / heads;
        int h = (int)(item % heads);
        const float* query = q + t * q_width + (i64)h * head_dim;
        const i64 head_at = (i64)(h / group) * head_dim;
        i64 visible = start + t + 1;
        i64 oldest = window > 0 ? max((i64)0, visible - window) : 0;

        float qv[ATTN_MAX_PER_LANE];
        float acc[ATTN_MAX_PER_LANE];
#pragma unroll
        for (int k = 0; k < ATTN_MAX_PER_LANE; ++k) {
            int d = lane + k * WARP_SIZE;
            qv[k] = d < head_dim ? query[d] : 0.0f;
            acc[k] = 0.0f;
        }
        float max_score = NEG_INF;
        float total = 0.0f;
        for (i64 j = oldest + warp; j < visible; j += W) {
            const i64 at = head_at + j * kv_width;
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < ATTN_MAX_PER_LANE; ++k) {
                int d = lane + k * WARP_SIZE;
                if (d < head_dim) s = fmaf(qv[k], keys.at(at + d), s);
            }
            s = warp_sum(s) * scale;
            float new_max = fmaxf(max_score, s);
            float rescale = expf(max_score - new_max);  // 0 for the first position
            float p = expf(s - new_max);
            total = total * rescale + p;
#pragma unroll
            for (int k = 0; k < ATTN_MAX_PER_LANE; ++k) {
                int d = lane + k * WARP_SIZE;
                if (d < head_dim) acc[k] = acc[k] * rescale + p * values.at(at + d);
            }
            max_score = new_max;
        }
        if (lane == 0) {
            warp_max_score[warp] = max_score;
            warp_total[warp] = total;
        }
#pragma unroll
        for (int k = 0; k < ATTN_MAX_PER_LANE; ++k) {
            int d = lane + k * WARP_SIZE;
            if (d < head_dim) warp_acc[warp][d] = acc[k];
        }
        __syncthreads();
        // A warp that saw no position has maximum -inf and weighs 0; warp 0
        // saw the oldest visible row, so the overall maximum is finite.
        float overall = warp_max_score[0];
        for (int w = 1; w < W; ++w) overall = fmaxf(overall, warp_max_score[w]);
        float weights[W];
        float denominator = sinks ? expf(sinks[h] - overall) : 0.0f;
        for (int w = 0; w < W; ++w) {
            weights[w] = expf(warp_max_score[w] - overall);
            denominator += warp_total[w] * weights[w];
        }
        float* o = out + t * q_width + (i64)h * head_dim;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float sum = 0.0f;
            for (int w = 0; w < W; ++w) sum += warp_acc[w][d] * weights[w];
            o[d] = sum / denominator;
        }
        __syncthreads();  // the next item reuses the shared arrays
    }
}

// One kernel per encoding; `keys` and `values` are a cache side's data,
// `key_scales` and `value_scales` its q8 scales (null for the other
// encodings), as in every kernel below.
#define ATTENTION_KERNEL(name, KV)                                                            \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP_SIZE)                      \
        name(const float* q, const u8* keys, const float* key_scales, const u8* values,       \
             const float* value_scales, float* out, int n, int heads, int kv_heads,           \
             int head_dim, i64 start, const u32* position, float scale, int window,           \
             const float* sinks) {                                                            \
        await_inputs();                                                                       \
        if (position) start = *position;                                                      \
        attend<KV>(q, KvSide<KV>{keys, key_scales}, KvSide<KV>{values, value_scales}, out, n, \
                   heads, kv_heads, head_dim, start, scale, window, sinks);                   \
    }

ATTENTION_KERNEL(attention_f32, KV_F32)
ATTENTION_KERNEL(attention_bf16, KV_BF16)
ATTENTION_KERNEL(attention_q8, KV_Q8)

// ---- One token: positions in parallel, one round of loads per chunk ----
//
// A decode step has a block per head only, and walking positions one per
// warp step puts a memory round trip per position on the critical path.
// Here the block takes the visible positions in chunks of one per thread:
// each thread scores its position's key whole (the loads of all positions
// in flight at once), the block's running maximum and sum are updated
// with two block reductions, and then the warps take the chunk's positions
// in turn, lanes over dimensions, several values in flight per lane. The
// maximum and the sum are the block's (every thread holds them), so the
// warps' weighted sums only need adding at the end. The cache does not
// yet hold the token's key and value: a bf16 or q8 block takes them from
// new_k and new_v into shared memory as the cache will hold them
// (kv_encode_row); an f32 block, whose cache holds them unchanged, reads
// them from new_k and new_v on the load path of every other position (a
// second path through shared memory cost 18% of the kernel). The first
// block of each KV head's group stores them into the cache (no other
// block reads that position of the cache), saving a launch per layer.
//
// Long contexts (flash-decoding): a head alone is too little work for the
// device, so the positions are split over up to `splits` blocks per head
// (grid z), whole chunks each. The number in use follows the context on
// the device, so a recorded step launches the same grid at every length;
// blocks past it return at once. With one in use the block writes the
// output; otherwise each writes its maximum, sum and weighted values to
// the cache's partials, and the block that finishes last (a ticket per
// head) merges them and resets the ticket for the next step.

// DECODE_ATTN_WARPS (geometry.rs) warps per block.
#define DECODE_ATTN_CHUNK (DECODE_ATTN_WARPS * WARP_SIZE)
// Positions a warp's lanes load values of before using them: 8, fewer for
// wide heads to stay in registers (f32: 4 over 256 wide; bf16 and q8, whose
// bits wait beside the values: 32 loads a lane).
#define VALUES_IN_FLIGHT(PER_LANE, KV) \
    ((KV) == KV_F32 ? ((PER_LANE) <= 8 ? 8 : 4) : (PER_LANE) <= 4 ? 8 : 32 / (PER_LANE))
// 16-byte pieces of a key a thread loads before using them.
#define DECODE_KEY_QUADS 16

// `dot[g]` = query g (shared memory at `query + g · query_stride`, 16-byte
// aligned) · the key of `head_dim` values at index `at` of `keys`, for each
// of GROUP queries, the key read once: 16-byte loads, DECODE_KEY_QUADS in
// flight, where whole loads cover the head (head_dim a multiple of
// KV_PER_LOAD(KV)), else one value at a time. Either way each sum adds its
// products in the order of the dimensions, so every path gives the same.
template <int KV, int GROUP>
__device__ __forceinline__ void dot_keys(const KvSide<KV>& keys, i64 at, const float* query,
                                         int query_stride, int head_dim, float* dot) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) dot[g] = 0.0f;
    if (head_dim % KV_PER_LOAD(KV) != 0) {
        for (int d = 0; d < head_dim; ++d) {
            const float x = keys.at(at + d);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) dot[g] = fmaf(query[g * query_stride + d], x, dot[g]);
        }
        return;
    }
    const int loads = head_dim / KV_PER_LOAD(KV);
    for (int b = 0; b < loads; b += DECODE_KEY_QUADS) {
        uint4 raw[DECODE_KEY_QUADS];
        float scales[DECODE_KEY_QUADS];
#pragma unroll
        for (int u = 0; u < DECODE_KEY_QUADS; ++u) {
            const i64 i = at + (i64)(b + u) * KV_PER_LOAD(KV);
            raw[u] = b + u < loads ? keys.load(i) : make_uint4(0u, 0u, 0u, 0u);
            scales[u] = b + u < loads ? keys.load_scale(i) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < DECODE_KEY_QUADS; ++u) {
            if (b + u < loads) {
                float x[KV_PER_LOAD(KV)];
                kv_unpack<KV>(raw[u], scales[u], x);
#pragma unroll
                for (int c = 0; c < KV_PER_LOAD(KV) / 4; ++c) {
                    const int d = (b + u) * KV_PER_LOAD(KV) + 4 * c;
#pragma unroll
                    for (int g = 0; g < GROUP; ++g) {
                        const float4 qq = *(const float4*)(query + g * query_stride + d);
                        dot[g] = fmaf(qq.x, x[4 * c], dot[g]);
                        dot[g] = fmaf(qq.y, x[4 * c + 1], dot[g]);
                        dot[g] = fmaf(qq.z, x[4 * c + 2], dot[g]);
                        dot[g] = fmaf(qq.w, x[4 * c + 3], dot[g]);
                    }
                }
            }
        }
    }
}

// A warp's values of VALUES positions of a chunk (slots i0, i0 + stride,
// ...; the chunk's first row c0), lane `lane` holding dimensions lane,
// lane + 32, ...: `v[u][k]`, 0 past the chunk or the head, the newest row
// (visible - 1, not in the cache yet) from `fresh_v`. All loads are in
// flight at once: an f32 value is its load, but a bf16 or q8 one converted
// where it is chosen over the newest row's would make the warp wait for
// each load before issuing the next, so their bits are loaded first
// (KvSide::bits) and converted after; a q8 row's scales are loaded a block
// per lane and passed by shuffles.
template <int KV, int VALUES, int PER_LANE>
__device__ __forceinline__ void warp_values(const KvSide<KV>& cached_v, const float* fresh_v,
                                            i64 c0, int i0, int stride, int chunk, i64 visible,
                                            i64 head_at, i64 kv_width, int head_dim, int lane,
                                            float (*v)[PER_LANE]) {
    if (KV == KV_F32) {
#pragma unroll
        for (int u = 0; u < VALUES; ++u) {
            const int i = i0 + u * stride;
            const i64 j = c0 + i;
            const bool newest = j == visible - 1;
            const i64 at = head_at + j * kv_width;
#pragma unroll
            for (int k = 0; k < PER_LANE; ++k) {
                const int d = lane + k * WARP_SIZE;
                v[u][k] = i < chunk && d < head_dim
                              ? (newest ? fresh_v[d] : cached_v.at(at + d))
                              : 0.0f;
            }
        }
    } else {
        float fresh[PER_LANE];
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) {
            const int d = lane + k * WARP_SIZE;
            fresh[k] = d < head_dim ? fresh_v[d] : 0.0f;
        }
        u32 bits[VALUES][PER_LANE];
        float scale[VALUES];
#pragma unroll
        for (int u = 0; u < VALUES; ++u) {
            const int i = i0 + u * stride;
            const i64 j = c0 + i;
            const i64 at = head_at + j * kv_width;
            const bool cached = i < chunk && j != visible - 1;
#pragma unroll
            for (int k = 0; k < PER_LANE; ++k) {
                const int d = lane + k * WARP_SIZE;
                bits[u][k] = cached && d < head_dim ? cached_v.bits(at + d) : 0u;
            }
            const int block = lane * KV_Q8_BLOCK;
            scale[u] = KV == KV_Q8 && cached && block < head_dim ? cached_v.load_scale(at + block)
                                                                  : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < VALUES; ++u) {
            const int i = i0 + u * stride;
            const bool newest = c0 + i == visible - 1;
#pragma unroll
            for (int k = 0; k < PER_LANE; ++k) {
                const int d = lane + k * WARP_SIZE;
                // Dimension d's block is k (head_dim a multiple of a block for q8).
                const float s = KV == KV_Q8 ? __shfl_sync(0xffffffffu, scale[u], k) : 1.0f;
                const float x = KvSide<KV>::value(bits[u][k], s);
                v[u][k] = i < chunk && d < head_dim ? (newest ? fresh[k] : x) : 0.0f;
            }
        }
    }
}

// The rows [first, end) of split `split` when the rows [oldest, visible)
// are split over at most `splits` blocks in whole chunks; returns the
// number of splits in use (a split at or past it has no rows).
__device__ __forceinline__ int decode_split_range(i64 oldest, i64 visible, int splits, int split,
                                                  int chunk, i64* first, i64* end) {
    const i64 chunks = (visible - oldest + chunk - 1) / chunk;
    const i64 split_chunks = (chunks + splits - 1) / splits;
    *first = oldest + split * split_chunks * chunk;
    *end = min(visible, *first + split_chunks * chunk);
    return (int)((chunks + split_chunks - 1) / split_chunks);
}

// The oldest row a query at row `visible - 1` sees with a window of
// `window` rows (0: every row).
__device__ __forceinline__ i64 oldest_visible(i64 visible, int window) {
    return window > 0 ? max((i64)0, visible - window) : 0;
}

// A decode block's split (blockIdx.z) of the rows a query at row `start`
// sees, over at most `splits` blocks in whole chunks of `chunk`: its rows
// [first, end); returns the number of splits in use. A block whose split
// is in use also takes the KV head's new key and value (`new_k`, `new_v`
// at the head) as the cache will hold them, into `fresh_k` and `fresh_v`
// (shared memory), and stores them at cache row `start` too when `store`
// and its split is the first. The caller synchronises after.
template <int KV>
__device__ __forceinline__ int begin_decode_split(const float* new_k, const float* new_v,
                                                  u8* keys, float* key_scales, u8* values,
                                                  float* value_scales, i64 start, int window,
                                                  int splits, int chunk, i64 kv_width,
                                                  i64 head_at, int head_dim, bool store,
                                                  float* fresh_k, float* fresh_v, i64* first,
                                                  i64* end) {
    const i64 visible = start + 1;
    const int split = blockIdx.z;
    const int used = decode_split_range(oldest_visible(visible, window), visible, splits, split,
                                        chunk, first, end);
    if (split >= used) return used;
    const bool stores = store && split == 0;
    const i64 at = start * kv_width + head_at;
    const i64 block = at / KV_Q8_BLOCK;
    const bool q8 = KV == KV_Q8;
    kv_encode_row<KV>(new_k + head_at, head_dim, fresh_k,
                      stores ? keys + at * KV_BYTES(KV) : nullptr,
                      stores && q8 ? key_scales + block : nullptr);
    kv_encode_row<KV>(new_v + head_at, head_dim, fresh_v,
                      stores ? values + at * KV_BYTES(KV) : nullptr,
                      stores && q8 ? value_scales + block : nullptr);
    return used;
}

// Whether this block is the last of the `used` splits of a head (or of a
// KV head's group) to finish, after its partials are written: then it
// merges them, and the ticket is reset for the next step.
__device__ bool last_of_splits(u32* ticket, int used) {
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        is_last = atomicAdd(ticket, 1u) == (u32)(used - 1);
        if (is_last) *ticket = 0;
    }
    __syncthreads();
    if (is_last) __threadfence();
    return is_last;
}

// The outputs of `rows` rows (query heads, or MLA's rows) from the
// partials of their `used` splits: row r's at partials + r · row_stride,
// `[used][width + 2]` (weighted values, maximum, sum), each joined in the
// denominator by its sink logit (sinks[r]; null: none), into
// out + r · width. By the whole block: a warp per row takes its splits'
// maxima and sums, a lane per split, and leaves each split's share
// exp(maximum - overall) in shared memory; then the threads take the
// (row, column) pairs, MERGE_LOADS splits' values loaded before any is
// added, so a pair costs a round of loads per MERGE_LOADS splits instead
// of one per split. Read through L2 (`__ldcg`): L1 is not coherent across
// blocks. ROWS bounds `rows`.
#define MERGE_LOADS 16
template <int ROWS>
__device__ void merge_split_partials(const float* partials, i64 row_stride, int rows, int used,
                                     int width, const float* sinks, float* out) {
    static_assert(DECODE_ATTN_MAX_SPLITS <= WARP_SIZE, "the merge takes a lane per split");
    __shared__ float share[ROWS][DECODE_ATTN_MAX_SPLITS];
    __shared__ float denominator[ROWS];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    for (int r = warp; r < rows; r += blockDim.x / WARP_SIZE) {
        const float* part = partials + r * row_stride + (i64)lane * (width + 2);
        // Every split saw at least one position, so every maximum is finite.
        const float maximum = lane < used ? __ldcg(part + width) : NEG_INF;
        const float total = lane < used ? __ldcg(part + width + 1) : 0.0f;
        const float overall = warp_max(maximum);
        const float e = lane < used ? expf(maximum - overall) : 0.0f;
        const float sum = warp_sum(total * e);
        if (lane < DECODE_ATTN_MAX_SPLITS) share[r][lane] = e;
        if (lane == 0) denominator[r] = sum + (sinks ? expf(sinks[r] - overall) : 0.0f);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * width; i += blockDim.x) {
        const int r = i / width, d = i % width;
        const float* part = partials + r * row_stride + d;
        float sum = 0.0f;
        for (int s0 = 0; s0 < used; s0 += MERGE_LOADS) {
            float v[MERGE_LOADS];
#pragma unroll
            for (int k = 0; k < MERGE_LOADS; ++k)
                v[k] = s0 + k < used ? __ldcg(part + (i64)(s0 + k) * (width + 2)) : 0.0f;
#pragma unroll
            for (int k = 0; k < MERGE_LOADS; ++k)
                if (s0 + k < used) sum = fmaf(v[k], share[r][s0 + k], sum);
        }
        out[(i64)r * width + d] = sum / denominator[r];
    }
}

// One split's result of a head (its warps' weighted sums `warp_acc`, rows
// `stride` apart, and the block's maximum and sum) into `partials`
// ([splits][head_dim + 2]: the weighted values, then maximum and sum);
// the last of the `used` blocks to arrive merges them into `out`, the
// head's sink logit at `sink` (null: none) joining the denominator.
__device__ void merge_decode_splits(const float* warp_acc, int stride, int head_dim,
                                    float running_max, float total, int split, int used,
                                    float* partials, u32* ticket, const float* sink,
                                    float* out) {
    float* mine = partials + (i64)split * (head_dim + 2);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < DECODE_ATTN_WARPS; ++w) sum += warp_acc[w * stride + d];
        mine[d] = sum;
    }
    if (threadIdx.x == 0) {
        mine[head_dim] = running_max;
        mine[head_dim + 1] = total;
    }
    if (last_of_splits(ticket, used))
        merge_split_partials<1>(partials, 0, 1, used, head_dim, sink, out);
}

// Head dimensions up to PER_LANE · 32.
template <int PER_LANE, int KV>
__device__ __forceinline__ void attend_decode(const float* q, u8* keys, float* key_scales,
                                              u8* values, float* value_scales, float* out,
                                              int heads, int kv_heads, int head_dim, i64 start,
                                              float scale, const float* new_k,
                                              const float* new_v, int window,
                                              const float* sinks, int splits, float* partials,
                                              u32* tickets) {
    __shared__ float4 query4[PER_LANE * WARP_SIZE / 4];
    __shared__ float4 fresh4[2][PER_LANE * WARP_SIZE / 4];
    __shared__ float weight[DECODE_ATTN_CHUNK];
    __shared__ float scratch[32];
    __shared__ float warp_acc[DECODE_ATTN_WARPS][PER_LANE * WARP_SIZE];
    float* query_s = (float*)query4;
    float* fresh_k = (float*)fresh4[0];
    float* fresh_v = (float*)fresh4[1];
    const int warp = threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    const int h = blockIdx.x;
    if (h >= heads) return;
    const int group = heads / kv_heads;
    const i64 kv_width = (i64)kv_heads * head_dim;
    const i64 head_at = (i64)(h / group) * head_dim;
    const KvSide<KV> cached_k{keys, key_scales}, cached_v{values, value_scales};
    const KvSide<KV_F32> fresh_key{(const u8*)fresh_k, nullptr};
    const i64 visible = start + 1;
    const int split = blockIdx.z;
    // An f32 cache holds the new key and value as they are: they are read
    // from new_k and new_v where the newest position is needed, one load
    // path for every position, and stored into the cache at the end.
    const bool direct = KV == KV_F32;
    i64 first, end;
    const int used =
        direct ? decode_split_range(oldest_visible(visible, window), visible, splits, split,
                                    DECODE_ATTN_CHUNK, &first, &end)
               : begin_decode_split<KV>(new_k, new_v, keys, key_scales, values, value_scales,
                                        start, window, splits, DECODE_ATTN_CHUNK, kv_width,
                                        head_at, head_dim, h % group == 0, fresh_k, fresh_v,
                                        &first, &end);
    if (split >= used) return;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) query_s[d] = q[(i64)h * head_dim + d];
    __syncthreads();

    float running_max = NEG_INF;
    float total = 0.0f;
    float acc[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) acc[k] = 0.0f;
    for (i64 c0 = first; c0 < end; c0 += DECODE_ATTN_CHUNK) {
        const int chunk = (int)min((i64)DECODE_ATTN_CHUNK, end - c0);
        // This thread's position: its score, the key read in batches of
        // DECODE_KEY_QUADS loads in flight.
        float s = NEG_INF;
        if (threadIdx.x < chunk) {
            i64 j = c0 + threadIdx.x;
            float dot;
            if (direct) {
                const bool newest = j == visible - 1;
                const KvSide<KV_F32> key{newest ? (const u8*)new_k : keys, nullptr};
                dot_keys<KV_F32, 1>(key, head_at + (newest ? 0 : j * kv_width), query_s, 0,
                                    head_dim, &dot);
            } else if (j == visible - 1) {
                dot_keys<KV_F32, 1>(fresh_key, 0, query_s, 0, head_dim, &dot);
            } else {
                dot_keys<KV, 1>(cached_k, head_at + j * kv_width, query_s, 0, head_dim, &dot);
            }
            s = dot * scale;
        }
        float new_max = fmaxf(running_max, block_max(s, scratch));
        float rescale = expf(running_max - new_max);  // 0 for the first chunk
        float p = threadIdx.x < chunk ? expf(s - new_max) : 0.0f;
        weight[threadIdx.x] = p;
        total = total * rescale + block_sum(p, scratch);  // also publishes weight[]
        running_max = new_max;
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) acc[k] *= rescale;
        // Values: warp w takes the chunk's positions w, w + warps, ...
        for (int i0 = warp; i0 < chunk; i0 += DECODE_ATTN_WARPS * VALUES_IN_FLIGHT(PER_LANE, KV)) {
            float v[VALUES_IN_FLIGHT(PER_LANE, KV)][PER_LANE];
            if (direct) {
#pragma unroll
                for (int u = 0; u < VALUES_IN_FLIGHT(PER_LANE, KV); ++u) {
                    const int i = i0 + u * DECODE_ATTN_WARPS;
                    const i64 j = c0 + i;
                    const float* value = j == visible - 1
                                             ? new_v + head_at
                                             : (const float*)values + head_at + j * kv_width;
#pragma unroll
                    for (int k = 0; k < PER_LANE; ++k) {
                        const int d = lane + k * WARP_SIZE;
                        v[u][k] = i < chunk && d < head_dim ? value[d] : 0.0f;
                    }
                }
            } else {
                warp_values<KV, VALUES_IN_FLIGHT(PER_LANE, KV), PER_LANE>(
                    cached_v, fresh_v, c0, i0, DECODE_ATTN_WARPS, chunk, visible, head_at,
                    kv_width, head_dim, lane, v);
            }
#pragma unroll
            for (int u = 0; u < VALUES_IN_FLIGHT(PER_LANE, KV); ++u) {
                int i = i0 + u * DECODE_ATTN_WARPS;
                float w = i < chunk ? weight[i] : 0.0f;
#pragma unroll
                for (int k = 0; k < PER_LANE; ++k) acc[k] = fmaf(w, v[u][k], acc[k]);
            }
        }
        __syncthreads();  // weight[] is rewritten by the next chunk
    }
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
        int d = lane + k * WARP_SIZE;
        if (d < head_dim) warp_acc[warp][d] = acc[k];
    }
    __syncthreads();
    if (direct && h % group == 0 && split == 0) {
        const i64 at = start * kv_width + head_at;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            ((float*)keys)[at + d] = new_k[head_at + d];
            ((float*)values)[at + d] = new_v[head_at + d];
        }
    }
    float* o = out + (i64)h * head_dim;
    const float sink = sinks ? sinks[h] : NEG_INF;
    if (used == 1) {
        // The sink's share, relative to the running maximum like `total`.
        const float denominator = total + expf(sink - running_max);
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float sum = 0.0f;
            for (int w = 0; w < DECODE_ATTN_WARPS; ++w) sum += warp_acc[w][d];
            o[d] = sum / denominator;
        }
    } else {
        merge_decode_splits(warp_acc[0], PER_LANE * WARP_SIZE, head_dim, running_max, total,
                            split, used, partials + (i64)h * splits * (head_dim + 2),
                            tickets + h, sinks ? sinks + h : nullptr, o);
    }
}

// Asks L2 for the keys and values of the first `max_rows` positions a decode
// block of KV head `kv_head` and split blockIdx.z reads (its split of the
// rows in whole chunks of `chunk`), before waiting for the step's inputs:
// they were stored by earlier steps, which no kernel of this one changes
// (the recorded position is written before the step starts), so the reads
// overlap the kernels before instead of following them.
template <int KV>
__device__ __forceinline__ void prefetch_split_history(const u8* keys, const float* key_scales,
                                                       const u8* values,
                                                       const float* value_scales, int kv_head,
                                                       int kv_heads, int head_dim, i64 start,
                                                       const u32* position, int window,
                                                       int splits, int chunk, int max_rows) {
    if (position) start = *position;
    i64 first, end;
    if ((int)blockIdx.z >= decode_split_range(oldest_visible(start + 1, window), start + 1, splits,
                                              blockIdx.z, chunk, &first, &end))
        return;
    // The newest position is not in the cache yet.
    const i64 rows = min(min(end, start) - first, (i64)max_rows);
    const i64 kv_width = (i64)kv_heads * head_dim;
    const int lines = (KV_BYTES(KV) * head_dim + 127) / 128;
    const i64 head = (i64)kv_head * head_dim;
    for (i64 i = threadIdx.x; i < rows * lines; i += blockDim.x) {
        i64 at = (first + i / lines) * kv_width + head;
        int line = (int)(i % lines);
        prefetch_l2(keys + at * KV_BYTES(KV) + 128 * line);
        prefetch_l2(values + at * KV_BYTES(KV) + 128 * line);
        if (KV == KV_Q8 && line == 0) {
            prefetch_l2(key_scales + at / KV_Q8_BLOCK);
            prefetch_l2(value_scales + at / KV_Q8_BLOCK);
        }
    }
}

// The per-head kernels' history ahead of the wait: the first chunk of the
// split, asked by the first block of each KV head's group.
template <int KV>
__device__ __forceinline__ void prefetch_kv_history(const u8* keys, const float* key_scales,
                                                    const u8* values, const float* value_scales,
                                                    int heads, int kv_heads, int head_dim,
                                                    i64 start, const u32* position,
                                                    int window, int splits) {
    const int group = heads / kv_heads;
    if (blockIdx.x % group != 0) return;
    prefetch_split_history<KV>(keys, key_scales, values, value_scales, blockIdx.x / group,
                               kv_heads, head_dim, start, position, window, splits,
                               DECODE_ATTN_CHUNK, DECODE_ATTN_CHUNK);
}

// One kernel per bound on the head dimension (128, 256, 512), so a lane
// keeps only the dimensions that exist, and per encoding. Same parameters
// as `attention` (n is 1), then the splits: grid (heads, 1, splits);
// `partials` holds [heads][splits][head_dim + 2] values and `tickets` a
// zeroed word per head.
#define ATTENTION_DECODE_KERNEL(name, PER_LANE, KV)                                          \
    extern "C" __global__ void __launch_bounds__(DECODE_ATTN_WARPS * WARP_SIZE)              \
        name(const float* q, u8* keys, float* key_scales, u8* values, float* value_scales,   \
             float* out, int n, int heads, int kv_heads, int head_dim, i64 start,            \
             const u32* position, float scale, const float* new_k, const float* new_v,       \
             int window, const float* sinks, int splits, float* partials, u32* tickets) {    \
        prefetch_kv_history<KV>(keys, key_scales, values, value_scales, heads, kv_heads,     \
                                head_dim, start, position, window, splits);                  \
        await_inputs();                                                                      \
        if (position) start = *position;                                                     \
        attend_decode<PER_LANE, KV>(q, keys, key_scales, values, value_scales, out, heads,   \
                                    kv_heads, head_dim, start, scale, new_k, new_v, window,  \
                                    sinks, splits, partials, tickets);                       \
    }

ATTENTION_DECODE_KERNEL(attention_decode_128_f32, 4, KV_F32)
ATTENTION_DECODE_KERNEL(attention_decode_256_f32, 8, KV_F32)
ATTENTION_DECODE_KERNEL(attention_decode_512_f32, 16, KV_F32)
ATTENTION_DECODE_KERNEL(attention_decode_128_bf16, 4, KV_BF16)
ATTENTION_DECODE_KERNEL(attention_decode_256_bf16, 8, KV_BF16)
ATTENTION_DECODE_KERNEL(attention_decode_512_bf16, 16, KV_BF16)
ATTENTION_DECODE_KERNEL(attention_decode_128_q8, 4, KV_Q8)
ATTENTION_DECODE_KERNEL(attention_decode_256_q8, 8, KV_Q8)
ATTENTION_DECODE_KERNEL(attention_decode_512_q8, 16, KV_Q8)

// A decode step of several sequences at once: grid (heads, sequences,
// splits); sequence s's query, key and value are row s of q, new_k and
// new_v, its cache at keys[s] / values[s] (q8: its scales at key_scales[s]
// / value_scales[s]; the arrays are null for the other encodings) with
// starts[s] positions before this one, its partials and tickets at
// partials[s] / tickets[s]. Each block does what attention_decode's does
// for its head, sequence and split (without reading the history ahead: the
// caches' addresses are inputs). `...` is the device function that attends
// with its template arguments (whose commas would split a macro argument):
// attend_decode here, attend_decode_grouped for the grouped kernels below.
#define ATTENTION_DECODE_BATCH(name, WARPS, KV, ...)                                         \
    extern "C" __global__ void __launch_bounds__(WARPS * WARP_SIZE)                          \
        name(const float* q, const u64* keys, const u64* key_scales, const u64* values,      \
             const u64* value_scales, float* out, int heads, int kv_heads, int head_dim,     \
             const i64* starts, float scale, const float* new_k, const float* new_v,         \
             int splits, const u64* partials, const u64* tickets) {                          \
        await_inputs();                                                                      \
        const int s = blockIdx.y;                                                            \
        const i64 q_width = (i64)heads * head_dim, kv_width = (i64)kv_heads * head_dim;      \
        __VA_ARGS__(q + s * q_width, (u8*)keys[s],                                           \
                    KV == KV_Q8 ? (float*)key_scales[s] : nullptr, (u8*)values[s],           \
                    KV == KV_Q8 ? (float*)value_scales[s] : nullptr, out + s * q_width,      \
                    heads, kv_heads, head_dim, starts[s], scale, new_k + s * kv_width,       \
                    new_v + s * kv_width, 0, nullptr, splits, (float*)partials[s],           \
                    (u32*)tickets[s]);                                                       \
    }

#define ATTENTION_DECODE_BATCH_KERNEL(name, PER_LANE, KV) \
    ATTENTION_DECODE_BATCH(name, DECODE_ATTN_WARPS, KV, attend_decode<PER_LANE, KV>)

ATTENTION_DECODE_BATCH_KERNEL(attention_decode_batch_128_f32, 4, KV_F32)
ATTENTION_DECODE_BATCH_KERNEL(attention_decode_batch_256_f32, 8, KV_F32)
ATTENTION_DECODE_BATCH_KERNEL(attention_decode_batch_512_f32, 16, KV_F32)
ATTENTION_DECODE_BATCH_KERNEL(attention_decode_batch_128_bf16, 4, KV_BF16)
ATTENTION_DECODE_BATCH_KERNEL(attention_decode_batch_256_bf16, 8, KV_BF16)
ATTENTION_DECODE_BATCH_KERNEL(attention_decode_batch_512_bf16, 16, KV_BF16)
ATTENTION_DECODE_BATCH_KERNEL(attention_decode_batch_128_q8, 4, KV_Q8)
ATTENTION_DECODE_BATCH_KERNEL(attention_decode_batch_256_q8, 8, KV_Q8)
ATTENTION_DECODE_BATCH_KERNEL(attention_decode_batch_512_q8, 16, KV_Q8)

// ---- One token, a block per KV head: each key and value read once ----
//
// With grouped-query attention the `group` query heads of a KV head read
// the same keys and values; a block per query head reads them `group`
// times (from L2, whose bandwidth then bounds a long context). Here a
// block takes a KV head's whole group, and a split of its positions as
// above (grid (kv_heads, sequences, splits)), in chunks of one position
// per thread:
//   1. each thread scores its position's key against every query of the
//      group (the queries in shared memory, the key read once);
//   2. a warp per query head takes the chunk's maximum and sum for it and
//      turns its scores into weights;
//   3. the warps take the chunk's positions in turn, lanes over dimensions,
//      each value read once and added to every head's sum.
// The heads' results are merged across splits as in attend_decode.
//
// A split takes whole multiples of SPLIT_ROWS positions: one sequence's
// step splits in tiles of 32 (8193 positions are 33 chunks of 256, which
// 32 splits in whole chunks take two at a time in 17 blocks a KV head,
// leaving half of an H200's multiprocessors idle: 8193 positions decode
// 8% faster in tiles), a step of several sequences in whole chunks (in
// tiles more short contexts split, and their merges cost 1.4% at 16
// sequences and 4.4% at 64).

// GD_WARPS (geometry.rs) warps per block, one position per thread per chunk.
#define GD_CHUNK (GD_WARPS * WARP_SIZE)

// Head dimensions up to PER_LANE · 32, groups up to GROUP query heads.
template <int PER_LANE, int GROUP, int KV, int SPLIT_ROWS>
__device__ __forceinline__ void attend_decode_grouped(const float* q, u8* keys, float* key_scales,
                                                      u8* values, float* value_scales,
                                                      float* out, int heads, int kv_heads,
                                                      int head_dim, i64 start, float scale,
                                                      const float* new_k, const float* new_v,
                                                      int window, const float* sinks,
                                                      int splits, float* partials,
                                                      u32* tickets) {
    __shared__ float4 query4[GROUP][PER_LANE * WARP_SIZE / 4];
    __shared__ float4 fresh4[2][PER_LANE * WARP_SIZE / 4];
    __shared__ float weight[GROUP][GD_CHUNK];
    __shared__ float head_max[GROUP], head_total[GROUP], head_rescale[GROUP];
    __shared__ float reduce[GD_WARPS][PER_LANE * WARP_SIZE];
    const int warp = threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    const int kv_head = blockIdx.x;
    const int group = heads / kv_heads;
    const i64 kv_width = (i64)kv_heads * head_dim;
    const i64 head_at = (i64)kv_head * head_dim;
    const KvSide<KV> cached_k{keys, key_scales}, cached_v{values, value_scales};
    float* fresh_k = (float*)fresh4[0];
    float* fresh_v = (float*)fresh4[1];
    const KvSide<KV_F32> fresh_key{(const u8*)fresh_k, nullptr};
    const i64 visible = start + 1;
    const int split = blockIdx.z;
    i64 first, end;
    const int used = begin_decode_split<KV>(new_k, new_v, keys, key_scales, values, value_scales,
                                            start, window, splits, SPLIT_ROWS, kv_width, head_at,
                                            head_dim, true, fresh_k, fresh_v, &first, &end);
    if (split >= used) return;
    const int quads = head_dim / 4;  // head_dim % 4 == 0 (checked on the host)
    const float* group_q = q + (i64)kv_head * group * head_dim;
    for (int i = threadIdx.x; i < GROUP * PER_LANE * WARP_SIZE / 4; i += blockDim.x) {
        int g = i / (PER_LANE * WARP_SIZE / 4), quad = i % (PER_LANE * WARP_SIZE / 4);
        query4[g][quad] = g < group && quad < quads
                              ? ((const float4*)(group_q + (i64)g * head_dim))[quad]
                              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    if (threadIdx.x < GROUP) {
        head_max[threadIdx.x] = NEG_INF;
        head_total[threadIdx.x] = 0.0f;
    }
    float acc[GROUP][PER_LANE];
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) acc[g][k] = 0.0f;
    __syncthreads();

    for (i64 c0 = first; c0 < end; c0 += GD_CHUNK) {
        const int chunk = (int)min((i64)GD_CHUNK, end - c0);
        // 1. This thread's position against every query of the group.
        float dot[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) dot[g] = 0.0f;
        if (threadIdx.x < chunk) {
            const i64 j = c0 + threadIdx.x;
            const i64 at = head_at + j * kv_width;
            const float* queries = (const float*)query4;
            const int stride = PER_LANE * WARP_SIZE;
            if (j == visible - 1) {
                dot_keys<KV_F32, GROUP>(fresh_key, 0, queries, stride, head_dim, dot);
            } else {
                // Its value is read in step 3, by another warp: ask L2 for
                // it now.
                const u8* value = values + at * KV_BYTES(KV);
                for (int line = 0; line < KV_BYTES(KV) * head_dim; line += 128)
                    prefetch_l2(value + line);
                if (KV == KV_Q8) prefetch_l2(value_scales + at / KV_Q8_BLOCK);
                dot_keys<KV, GROUP>(cached_k, at, queries, stride, head_dim, dot);
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g)
            weight[g][threadIdx.x] = threadIdx.x < chunk ? dot[g] * scale : NEG_INF;
        __syncthreads();
        // 2. Each head's running maximum and sum, its scores made weights.
        for (int g = warp; g < group; g += GD_WARPS) {
            float m = NEG_INF;
            for (int i = lane; i < chunk; i += WARP_SIZE) m = fmaxf(m, weight[g][i]);
            const float new_max = fmaxf(head_max[g], warp_max(m));
            float sum = 0.0f;
            for (int i = lane; i < chunk; i += WARP_SIZE) {
                float p = expf(weight[g][i] - new_max);
                weight[g][i] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float rescale = expf(head_max[g] - new_max);  // 0 for the first chunk
                head_rescale[g] = rescale;
                head_total[g] = head_total[g] * rescale + sum;
                head_max[g] = new_max;
            }
        }
        __syncthreads();
        // 3. Values, each read once for every head.
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float rescale = g < group ? head_rescale[g] : 0.0f;
#pragma unroll
            for (int k = 0; k < PER_LANE; ++k) acc[g][k] *= rescale;
        }
        for (int i0 = warp; i0 < chunk; i0 += GD_WARPS * VALUES_IN_FLIGHT(PER_LANE, KV)) {
            float v[VALUES_IN_FLIGHT(PER_LANE, KV)][PER_LANE];
            warp_values<KV, VALUES_IN_FLIGHT(PER_LANE, KV), PER_LANE>(
                cached_v, fresh_v, c0, i0, GD_WARPS, chunk, visible, head_at, kv_width, head_dim,
                lane, v);
#pragma unroll
            for (int u = 0; u < VALUES_IN_FLIGHT(PER_LANE, KV); ++u) {
                const int i = i0 + u * GD_WARPS;
                if (i < chunk) {
#pragma unroll
                    for (int g = 0; g < GROUP; ++g) {
                        const float w = weight[g][i];
#pragma unroll
                        for (int k = 0; k < PER_LANE; ++k) acc[g][k] = fmaf(w, v[u][k], acc[g][k]);
                    }
                }
            }
        }
        __syncthreads();  // weight[] is rewritten by the next chunk
    }

    // Each head: the warps' sums added, then the output (one split) or this
    // split's partial.
    const int h0 = kv_head * group;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        if (g >= group) break;
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) {
            const int d = lane + k * WARP_SIZE;
            if (d < head_dim) reduce[warp][d] = acc[g][k];
        }
        __syncthreads();
        float* o = used == 1 ? out + (i64)(h0 + g) * head_dim
                             : partials + ((i64)(h0 + g) * splits + split) * (head_dim + 2);
        // The sink's share, relative to the running maximum like the total.
        const float sink = sinks ? sinks[h0 + g] : NEG_INF;
        const float scale_out =
            used == 1 ? 1.0f / (head_total[g] + expf(sink - head_max[g])) : 1.0f;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float sum = 0.0f;
            for (int w = 0; w < GD_WARPS; ++w) sum += reduce[w][d];
            o[d] = sum * scale_out;
        }
        if (used > 1 && threadIdx.x == 0) {
            o[head_dim] = head_max[g];
            o[head_dim + 1] = head_total[g];
        }
        __syncthreads();  // reduce[] is rewritten for the next head
    }
    if (used > 1 && last_of_splits(tickets + kv_head, used)) {
        merge_split_partials<GROUP>(partials + (i64)h0 * splits * (head_dim + 2),
                                    (i64)splits * (head_dim + 2), group, used, head_dim,
                                    sinks ? sinks + h0 : nullptr, out + (i64)h0 * head_dim);
    }
}

// Positions of its split a one-sequence grouped block asks L2 for before
// it waits for the step's inputs (prefetch_split_history).
#ifndef GD_PREFETCH_ROWS
#define GD_PREFETCH_ROWS 64
#endif

// One sequence's grouped kernel over a KV cache of type KV: same
// parameters as attention_decode_*; grid (kv_heads, 1, splits), splits in
// whole multiples of SPLIT_ROWS positions. `...` is the device function
// with its template arguments (SPLIT_ROWS among them), as in
// ATTENTION_DECODE_BATCH.
#define ATTENTION_DECODE_GROUPED(name, KV, SPLIT_ROWS, ...)                                   \
    extern "C" __global__ void __launch_bounds__(GD_WARPS * WARP_SIZE)                        \
        name(const float* q, u8* keys, float* key_scales, u8* values, float* value_scales,    \
             float* out, int n, int heads, int kv_heads, int head_dim, i64 start,             \
             const u32* position, float scale, const float* new_k, const float* new_v,        \
             int window, const float* sinks, int splits, float* partials, u32* tickets) {     \
        prefetch_split_history<KV>(keys, key_scales, values, value_scales, blockIdx.x,        \
                                   kv_heads, head_dim, start, position, window, splits,       \
                                   SPLIT_ROWS, GD_PREFETCH_ROWS);                             \
        await_inputs();                                                                       \
        if (position) start = *position;                                                      \
        __VA_ARGS__(q, keys, key_scales, values, value_scales, out, heads, kv_heads,          \
                    head_dim, start, scale, new_k, new_v, window, sinks, splits, partials,    \
                    tickets);                                                                 \
    }

#define ATTENTION_DECODE_GROUPED_KERNEL(name, PER_LANE, GROUP, KV) \
    ATTENTION_DECODE_GROUPED(name, KV, WARP_SIZE,                  \
                             attend_decode_grouped<PER_LANE, GROUP, KV, WARP_SIZE>)

ATTENTION_DECODE_GROUPED_KERNEL(attention_decode_grouped_128_g8_f32, 4, 8, KV_F32)
ATTENTION_DECODE_GROUPED_KERNEL(attention_decode_grouped_128_g16_f32, 4, 16, KV_F32)
ATTENTION_DECODE_GROUPED_KERNEL(attention_decode_grouped_256_g8_f32, 8, 8, KV_F32)
ATTENTION_DECODE_GROUPED_KERNEL(attention_decode_grouped_128_g8_bf16, 4, 8, KV_BF16)
ATTENTION_DECODE_GROUPED_KERNEL(attention_decode_grouped_128_g16_bf16, 4, 16, KV_BF16)
ATTENTION_DECODE_GROUPED_KERNEL(attention_decode_grouped_256_g8_bf16, 8, 8, KV_BF16)
ATTENTION_DECODE_GROUPED_KERNEL(attention_decode_grouped_128_g8_q8, 4, 8, KV_Q8)
ATTENTION_DECODE_GROUPED_KERNEL(attention_decode_grouped_128_g16_q8, 4, 16, KV_Q8)
ATTENTION_DECODE_GROUPED_KERNEL(attention_decode_grouped_256_g8_q8, 8, 8, KV_Q8)

// Same parameters as attention_decode_batch_*; grid (kv_heads, sequences,
// splits).
#define ATTENTION_DECODE_BATCH_GROUPED_KERNEL(name, PER_LANE, GROUP, KV) \
    ATTENTION_DECODE_BATCH(name, GD_WARPS, KV,                          \
                           attend_decode_grouped<PER_LANE, GROUP, KV, GD_CHUNK>)

ATTENTION_DECODE_BATCH_GROUPED_KERNEL(attention_decode_batch_grouped_128_g8_f32, 4, 8, KV_F32)
ATTENTION_DECODE_BATCH_GROUPED_KERNEL(attention_decode_batch_grouped_128_g16_f32, 4, 16, KV_F32)
ATTENTION_DECODE_BATCH_GROUPED_KERNEL(attention_decode_batch_grouped_256_g8_f32, 8, 8, KV_F32)
ATTENTION_DECODE_BATCH_GROUPED_KERNEL(attention_decode_batch_grouped_128_g8_bf16, 4, 8, KV_BF16)
ATTENTION_DECODE_BATCH_GROUPED_KERNEL(attention_decode_batch_grouped_128_g16_bf16, 4, 16, KV_BF16)
ATTENTION_DECODE_BATCH_GROUPED_KERNEL(attention_decode_batch_grouped_256_g8_bf16, 8, 8, KV_BF16)
ATTENTION_DECODE_BATCH_GROUPED_KERNEL(attention_decode_batch_grouped_128_g8_q8, 4, 8, KV_Q8)
ATTENTION_DECODE_BATCH_GROUPED_KERNEL(attention_decode_batch_grouped_128_g16_q8, 4, 16, KV_Q8)
ATTENTION_DECODE_BATCH_GROUPED_KERNEL(attention_decode_batch_grouped_256_g8_q8, 8, 8, KV_Q8)

// ---- One token, a KV head's group on the tensor cores (bf16, f32 caches) ----
//
// attend_decode_grouped issues GROUP · head_dim f32 multiply-adds and as
// many shared-memory reads of the queries per position and thread: with
// the few blocks of one sequence's step that issuing, not the cache's
// bytes, bounds a long context. Here the products run on bf16 MMAs
// (m16n8k16, fragments as gemm.cu describes them), each warp taking 16
// positions at a time with its own running softmax:
//   scores: A = the group's queries (rows g < 8) and their remainders
//     q - bf16(q) (rows g + 8), B = 8 keys; row g plus row g + 8 is the
//     score with 16 bits of each query;
//   weighted values: A = the weights (rows g) and their remainders (rows
//     g + 8), B = the values; both rows add up to the head's sum.
// A bf16 cache's keys and values are exact as B; an f32 cache's are split
// the same way, each B and its remainder multiplied in turn (two MMAs).
// The two rows of a head land in the same lane, so the halves are added
// in registers. A k-step need not take consecutive dimensions: keys and
// queries agree on the order (k-step s = 2u + h covers dimensions
// 32u + 8i + 4h + 0..3 of lane quad i), so a lane's key bytes are whole
// 16-byte loads; an output tile j's column n is dimension 8n + j (j < 8)
// or 64 + 8n + j - 8, so a lane's value bytes are too, paired across rows
// by byte permutes (bf16) or conversions (f32). An f32 step loads its
// values after the scores (both at once would not fit in registers),
// asked of L2 first. At the end the warps' results are merged through
// shared memory and the splits' as in attend_decode. Head dimension 128,
// groups up to 8 query heads.

// Positions a warp takes at a time.
#define GT_STEP 16

// One sequence's split takes whole multiples of GT_SPLIT_ROWS positions:
// by default a step of every warp, so no warp of a block takes a step more
// than the others (8193 positions: 22 splits of 384, three steps a warp,
// where tiles of 32 gave 29 splits of 288, two or three).
#ifndef GT_SPLIT_ROWS
#define GT_SPLIT_ROWS (GT_STEP * GD_WARPS)
#endif

#if __CUDA_ARCH__ >= 800
// The newest row's 16-byte piece at `f` (shared memory: f32 values the
// cache's type holds exactly) as the cache holds it.
template <int KV>
__device__ __forceinline__ uint4 tc_fresh_piece(const float* f) {
    if (KV == KV_F32) return *(const uint4*)f;
    return make_uint4(bf16x2_exact(f[0], f[1]), bf16x2_exact(f[2], f[3]),
                      bf16x2_exact(f[4], f[5]), bf16x2_exact(f[6], f[7]));
}

// The 16-byte pieces of a warp step's keys a lane takes (rows p0 + 8t + g,
// dimensions 32u + 8i ...; f32: 32u + 8i + 4h ...), 0 at or past `end`,
// the newest row from `fresh` (shared memory, f32).
template <int KV>
__device__ __forceinline__ void tc_load_keys(const u8* keys, i64 kv_width, i64 head_at, i64 p0,
                                             i64 end, i64 newest, const float* fresh, int g,
                                             int i, uint4 (&k)[2][8]) {
    constexpr int PIECES = KV == KV_F32 ? 8 : 4;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const i64 row = p0 + 8 * t + g;
        const u8* at = keys + ((row * kv_width + head_at) + 8 * i) * KV_BYTES(KV);
#pragma unroll
        for (int c = 0; c < PIECES; ++c) {
            // bf16: piece u = c; f32: u = c / 2, h = c % 2.
            const int d = KV == KV_F32 ? 32 * (c / 2) + 4 * (c % 2) : 32 * c;
            k[t][c] = row < end ? *(const uint4*)(at + d * KV_BYTES(KV)) : make_uint4(0u, 0u, 0u, 0u);
        }
        if (row == newest) {
#pragma unroll
            for (int c = 0; c < PIECES; ++c) {
                const int d = KV == KV_F32 ? 32 * (c / 2) + 4 * (c % 2) : 32 * c;
                k[t][c] = tc_fresh_piece<KV>(fresh + 8 * i + d);
            }
        }
    }
}

// The 16-byte pieces of a warp step's values a lane takes (rows
// p0 + 2i + {0, 1, 8, 9}, dimensions 8g ... and 64 + 8g ...), 0 at or past
// `end`, the newest row from `fresh`.
template <int KV>
__device__ __forceinline__ void tc_load_values(const u8* values, i64 kv_width, i64 head_at,
                                               i64 p0, i64 end, i64 newest, const float* fresh,
                                               int g, int i, uint4 (&v)[4][4]) {
    constexpr int PER_HALF = KV == KV_F32 ? 2 : 1;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const i64 row = p0 + 2 * i + (r & 1) + 8 * (r >> 1);
        const u8* at = values + ((row * kv_width + head_at) + 8 * g) * KV_BYTES(KV);
#pragma unroll
        for (int c = 0; c < 2 * PER_HALF; ++c) {
            const int d = 64 * (c / PER_HALF) + 4 * (c % PER_HALF);
            v[r][c] = row < end ? *(const uint4*)(at + d * KV_BYTES(KV)) : make_uint4(0u, 0u, 0u, 0u);
        }
        if (row == newest) {
#pragma unroll
            for (int c = 0; c < 2 * PER_HALF; ++c) {
                const int d = 64 * (c / PER_HALF) + 4 * (c % PER_HALF);
                v[r][c] = tc_fresh_piece<KV>(fresh + 8 * g + d);
            }
        }
    }
}

// Word `w` of a piece.
__device__ __forceinline__ u32 tc_word(const uint4& piece, int w) {
    return w == 0 ? piece.x : w == 1 ? piece.y : w == 2 ? piece.z : piece.w;
}
#endif

// Same parameters as attend_decode_grouped (the scales are unused: the
// cache is bf16 or f32, head_dim is 128).
template <int KV, int SPLIT_ROWS>
__device__ __forceinline__ void attend_decode_grouped_tc(const float* q, u8* keys, float*, u8* values,
                                                         float*, float* out, int heads, int kv_heads,
                                                         int, i64 start, float scale,
                                                         const float* new_k, const float* new_v,
                                                         int window, const float* sinks,
                                                         int splits, float* partials,
                                                         u32* tickets) {
#if __CUDA_ARCH__ >= 800
    static_assert(KV == KV_BF16 || KV == KV_F32, "bf16 or f32 caches");
    constexpr int D = 128, G = 8;
    __shared__ float4 fresh4[2][D / 4];
    __shared__ float warp_max_score[GD_WARPS][G], warp_total[GD_WARPS][G];
    __shared__ float warp_out[GD_WARPS][G][D + 4];  // padded: 2-way bank conflicts
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, i = lane % 4;
    const int kv_head = blockIdx.x, split = blockIdx.z;
    const int group = heads / kv_heads;
    const i64 kv_width = (i64)kv_heads * D, head_at = (i64)kv_head * D;
    float* fresh_k = (float*)fresh4[0];
    float* fresh_v = (float*)fresh4[1];
    const i64 newest = start;
    i64 first, end;
    const int used = begin_decode_split<KV>(new_k, new_v, keys, nullptr, values, nullptr, start,
                                            window, splits, SPLIT_ROWS, kv_width, head_at, D,
                                            true, fresh_k, fresh_v, &first, &end);
    if (split >= used) return;
    // Query fragments of head g: k-step s = 2u + h.
    u32 qa[8][4];
    const float* query = q + ((i64)kv_head * group + g) * D;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
        const float4 x = g < group ? *(const float4*)(query + 32 * (s / 2) + 8 * i + 4 * (s % 2))
                                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        split_pair(x.x, x.y, qa[s][0], qa[s][1]);
        split_pair(x.z, x.w, qa[s][2], qa[s][3]);
    }
    __syncthreads();  // fresh_k and fresh_v

    float o[16][4];
#pragma unroll
    for (int j = 0; j < 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float max_score = NEG_INF, total = 0.0f;
    for (i64 p0 = first + (i64)GT_STEP * warp; p0 < end; p0 += (i64)GT_STEP * GD_WARPS) {
        uint4 k[2][8], v[4][4];
        tc_load_keys<KV>(keys, kv_width, head_at, p0, end, newest, fresh_k, g, i, k);
        if (KV == KV_BF16) {
            tc_load_values<KV>(values, kv_width, head_at, p0, end, newest, fresh_v, g, i, v);
        } else {
            // Each row's four 128-byte lines, a line a lane.
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const i64 row = p0 + 2 * i + (r & 1) + 8 * (r >> 1);
                if ((r >> 1) == (g >> 2) && row < end)
                    prefetch_l2(values + (row * kv_width + head_at) * 4 + 128 * (g & 3));
            }
        }
        // Scores of head g at positions p0 + 8t + 2i + {0, 1}.
        float score[2][2];
        float step_max = NEG_INF;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int s = 0; s < 8; ++s) {
                if (KV == KV_BF16) {
                    const uint4 w = k[t][s / 2];
                    if (s % 2 == 0) mma_bf16(c, qa[s], w.x, w.y);
                    else mma_bf16(c, qa[s], w.z, w.w);
                } else {
                    const uint4 w = k[t][s];
                    u32 hi0, lo0, hi1, lo1;
                    split_pair(__uint_as_float(w.x), __uint_as_float(w.y), hi0, lo0);
                    split_pair(__uint_as_float(w.z), __uint_as_float(w.w), hi1, lo1);
                    mma_bf16(c, qa[s], lo0, lo1);
                    mma_bf16(c, qa[s], hi0, hi1);
                }
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool valid = p0 + 8 * t + 2 * i + e < end;
                score[t][e] = valid ? (c[e] + c[2 + e]) * scale : NEG_INF;
                step_max = fmaxf(step_max, score[t][e]);
            }
        }
        step_max = fmaxf(step_max, __shfl_xor_sync(FULL_MASK, step_max, 1));
        step_max = fmaxf(step_max, __shfl_xor_sync(FULL_MASK, step_max, 2));
        // Row p0 is in range, so every head's maximum is finite.
        const float new_max = fmaxf(max_score, step_max);
        const float rescale = expf(max_score - new_max);  // 0 for the first step
        max_score = new_max;
        float p[2][2];
        float sum = 0.0f;
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                p[t][e] = expf(score[t][e] - new_max);
                sum += p[t][e];
            }
        total = total * rescale + sum;
        u32 pa[4];
        split_pair(p[0][0], p[0][1], pa[0], pa[1]);
        split_pair(p[1][0], p[1][1], pa[2], pa[3]);
        if (KV == KV_F32)
            tc_load_values<KV>(values, kv_width, head_at, p0, end, newest, fresh_v, g, i, v);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
#pragma unroll
            for (int c = 0; c < 4; ++c) o[j][c] *= rescale;
            // Rows 2i, 2i + 1 (b0) and 2i + 8, 2i + 9 (b1), column g:
            // dimension 8g + j, or 64 + 8g + j - 8.
            if (KV == KV_BF16) {
                const int word = (j % 8) / 2;
                const u32 select = j % 2 ? 0x7632 : 0x5410;
                const int piece = j / 8;
                mma_bf16(o[j], pa,
                         __byte_perm(tc_word(v[0][piece], word), tc_word(v[1][piece], word), select),
                         __byte_perm(tc_word(v[2][piece], word), tc_word(v[3][piece], word), select));
            } else {
                const int piece = 2 * (j / 8) + (j % 8) / 4, word = j % 4;
                u32 hi0, lo0, hi1, lo1;
                split_pair(__uint_as_float(tc_word(v[0][piece], word)),
                           __uint_as_float(tc_word(v[1][piece], word)), hi0, lo0);
                split_pair(__uint_as_float(tc_word(v[2][piece], word)),
                           __uint_as_float(tc_word(v[3][piece], word)), hi1, lo1);
                mma_bf16(o[j], pa, lo0, lo1);
                mma_bf16(o[j], pa, hi0, hi1);
            }
        }
    }
    // The warp's results: head g's maximum, sum and weighted values
    // (tile j's columns 2i and 2i + 1: dimensions 16i + j and 16i + 8 + j,
    // or 64 + 16i + j - 8 and 64 + 16i + j).
    total += __shfl_xor_sync(FULL_MASK, total, 1);
    total += __shfl_xor_sync(FULL_MASK, total, 2);
    if (i == 0) {
        warp_max_score[warp][g] = max_score;
        warp_total[warp][g] = total;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int d = (j < 8 ? 0 : 56) + 16 * i + j;
        warp_out[warp][g][d] = o[j][0] + o[j][2];
        warp_out[warp][g][d + 8] = o[j][1] + o[j][3];
    }
    __syncthreads();
    // The block's result per head, merged over the warps: 4 dimensions a
    // thread (GD_WARPS · 32 threads over G · D values).
    static_assert(GD_WARPS * WARP_SIZE * 4 == G * D, "four dimensions a thread");
    const int h = threadIdx.x / (D / 4), d = 4 * (threadIdx.x % (D / 4));
    const int h0 = kv_head * group;
    if (h < group) {
        float overall = NEG_INF;
#pragma unroll
        for (int w = 0; w < GD_WARPS; ++w) overall = fmaxf(overall, warp_max_score[w][h]);
        float sum = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int w = 0; w < GD_WARPS; ++w) {
            // A warp that saw no position weighs 0.
            const float e = expf(warp_max_score[w][h] - overall);
            sum += warp_total[w][h] * e;
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[c] += warp_out[w][h][d + c] * e;
        }
        if (used == 1) {
            const float sink = sinks ? sinks[h0 + h] : NEG_INF;
            const float inverse = 1.0f / (sum + expf(sink - overall));
            float* o_row = out + (i64)(h0 + h) * D + d;
#pragma unroll
            for (int c = 0; c < 4; ++c) o_row[c] = acc[c] * inverse;
        } else {
            float* part = partials + ((i64)(h0 + h) * splits + split) * (D + 2);
#pragma unroll
            for (int c = 0; c < 4; ++c) part[d + c] = acc[c];
            if (d == 0) {
                part[D] = overall;
                part[D + 1] = sum;
            }
        }
    }
    if (used > 1 && last_of_splits(tickets + kv_head, used)) {
        merge_split_partials<G>(partials + (i64)h0 * splits * (D + 2), (i64)splits * (D + 2),
                                group, used, D, sinks ? sinks + h0 : nullptr,
                                out + (i64)h0 * D);
    }
#endif
}

// Same parameters as attention_decode_grouped_*; grid (kv_heads, 1, splits).
ATTENTION_DECODE_GROUPED(attention_decode_grouped_tc_bf16, KV_BF16, GT_SPLIT_ROWS,
                         attend_decode_grouped_tc<KV_BF16, GT_SPLIT_ROWS>)
ATTENTION_DECODE_GROUPED(attention_decode_grouped_tc_f32, KV_F32, GT_SPLIT_ROWS,
                         attend_decode_grouped_tc<KV_F32, GT_SPLIT_ROWS>)

// Same parameters as attention_decode_batch_*; grid (kv_heads, sequences,
// splits).
ATTENTION_DECODE_BATCH(attention_decode_batch_grouped_tc_bf16, GD_WARPS, KV_BF16,
                       attend_decode_grouped_tc<KV_BF16, GD_CHUNK>)
ATTENTION_DECODE_BATCH(attention_decode_batch_grouped_tc_f32, GD_WARPS, KV_F32,
                       attend_decode_grouped_tc<KV_F32, GD_CHUNK>)

// ---- Tiles of keys staged in shared memory, scored lane by lane ----
//
// mla.cu's attention walks its keys in tiles one lane per key: each lane
// scores its staged key against a warp's rows and the rows keep a running
// (online) softmax, as attend() does for one row.

// Lane `lane`'s staged key `my_key` (`dim` values, 16-byte aligned)
// against each of a warp's ROWS query rows (`warp_q`, `dim` apart): the
// dot products, into `score`.
template <int ROWS>
__device__ __forceinline__ void score_staged_key(const float* my_key, const float* warp_q,
                                                 int dim, float* score) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) score[r] = 0.0f;
    for (int d = 0; d < dim; d += 4) {
        const float4 kq = *(const float4*)(my_key + d);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float4 qq = *(const float4*)(warp_q + r * dim + d);
            score[r] = fmaf(qq.x, kq.x, score[r]);
            score[r] = fmaf(qq.y, kq.y, score[r]);
            score[r] = fmaf(qq.z, kq.z, score[r]);
            score[r] = fmaf(qq.w, kq.w, score[r]);
        }
    }
}

// A warp's ROWS rows before their first tile: no maximum, nothing summed.
template <int ROWS, int PER_LANE>
__device__ __forceinline__ void start_online_softmax(float* running_max, float* lane_total,
                                                     float (*acc)[PER_LANE]) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        running_max[r] = NEG_INF;
        lane_total[r] = 0.0f;
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) acc[r][k] = 0.0f;
    }
}

// One staged tile's step of the online softmax of a warp's ROWS rows, lane
// `lane` holding its key's scaled scores `s` (-inf where a row does not
// see it): each row's running maximum, the lanes' sums and weighted values
// (`acc`) rescaled to it, and the key's probabilities into `warp_p`
// ([key][ROWS]). A tile a row cannot see leaves it unchanged (its maximum
// stays -inf).
template <int ROWS, int PER_LANE>
__device__ __forceinline__ void online_softmax_tile(const float* s, float* running_max,
                                                    float* lane_total, float (*acc)[PER_LANE],
                                                    float* warp_p, int lane) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float new_max = fmaxf(running_max[r], warp_max(s[r]));
        const bool none = new_max == NEG_INF;
        const float rescale = none ? 1.0f : expf(running_max[r] - new_max);
        const float p = none ? 0.0f : expf(s[r] - new_max);
        lane_total[r] = lane_total[r] * rescale + p;
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) acc[r][k] *= rescale;
        running_max[r] = new_max;
        warp_p[lane * ROWS + r] = p;
    }
}

// ---- Prefill: FlashAttention on the tensor cores ----
//
// attend() gives every (token, head) its own block, so a prefill of n
// tokens would read each layer's keys and values about n · heads / 2
// times. Here a block takes FA_ROWS query rows of one KV head (rows are
// (token, head) pairs, token-major, over the heads that share the KV
// head), FA_ROWS_PER_WARP = 16 rows a warp (the MMA's M), and walks the
// visible keys in tiles of FA_KEYS staged in shared memory, each read once
// for all the block's rows (FlashAttention-2's loop):
//   S = Q Kᵀ (16 rows × FA_KEYS keys a warp), masked and scaled;
//   each row's running maximum m and sum l, O rescaled to the new maximum;
//   O += exp(S - m) V, the probabilities taken from S's accumulators.
// Both products run on the tensor cores as bf16 MMAs (m16n8k16) of
// operands split as x = hi + lo, both bf16 (gemm.cu's split of
// activations): three MMAs a step (lo·hi + hi·lo + hi·hi), about 2^-16 of
// each product's magnitude, so prefill stays within the tests' bound of
// the one-token decode kernels, which compute in f32. A bf16 cache's keys
// and values are their own hi (lo = 0), so its steps take two MMAs. exp is
// expf as there.
//
// Queries are split once per block, keys and values once per tile (not by
// every warp), so the loops are loads and MMAs. A tile's keys and values
// come as the cache holds them by cp.async into a raw buffer (RawTile)
// while the block computes the tile before, then are split from there: the
// block waits for memory once, at its first tile.
// Fragments (gemm.cu's table of m16n8k16; g = lane / 4, i = lane % 4):
//   A (rows × k): a0 = (g, 2i..2i+1), a1 = (g+8, 2i..), a2 = (g, 2i+8..),
//                 a3 = (g+8, 2i+8..);  B (k × n): b0 = (k 2i.., n g),
//                 b1 = (k 2i+8.., n g);  C: c0 = (g, 2i), c1 = (g, 2i+1),
//                 c2 = (g+8, 2i), c3 = (g+8, 2i+1).
// S = Q Kᵀ: k the head's dimensions, n the keys. O += P V: k the keys,
// n the dimensions; S's tiles of keys 16s.. and 16s + 8.. give P's A
// fragment as they lie (a0 = c0 c1 of the first, a1 = its c2 c3, a2, a3
// the second's), with no exchange between lanes.
//
// Shared memory holds bf16 pairs (32-bit words): queries and keys by row
// (pairs along the dimensions), values transposed (a row per dimension,
// pairs along the keys), each as a hi and a lo array. In every run of 16
// elements (8 pairs) pair p is stored at word fa_word(p), so a lane's two
// pairs of a fragment (2i and 2i + 8 elements in) are adjacent: one 8-byte
// load. Rows are D / 2 + FA_WORD_PAD (queries, keys) or FA_KEYS / 2 +
// FA_WORD_PAD (values) words apart, ≡ 8 (mod 16), so a half warp's 8-byte
// loads (rows g, words 2i, 2i + 1) hit 32 different banks. Dimensions from
// head_dim to D are staged as zeros, so any head_dim ≤ D (a multiple of 4)
// takes the kernel of the next larger D.

// FA_WARPS, FA_ROWS_PER_WARP, FA_KEYS and FA_WORD_PAD come from geometry.rs.
#define FA_ROWS (FA_WARPS * FA_ROWS_PER_WARP)
#if FA_ROWS_PER_WARP != 16 || FA_KEYS % 32 != 0 || (FA_KEYS / 2 + FA_WORD_PAD) % 16 != 8
#error "attention.cu: the tensor-core prefill needs 16 rows a warp, 32 keys a tile, rows ≡ 8 (mod 16)"
#endif

#if __CUDA_ARCH__ >= 800

// The word of pair p (elements 2p, 2p + 1) of a staged row: in each run of
// 8 pairs, pairs 0-3 at the even words, 4-7 at the odd ones.
__device__ __forceinline__ int fa_word(int p) {
    return (p & ~7) | ((p & 3) << 1) | ((p >> 2) & 1);
}

// Loads a thread issues before it stores any while staging (float4s).
#ifndef FA_STAGE_BATCH
#define FA_STAGE_BATCH 8
#endif

// Stages COUNT rows of D values split into bf16 hi and lo, the first
// `head_dim` of row r from `src(r, column)` (a float4 at a multiple of 4),
// zeros after: pairs by row into `hi` and `lo` (rows D / 2 + FA_WORD_PAD
// words apart; `lo` untouched when EXACT, the values being bf16). Each
// thread issues FA_STAGE_BATCH loads before it stores any, so a tile waits
// for memory about once per batch, not once per load.
template <int D, int COUNT, bool EXACT, typename Src>
__device__ __forceinline__ void stage_split_rows(u32* hi, u32* lo, int head_dim, Src src) {
    constexpr int QUADS = D / 4;
    constexpr int LD = D / 2 + FA_WORD_PAD;
    constexpr int THREADS = FA_WARPS * WARP_SIZE;
    constexpr int PER_THREAD = COUNT * QUADS / THREADS;
    static_assert(PER_THREAD % FA_STAGE_BATCH == 0, "whole batches of loads");
#pragma unroll 1
    for (int b0 = 0; b0 < PER_THREAD; b0 += FA_STAGE_BATCH) {
        float4 v[FA_STAGE_BATCH];
#pragma unroll
        for (int j = 0; j < FA_STAGE_BATCH; ++j) {
            const int at = threadIdx.x + (b0 + j) * THREADS;
            const int c = 4 * (at % QUADS);
            v[j] = c < head_dim ? src(at / QUADS, c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int j = 0; j < FA_STAGE_BATCH; ++j) {
            const int at = threadIdx.x + (b0 + j) * THREADS;
            const int r = at / QUADS, q = at % QUADS;
            u32 h0, l0, h1, l1;
            split_pair(v[j].x, v[j].y, h0, l0);
            split_pair(v[j].z, v[j].w, h1, l1);
            hi[r * LD + fa_word(2 * q)] = h0;
            hi[r * LD + fa_word(2 * q + 1)] = h1;
            if (!EXACT) {
                lo[r * LD + fa_word(2 * q)] = l0;
                lo[r * LD + fa_word(2 * q + 1)] = l1;
            }
        }
    }
}

// Stages FA_KEYS rows of D values transposed and split: for each
// dimension a row of FA_KEYS / 2 + FA_WORD_PAD words, pairs of keys along
// it, from `src(key, column)` as stage_split_rows (two loads an item, so
// FA_STAGE_BATCH / 2 items a batch).
template <int D, bool EXACT, typename Src>
__device__ __forceinline__ void stage_split_columns(u32* hi, u32* lo, int head_dim, Src src) {
    constexpr int QUADS = D / 4;
    constexpr int PAIRS = FA_KEYS / 2;
    constexpr int LD = PAIRS + FA_WORD_PAD;
    constexpr int THREADS = FA_WARPS * WARP_SIZE;
    constexpr int PER_THREAD = PAIRS * QUADS / THREADS;
    constexpr int BATCH = FA_STAGE_BATCH / 2;
    static_assert(PER_THREAD % BATCH == 0, "whole batches of loads");
    // Lanes take consecutive pairs of keys: their stores (a word each of
    // one dimension's row) fall in different banks.
#pragma unroll 1
    for (int b0 = 0; b0 < PER_THREAD; b0 += BATCH) {
        float4 v[BATCH][2];
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int at = threadIdx.x + (b0 + j) * THREADS;
            const int m = at % PAIRS, c = 4 * (at / PAIRS);
#pragma unroll
            for (int k = 0; k < 2; ++k)
                v[j][k] = c < head_dim ? src(2 * m + k, c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int at = threadIdx.x + (b0 + j) * THREADS;
            const int m = at % PAIRS, c = 4 * (at / PAIRS);
            const float first[4] = {v[j][0].x, v[j][0].y, v[j][0].z, v[j][0].w};
            const float second[4] = {v[j][1].x, v[j][1].y, v[j][1].z, v[j][1].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                u32 h, l;
                split_pair(first[e], second[e], h, l);
                hi[(c + e) * LD + fa_word(m)] = h;
                if (!EXACT) lo[(c + e) * LD + fa_word(m)] = l;
            }
        }
    }
}

// One tile of FA_KEYS keys and values of a KV head as the cache holds them
// (D values a row; columns from head_dim on and keys past the tile are
// zeros), copied by cp.async, and for q8 each quad's scale.
template <int D, int KV>
struct RawTile {
    static constexpr int QUADS = D / 4;
    static constexpr int ROW_BYTES = D * KV_BYTES(KV);
    u8* keys;       // [FA_KEYS][ROW_BYTES]
    u8* values;     // [FA_KEYS][ROW_BYTES]
    float* scales;  // q8: [2][FA_KEYS][QUADS], keys' then values'

    // Queues the copies of keys [j0, j0 + tile) (tile ≥ 1) of the head
    // whose first column is column0.
    __device__ __forceinline__ void fetch(KvSide<KV> k, KvSide<KV> v, i64 j0, int tile,
                                          i64 kv_width, i64 column0, int head_dim) const {
        constexpr int THREADS = FA_WARPS * WARP_SIZE;
        constexpr int QUAD_BYTES = 4 * KV_BYTES(KV);
        for (int at = threadIdx.x; at < FA_KEYS * QUADS; at += THREADS) {
            const int key = at / QUADS, c = 4 * (at % QUADS);
            const bool valid = key < tile && c < head_dim;
            // An address in the cache even where nothing is read.
            const i64 index = (j0 + min(key, tile - 1)) * kv_width + column0 + min(c, head_dim - 4);
            const int to = key * ROW_BYTES + c * KV_BYTES(KV);
#pragma unroll
            for (int side = 0; side < 2; ++side) {
                u8* dst = (side ? values : keys) + to;
                const u8* src = (side ? v : k).data + index * KV_BYTES(KV);
                if (QUAD_BYTES == 16) copy_async16(dst, src, valid);
                else if (QUAD_BYTES == 8) copy_async8(dst, src, valid);
                else copy_async4(dst, src, valid);
                if (KV == KV_Q8)
                    copy_async4(scales + (side * FA_KEYS + key) * QUADS + c / 4,
                                (side ? v : k).scales + index / KV_Q8_BLOCK, valid);
            }
        }
    }

    // Values c..c + 3 of key `key` of a side (0 keys, 1 values), in f32.
    __device__ __forceinline__ float4 quad(int side, int key, int c) const {
        const u8* row = (side ? values : keys) + key * ROW_BYTES;
        return KvSide<KV>::quad_at(row + c * KV_BYTES(KV),
                                   scales + (side * FA_KEYS + key) * QUADS + c / 4);
    }
};

// c += a · b at about 2^-16 of the product: a and b split into bf16 hi and
// lo, the small terms first; with `exact_b` b is its hi (lo = 0).
template <bool EXACT_B>
__device__ __forceinline__ void mma_3xbf16(float (&c)[4], const u32 (&ah)[4], const u32 (&al)[4],
                                           uint2 bh, uint2 bl) {
    mma_bf16(c, al, bh.x, bh.y);
    if (!EXACT_B) mma_bf16(c, ah, bl.x, bl.y);
    mma_bf16(c, ah, bh.x, bh.y);
}

template <int D, int KV, bool COPY>
__device__ __forceinline__ void flash_attend(const float* q, KvSide<KV> keys, KvSide<KV> values,
                                             float* out, int n, int heads, int kv_heads,
                                             int head_dim, i64 start, float scale, int window,
                                             const float* sinks) {
    constexpr int QK_LD = D / 2 + FA_WORD_PAD;
    constexpr int V_LD = FA_KEYS / 2 + FA_WORD_PAD;
    constexpr int KEY_TILES = FA_KEYS / 8;
    constexpr int DIM_TILES = D / 8;
    // A bf16 cache holds its keys and values exactly as bf16.
    constexpr bool EXACT = KV == KV_BF16;
    extern __shared__ float4 fa_shared[];
    u32* q_hi = (u32*)fa_shared;            // [FA_ROWS][QK_LD]
    u32* q_lo = q_hi + FA_ROWS * QK_LD;     // [FA_ROWS][QK_LD]
    u32* k_hi = q_lo + FA_ROWS * QK_LD;     // [FA_KEYS][QK_LD]
    u32* k_lo = k_hi + FA_KEYS * QK_LD;     // [FA_KEYS][QK_LD]
    u32* v_hi = k_lo + FA_KEYS * QK_LD;     // [D][V_LD]
    u32* v_lo = v_hi + D * V_LD;            // [D][V_LD]
    static_assert((2 * (FA_ROWS + FA_KEYS) * QK_LD + 2 * D * V_LD) % 4 == 0,
                  "the raw tile 16-byte aligned");
    u8* raw_keys = (u8*)(v_lo + D * V_LD);
    const RawTile<D, KV> raw{raw_keys, raw_keys + FA_KEYS * RawTile<D, KV>::ROW_BYTES,
                             (float*)(raw_keys + 2 * FA_KEYS * RawTile<D, KV>::ROW_BYTES)};
    const int warp = threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, i = lane % 4;
    const int group = heads / kv_heads;
    const int kv_head = blockIdx.y;
    const i64 rows = (i64)n * group;
    // The last rows see the most keys: their blocks start first.
    const i64 row0 = (i64)(gridDim.x - 1 - blockIdx.x) * FA_ROWS;
    const i64 kv_width = (i64)kv_heads * head_dim;
    const i64 q_width = (i64)heads * head_dim;

    // Keys visible to this lane's rows g and g + 8, to the warp and to the
    // block (rows are token-major, so a range's last row sees the most);
    // with a window a row sees only its last `window` keys.
    const i64 warp_row0 = row0 + warp * FA_ROWS_PER_WARP;
    i64 visible[2], oldest[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const i64 row = min(warp_row0 + g + 8 * h, rows - 1);
        visible[h] = start + row / group + 1;
        oldest[h] = window > 0 ? max((i64)0, visible[h] - window) : 0;
    }
    auto first_key = [&](i64 first_row) {
        return window > 0 ? max((i64)0, start + min(first_row, rows - 1) / group + 1 - window)
                          : (i64)0;
    };
    const i64 warp_visible = start + min(warp_row0 + FA_ROWS_PER_WARP - 1, rows - 1) / group + 1;
    const i64 warp_oldest = first_key(warp_row0);
    const i64 block_visible = start + min(row0 + FA_ROWS - 1, rows - 1) / group + 1;
    const i64 block_oldest = first_key(row0);
    const i64 column0 = (i64)kv_head * head_dim;
    auto fetch = [&](i64 j0) {
        if (!COPY) return;
        if (j0 < block_visible)
            raw.fetch(keys, values, j0, (int)min((i64)FA_KEYS, block_visible - j0), kv_width,
                      column0, head_dim);
        copy_async_commit();
    };
    // The first tile's copies fly while the queries are staged.
    fetch(block_oldest);

    // The block's query rows; rows past the end repeat the last one.
    stage_split_rows<D, FA_ROWS, false>(q_hi, q_lo, head_dim, [&](int r, int c) {
        const i64 row = min(row0 + r, rows - 1);
        const int h = kv_head * group + (int)(row % group);
        return *(const float4*)(q + (row / group) * q_width + (i64)h * head_dim + c);
    });

    // Rows g (h = 0) and g + 8 (h = 1): running maximum, this lane's part
    // of the sum, and O's columns 8·t + 2i, + 1 in o[t][2h], o[t][2h + 1].
    float running_max[2] = {NEG_INF, NEG_INF};
    float lane_total[2] = {0.0f, 0.0f};
    float o[DIM_TILES][4];
#pragma unroll
    for (int t = 0; t < DIM_TILES; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
    const u32* warp_q_hi = q_hi + warp * FA_ROWS_PER_WARP * QK_LD;
    const u32* warp_q_lo = q_lo + warp * FA_ROWS_PER_WARP * QK_LD;

    for (i64 j0 = block_oldest; j0 < block_visible; j0 += FA_KEYS) {
        if (COPY) copy_async_wait<0>();
        __syncthreads();  // the tile's copies visible; the previous tile no longer read
        // Without the raw tile, straight from the cache (rows past the
        // tile read as its last row and staged as zeros).
        const int tile = (int)min((i64)FA_KEYS, block_visible - j0);
        auto side = [&](int which, const KvSide<KV>& cache, int key, int c) {
            if (COPY) return raw.quad(which, key, c);
            const float4 v = cache.quad(min(j0 + key, j0 + tile - 1) * kv_width + column0 + c);
            return key < tile ? v : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        };
        stage_split_rows<D, FA_KEYS, EXACT>(k_hi, k_lo, head_dim, [&](int key, int c) {
            return side(0, keys, key, c);
        });
        stage_split_columns<D, EXACT>(v_hi, v_lo, head_dim, [&](int key, int c) {
            return side(1, values, key, c);
        });
        __syncthreads();  // the tile split; its raw copy no longer read
        fetch(j0 + FA_KEYS);
        // A warp none of whose rows sees a key of the tile skips it.
        if (j0 >= warp_visible || j0 + FA_KEYS <= warp_oldest) continue;

        float s[KEY_TILES][4];
#pragma unroll
        for (int t = 0; t < KEY_TILES; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.0f;
#pragma unroll 2
        for (int w0 = 0; w0 < D / 2; w0 += 8) {
            const int at = w0 + 2 * i;
            const uint2 top_hi = *(const uint2*)(warp_q_hi + g * QK_LD + at);
            const uint2 bottom_hi = *(const uint2*)(warp_q_hi + (g + 8) * QK_LD + at);
            const uint2 top_lo = *(const uint2*)(warp_q_lo + g * QK_LD + at);
            const uint2 bottom_lo = *(const uint2*)(warp_q_lo + (g + 8) * QK_LD + at);
            const u32 ah[4] = {top_hi.x, bottom_hi.x, top_hi.y, bottom_hi.y};
            const u32 al[4] = {top_lo.x, bottom_lo.x, top_lo.y, bottom_lo.y};
#pragma unroll
            for (int t = 0; t < KEY_TILES; ++t) {
                const int key = (8 * t + g) * QK_LD + at;
                const uint2 bh = *(const uint2*)(k_hi + key);
                const uint2 bl = EXACT ? make_uint2(0u, 0u) : *(const uint2*)(k_lo + key);
                mma_3xbf16<EXACT>(s[t], ah, al, bh, bl);
            }
        }

        // Mask and scale; each row's new maximum over its quad of lanes.
        float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int t = 0; t < KEY_TILES; ++t) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int h = c / 2;
                const i64 key = j0 + 8 * t + 2 * i + c % 2;
                const bool seen = key < visible[h] && key >= oldest[h];
                s[t][c] = seen ? s[t][c] * scale : NEG_INF;
                tile_max[h] = fmaxf(tile_max[h], s[t][c]);
            }
        }
        float rescale[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float m = tile_max[h];
            m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, 1));
            m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, 2));
            const float new_max = fmaxf(running_max[h], m);
            const bool none = new_max == NEG_INF;
            rescale[h] = none ? 1.0f : expf(running_max[h] - new_max);
            float sum = 0.0f;
#pragma unroll
            for (int t = 0; t < KEY_TILES; ++t) {
#pragma unroll
                for (int c = 2 * h; c < 2 * h + 2; ++c) {
                    s[t][c] = none ? 0.0f : expf(s[t][c] - new_max);
                    sum += s[t][c];
                }
            }
            lane_total[h] = lane_total[h] * rescale[h] + sum;
            running_max[h] = new_max;
        }
#pragma unroll
        for (int t = 0; t < DIM_TILES; ++t) {
            o[t][0] *= rescale[0];
            o[t][1] *= rescale[0];
            o[t][2] *= rescale[1];
            o[t][3] *= rescale[1];
        }

        // O += P V, a step of 16 keys per two S tiles.
#pragma unroll
        for (int t = 0; t < KEY_TILES; t += 2) {
            u32 ah[4], al[4];
            split_pair(s[t][0], s[t][1], ah[0], al[0]);
            split_pair(s[t][2], s[t][3], ah[1], al[1]);
            split_pair(s[t + 1][0], s[t + 1][1], ah[2], al[2]);
            split_pair(s[t + 1][2], s[t + 1][3], ah[3], al[3]);
            const int at = 4 * t + 2 * i;
#pragma unroll
            for (int d = 0; d < DIM_TILES; ++d) {
                const int column = (8 * d + g) * V_LD + at;
                const uint2 bh = *(const uint2*)(v_hi + column);
                const uint2 bl = EXACT ? make_uint2(0u, 0u) : *(const uint2*)(v_lo + column);
                mma_3xbf16<EXACT>(o[d], ah, al, bh, bl);
            }
        }
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float total = lane_total[h];
        total += __shfl_xor_sync(FULL_MASK, total, 1);
        total += __shfl_xor_sync(FULL_MASK, total, 2);
        const i64 row = warp_row0 + g + 8 * h;
        if (row >= rows) continue;
        const i64 t = row / group;
        const int head = kv_head * group + (int)(row % group);
        if (sinks) total += expf(sinks[head] - running_max[h]);
        float* dst = out + t * q_width + (i64)head * head_dim;
#pragma unroll
        for (int d = 0; d < DIM_TILES; ++d) {
            const int c = 8 * d + 2 * i;
            if (c < head_dim) *(float2*)(dst + c) = make_float2(o[d][2 * h] / total, o[d][2 * h + 1] / total);
        }
    }
}

#endif

// Grid: (ceil(n · heads / kv_heads / FA_ROWS), kv_heads), FA_WARPS warps,
// dynamic shared memory from flash_attention_shared_bytes (Rust side).
// sm_80+ (bf16 MMAs); on older devices the kernels are empty and
// attention.rs takes attend() instead.
#if __CUDA_ARCH__ >= 800
#define FLASH_ATTEND(D, KV, COPY)                                                                \
    flash_attend<D, KV, COPY>(q, KvSide<KV>{keys, key_scales}, KvSide<KV>{values, value_scales}, \
                              out, n, heads, kv_heads, head_dim, start, scale, window, sinks);
#else
#define FLASH_ATTEND(D, KV, COPY)
#endif
#define FLASH_ATTENTION_KERNEL(name, D, KV, COPY)                                       \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * WARP_SIZE)                  \
        name(const float* q, const u8* keys, const float* key_scales, const u8* values, \
             const float* value_scales, float* out, int n, int heads, int kv_heads,     \
             int head_dim, i64 start, float scale, int window, const float* sinks) {    \
        await_inputs();                                                                 \
        FLASH_ATTEND(D, KV, COPY)                                                       \
    }

// The tiles copied by cp.async (the raw tile in shared memory), and for
// devices whose blocks cannot hold it, staged straight from the cache.
FLASH_ATTENTION_KERNEL(flash_attention_128_f32, 128, KV_F32, true)
FLASH_ATTENTION_KERNEL(flash_attention_256_f32, 256, KV_F32, true)
FLASH_ATTENTION_KERNEL(flash_attention_128_bf16, 128, KV_BF16, true)
FLASH_ATTENTION_KERNEL(flash_attention_256_bf16, 256, KV_BF16, true)
FLASH_ATTENTION_KERNEL(flash_attention_128_q8, 128, KV_Q8, true)
FLASH_ATTENTION_KERNEL(flash_attention_256_q8, 256, KV_Q8, true)
FLASH_ATTENTION_KERNEL(flash_attention_128_direct_f32, 128, KV_F32, false)
FLASH_ATTENTION_KERNEL(flash_attention_256_direct_f32, 256, KV_F32, false)
FLASH_ATTENTION_KERNEL(flash_attention_128_direct_bf16, 128, KV_BF16, false)
FLASH_ATTENTION_KERNEL(flash_attention_256_direct_bf16, 256, KV_BF16, false)
FLASH_ATTENTION_KERNEL(flash_attention_128_direct_q8, 128, KV_Q8, false)
FLASH_ATTENTION_KERNEL(flash_attention_256_direct_q8, 256, KV_Q8, false)
