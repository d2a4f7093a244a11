// Multi-head latent attention (DeepSeek-V3, Kimi K2) over a latent cache
// `[capacity, lora + rope]`: each position's normalised latent and its
// rotary key, no values. `kv_b` (`[heads · (nope + v_dim), lora]`: per head
// its key rows, then its value rows) is absorbed into the queries and the
// output instead of expanding every position's keys and values:
//   1. mla_absorb_query: each query's non-rotary part through its head's
//      key rows into the latent space, beside its rotary part, so that a
//      query is a row of the cache's width; the blocks of head 0 store the
//      new positions' rows into the cache;
//   2. mla_attention: scores of the query rows against the cached rows, and
//      the softmax-weighted latents (the first lora values of each row);
//   3. mla_value_out: each head's value rows applied to its weighted latent.
// Prefill and decode run the same kernels; a decode step splits a long
// context over several blocks per tile of query rows, as attention.cu's
// decode kernels split a head's positions, and merges the splits the same
// way (decode_split_range, last_of_splits, merge_split_partials).

// Launch geometry comes from the host: compile.rs passes the constants of
// geometry.rs as -D options, so a launch and its kernel cannot disagree.
#if !defined(MLA_ABSORB_THREADS) || !defined(MLA_ABSORB_COLUMNS) || \
    !defined(MLA_ABSORB_TOKENS) || !defined(MLA_MAX_NOPE) || !defined(MLA_WARPS) || \
    !defined(MLA_ROWS_PER_WARP) || !defined(MLA_KEYS) || !defined(MLA_KEY_PAD) || \
    !defined(MLA_VALUES_PER_LANE) || !defined(MLA_OUT_WARPS) || !defined(MLA_OUT_TOKENS)
#error "mla.cu: launch geometry missing (compile.rs passes geometry.rs as -D options)"
#endif
#if MLA_KEYS != WARP_SIZE
#error "mla.cu: mla_attention scores one staged key per lane"
#endif

// Grid (heads, ceil(n / MLA_ABSORB_TOKENS)), MLA_ABSORB_THREADS threads.
// For the block's tokens t and head h = blockIdx.x:
//   q_abs[t, h] = [Σ_i q[t, h, rope + i] · kv_b[h · (nope + v_dim) + i, :], q[t, h, :rope]]
// where a row of q holds each head's rope + nope values, rotary part first,
// and a row of q_abs each head's lora + rope. Each thread keeps
// MLA_ABSORB_COLUMNS latent columns for every token of the block, so each
// weight is read once per block. The blocks of head 0 store their tokens'
// cache rows [latent | k_rot] at rows start + t (`start` read from
// `position` on the device when given: a recorded step).
extern "C" __global__ void __launch_bounds__(MLA_ABSORB_THREADS)
    mla_absorb_query(const float* q, const u8* codes, const u16* scales, const u16* biases,
                     int dtype, float* q_abs, float* cache, const float* latent,
                     const float* k_rot, int n, int heads, int lora, int rope, int nope,
                     int v_dim, i64 start, const u32* position) {
    await_inputs();
    __shared__ float q_nope[MLA_ABSORB_TOKENS][MLA_MAX_NOPE];
    if (position) start = *position;
    const int h = blockIdx.x;
    const int t0 = blockIdx.y * MLA_ABSORB_TOKENS;
    const int count = min(MLA_ABSORB_TOKENS, n - t0);
    const int qk = rope + nope;
    const int width = lora + rope;
    for (int i = threadIdx.x; i < count * nope; i += blockDim.x) {
        const int t = i / nope, d = i % nope;
        q_nope[t][d] = q[((i64)(t0 + t) * heads + h) * qk + rope + d];
    }
    __syncthreads();
    const i64 row0 = (i64)h * (nope + v_dim);
    float acc[MLA_ABSORB_TOKENS][MLA_ABSORB_COLUMNS];
#pragma unroll
    for (int t = 0; t < MLA_ABSORB_TOKENS; ++t)
#pragma unroll
        for (int k = 0; k < MLA_ABSORB_COLUMNS; ++k) acc[t][k] = 0.0f;
    for (int i = 0; i < nope; ++i) {
#pragma unroll
        for (int k = 0; k < MLA_ABSORB_COLUMNS; ++k) {
            const int c = threadIdx.x + k * MLA_ABSORB_THREADS;
            const float w =
                c < lora ? dequantize(codes, scales, biases, dtype, row0 + i, c, lora) : 0.0f;
#pragma unroll
            for (int t = 0; t < MLA_ABSORB_TOKENS; ++t)
                if (t < count) acc[t][k] = fmaf(q_nope[t][i], w, acc[t][k]);
        }
    }
#pragma unroll
    for (int t = 0; t < MLA_ABSORB_TOKENS; ++t) {
        if (t < count) {
            float* row = q_abs + ((i64)(t0 + t) * heads + h) * width;
#pragma unroll
            for (int k = 0; k < MLA_ABSORB_COLUMNS; ++k) {
                const int c = threadIdx.x + k * MLA_ABSORB_THREADS;
                if (c < lora) row[c] = acc[t][k];
            }
        }
    }
    for (int i = threadIdx.x; i < count * rope; i += blockDim.x) {
        const int t = i / rope, d = i % rope;
        const i64 at = (i64)(t0 + t) * heads + h;
        q_abs[at * width + lora + d] = q[at * qk + d];
    }
    if (h == 0) {
        for (int i = threadIdx.x; i < count * width; i += blockDim.x) {
            const i64 token = t0 + i / width;
            const int c = i % width;
            cache[(start + token) * width + c] =
                c < lora ? latent[token * lora + c] : k_rot[token * rope + c - lora];
        }
    }
}

#define MLA_ROWS (MLA_WARPS * MLA_ROWS_PER_WARP)

// Grid (ceil(n · heads / MLA_ROWS), 1, splits), MLA_WARPS warps, dynamic
// shared memory from mla_shared_bytes (mla.rs). The rows are (token, head)
// pairs, token-major, of q_abs ([n · heads, lora + rope]); every row
// attends to the same cached rows (the latent is one KV head for all
// heads), so a block stages MLA_KEYS cached rows at a time for its MLA_ROWS
// query rows, FlashAttention-style as attention.cu's flash_attend does:
// lane j scores staged row j against each of the warp's rows, then lane l
// accumulates latent columns l, l + 32, ... of them (lora ≤ 32 ·
// MLA_VALUES_PER_LANE, checked on the host). Token t's rows see the cached
// rows up to start + t (`start` read from `position` when given). Scores
// are scaled by `scale`; out is [n · heads, lora].
//
// With `splits` > 1 the positions are split over the blocks of grid z in
// whole tiles (decode_split_range): each block writes its rows' weighted
// latents, maxima and sums to `partials` ([rows][splits][lora + 2]), and
// the last of a row tile's blocks to finish (a ticket per tile, back to
// zero after it) merges them into out.
extern "C" __global__ void __launch_bounds__(MLA_WARPS * WARP_SIZE)
    mla_attention(const float* q_abs, const float* cache, float* out, int n, int heads,
                  int lora, int rope, i64 start, const u32* position, float scale, int splits,
                  float* partials, u32* tickets) {
    await_inputs();
    extern __shared__ float4 mla_shared[];
    if (position) start = *position;
    const int width = lora + rope;
    const int key_stride = width + MLA_KEY_PAD;
    float* q_tile = (float*)mla_shared;              // [MLA_ROWS][width]
    float* k_tile = q_tile + MLA_ROWS * width;       // [MLA_KEYS][key_stride]
    float* p_tile = k_tile + MLA_KEYS * key_stride;  // [MLA_WARPS][MLA_KEYS][MLA_ROWS_PER_WARP]
    const int warp = threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    const i64 rows = (i64)n * heads;
    const i64 row0 = (i64)blockIdx.x * MLA_ROWS;
    const int quads = width / 4;  // width % 4 == 0 (checked on the host)
    const int split = blockIdx.z;
    // Rows are token-major, so the block's last row sees the most.
    const i64 block_visible = start + min(row0 + MLA_ROWS - 1, rows - 1) / heads + 1;
    i64 first, end;
    const int used = decode_split_range(0, block_visible, splits, split, MLA_KEYS, &first, &end);
    if (split >= used) return;

    // The block's query rows; rows past the end repeat the last one.
    for (int i = threadIdx.x; i < MLA_ROWS * quads; i += blockDim.x) {
        const i64 row = min(row0 + i / quads, rows - 1);
        ((float4*)q_tile)[i] = ((const float4*)(q_abs + row * width))[i % quads];
    }
    i64 visible[MLA_ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < MLA_ROWS_PER_WARP; ++r)
        visible[r] = start + min(row0 + warp * MLA_ROWS_PER_WARP + r, rows - 1) / heads + 1;

    float running_max[MLA_ROWS_PER_WARP];
    float lane_total[MLA_ROWS_PER_WARP];
    float acc[MLA_ROWS_PER_WARP][MLA_VALUES_PER_LANE];
    start_online_softmax<MLA_ROWS_PER_WARP, MLA_VALUES_PER_LANE>(running_max, lane_total, acc);
    const float* warp_q = q_tile + warp * MLA_ROWS_PER_WARP * width;
    float* warp_p = p_tile + warp * MLA_KEYS * MLA_ROWS_PER_WARP;

    for (i64 j0 = first; j0 < end; j0 += MLA_KEYS) {
        const int tile = (int)min((i64)MLA_KEYS, end - j0);
        __syncthreads();  // the previous tile is no longer read
        for (int i = threadIdx.x; i < MLA_KEYS * quads; i += blockDim.x) {
            const int key = i / quads, quad = i % quads;
            float4 kq = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (key < tile) kq = ((const float4*)(cache + (j0 + key) * width))[quad];
            *(float4*)(k_tile + key * key_stride + 4 * quad) = kq;
        }
        __syncthreads();

        // Lane `lane` scores cached row j0 + lane against each of the
        // warp's rows (attention.cu's helpers, as flash_attend does).
        float score[MLA_ROWS_PER_WARP];
        score_staged_key<MLA_ROWS_PER_WARP>(k_tile + lane * key_stride, warp_q, width, score);
        const i64 j = j0 + lane;
#pragma unroll
        for (int r = 0; r < MLA_ROWS_PER_WARP; ++r)
            score[r] = j < end && j < visible[r] ? score[r] * scale : NEG_INF;
        online_softmax_tile<MLA_ROWS_PER_WARP, MLA_VALUES_PER_LANE>(score, running_max, lane_total,
                                                                    acc, warp_p, lane);
        __syncwarp();
        for (int key = 0; key < tile; ++key) {
            float p[MLA_ROWS_PER_WARP];
#pragma unroll
            for (int r = 0; r < MLA_ROWS_PER_WARP; ++r) p[r] = warp_p[key * MLA_ROWS_PER_WARP + r];
            const float* value = k_tile + key * key_stride;
#pragma unroll
            for (int k = 0; k < MLA_VALUES_PER_LANE; ++k) {
                const int d = lane + k * WARP_SIZE;
                const float v = d < lora ? value[d] : 0.0f;
#pragma unroll
                for (int r = 0; r < MLA_ROWS_PER_WARP; ++r) acc[r][k] = fmaf(p[r], v, acc[r][k]);
            }
        }
        __syncwarp();  // warp_p is rewritten by the next tile
    }

#pragma unroll
    for (int r = 0; r < MLA_ROWS_PER_WARP; ++r) {
        const float total = warp_sum(lane_total[r]);
        const i64 row = row0 + warp * MLA_ROWS_PER_WARP + r;
        if (row >= rows) continue;
        float* o = used == 1 ? out + row * lora : partials + (row * splits + split) * (lora + 2);
        const float inv = used == 1 ? 1.0f / total : 1.0f;
#pragma unroll
        for (int k = 0; k < MLA_VALUES_PER_LANE; ++k) {
            const int d = lane + k * WARP_SIZE;
            if (d < lora) o[d] = acc[r][k] * inv;
        }
        if (used > 1 && lane == 0) {
            o[lora] = running_max[r];
            o[lora + 1] = total;
        }
    }
    if (used > 1 && last_of_splits(tickets + blockIdx.x, used)) {
        merge_split_partials<MLA_ROWS>(partials + row0 * splits * (lora + 2),
                                       (i64)splits * (lora + 2), (int)min((i64)MLA_ROWS, rows - row0),
                                       used, lora, nullptr, out + row0 * lora);
    }
}

// Grid (heads, ceil(n / MLA_OUT_TOKENS)), MLA_OUT_WARPS warps:
//   out[t, h, v] = Σ_c kv_b[h · (nope + v_dim) + nope + v, c] · o_lat[t, h, c],
// each head's value rows applied to its weighted latent (o_lat [n · heads,
// lora], out [n · heads, v_dim]). A warp takes the head's value rows in
// turn, its lanes over the latent (each weight read once per block), for
// the block's tokens, whose latents are staged in shared memory.
extern "C" __global__ void __launch_bounds__(MLA_OUT_WARPS * WARP_SIZE)
    mla_value_out(const float* o_lat, const u8* codes, const u16* scales, const u16* biases,
                  int dtype, float* out, int n, int heads, int lora, int nope, int v_dim) {
    await_inputs();
    __shared__ float staged[MLA_OUT_TOKENS][MLA_VALUES_PER_LANE * WARP_SIZE];
    const int warp = threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    const int h = blockIdx.x;
    const int t0 = blockIdx.y * MLA_OUT_TOKENS;
    const int count = min(MLA_OUT_TOKENS, n - t0);
    for (int i = threadIdx.x; i < count * lora; i += blockDim.x) {
        const int t = i / lora, c = i % lora;
        staged[t][c] = o_lat[((i64)(t0 + t) * heads + h) * lora + c];
    }
    __syncthreads();
    for (int v = warp; v < v_dim; v += MLA_OUT_WARPS) {
        const i64 row = (i64)h * (nope + v_dim) + nope + v;
        float w[MLA_VALUES_PER_LANE];
#pragma unroll
        for (int k = 0; k < MLA_VALUES_PER_LANE; ++k) {
            const int c = lane + k * WARP_SIZE;
            w[k] = c < lora ? dequantize(codes, scales, biases, dtype, row, c, lora) : 0.0f;
        }
        for (int t = 0; t < count; ++t) {
            float dot = 0.0f;
#pragma unroll
            for (int k = 0; k < MLA_VALUES_PER_LANE; ++k) {
                const int c = lane + k * WARP_SIZE;
                if (c < lora) dot = fmaf(w[k], staged[t][c], dot);
            }
            dot = warp_sum(dot);
            if (lane == 0) out[((i64)(t0 + t) * heads + h) * v_dim + v] = dot;
        }
    }
}
