// Routing and the gather/scatter around each routed expert.

// Launch geometry comes from the host: compile.rs passes the constants of
// geometry.rs as -D options, so a launch and its kernel cannot disagree.
#if !defined(ROUTE_THREADS) || !defined(GATE_UP_WARPS) || !defined(DOWN_WARPS) || \
    !defined(MAX_TOP_K) || !defined(CODE_TILE_ROWS)
#error "moe.cu: launch geometry missing (compile.rs passes geometry.rs as -D options)"
#endif
#if CODE_TILE_ROWS != 16
#error "moe.cu: the tensor-core kernels read tiled codes by their 16-row MMA tiles"
#endif

// Per token: softmax over the router logits, the top_k experts (ties to
// the lower index, like the CPU's stable sort) and their probabilities,
// renormalised to sum to one when `normalize`. One block per token;
// dynamic shared memory: one byte per expert (chosen flags).
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
    route(const float* logits, u32* experts, float* weights, int n, int num_experts,
          int top_k, int normalize) {
    await_inputs();
    extern __shared__ u8 chosen[];
    __shared__ float scratch[32];
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    int lane = threadIdx.x % WARP_SIZE;
    int warp = threadIdx.x / WARP_SIZE;
    int warps = blockDim.x / WARP_SIZE;
    const int none = 0x7fffffff;
    for (int t = blockIdx.x; t < n; t += gridDim.x) {
        const float* row = logits + (i64)t * num_experts;
        float max_logit = NEG_INF;
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
            max_logit = fmaxf(max_logit, row[e]);
            chosen[e] = 0;
        }
        max_logit = block_max(max_logit, scratch);
        float total = 0.0f;
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
            total += expf(row[e] - max_logit);
        }
        total = block_sum(total, scratch);  // also orders the chosen[] resets
        u32* out_experts = experts + (i64)t * top_k;
        float* out_weights = weights + (i64)t * top_k;
        for (int k = 0; k < top_k; ++k) {
            float value = NEG_INF;
            int index = none;
            for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
                float v = row[e];
                if (!chosen[e] && (v > value || (v == value && e < index))) {
                    value = v;
                    index = e;
                }
            }
            for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
                float other_value = __shfl_xor_sync(FULL_MASK, value, offset);
                int other_index = __shfl_xor_sync(FULL_MASK, index, offset);
                if (other_value > value || (other_value == value && other_index < index)) {
                    value = other_value;
                    index = other_index;
                }
            }
            if (lane == 0) {
                best_value[warp] = value;
                best_index[warp] = index;
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                for (int w = 1; w < warps; ++w) {
                    if (best_value[w] > value ||
                        (best_value[w] == value && best_index[w] < index)) {
                        value = best_value[w];
                        index = best_index[w];
                    }
                }
                // Only NaN logits leave nothing chosen: take the first free one.
                for (int e = 0; index == none && e < num_experts; ++e) {
                    if (!chosen[e]) index = e;
                }
                chosen[index] = 1;
                out_experts[k] = (u32)index;
                out_weights[k] = expf(row[index] - max_logit) / total;
            }
            __syncthreads();
        }
        if (threadIdx.x == 0 && normalize) {
            float sum = 0.0f;
            for (int k = 0; k < top_k; ++k) sum += out_weights[k];
            float scale = 1.0f / sum;
            for (int k = 0; k < top_k; ++k) out_weights[k] *= scale;
        }
        __syncthreads();
    }
}

// A float's bits as a u32 that orders like the float (-0 taken as +0, so
// equal logits stay equal), and back; no finite or infinite float maps to 0.
__device__ __forceinline__ u32 ordered_key(float v) {
    u32 u = __float_as_uint(v + 0.0f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// `route` for up to 32 · PER_LANE experts, one warp per token, the logits
// in registers (lane l holds experts l, l + 32, ...): no block-wide
// barriers between the top-k rounds, which a decode step cannot hide.
// Same selection rule (ties to the lower index) and weights. Instantiated
// for 4, 8 and 16 experts per lane, so a round scans only what exists.
template <int PER_LANE>
__device__ __forceinline__ void route_in_warp(const float* logits, u32* experts, float* weights,
                                              int n, int num_experts, int top_k,
                                              int normalize) {
    int lane = threadIdx.x % WARP_SIZE;
    i64 t = (i64)blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (t >= n) return;
    const float* row = logits + t * num_experts;
    float v[PER_LANE];
    float max_logit = NEG_INF;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        int e = lane + i * WARP_SIZE;
        v[i] = e < num_experts ? row[e] : NEG_INF;
        max_logit = fmaxf(max_logit, v[i]);
    }
    max_logit = warp_max(max_logit);
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        int e = lane + i * WARP_SIZE;
        if (e < num_experts) total += expf(v[i] - max_logit);
    }
    total = warp_sum(total);
    const int none = 0x7fffffff;
    u32 chosen = 0;  // bit i: expert lane + 32 i is taken
    float sum = 0.0f;
    u32* out_experts = experts + t * top_k;
    float* out_weights = weights + t * top_k;
    for (int k = 0; k < top_k; ++k) {
        float value = NEG_INF;
        int index = none;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            int e = lane + i * WARP_SIZE;
            if (e < num_experts && !(chosen >> i & 1) && (v[i] > value || (v[i] == value && e < index))) {
                value = v[i];
                index = e;
            }
        }
#if __CUDA_ARCH__ >= 800
        // The warp's best in two reductions: the largest logit (as an
        // order-preserving key; 0 is "none"), then the lowest index among
        // the lanes holding it.
        u32 key = index == none ? 0u : ordered_key(value);
        u32 best = __reduce_max_sync(FULL_MASK, key);
        u32 lowest = __reduce_min_sync(FULL_MASK, key == best && best != 0u ? (u32)index : ~0u);
        index = best == 0u ? none : (int)lowest;
        value = best == 0u ? NEG_INF : key_value(best);
#else
        for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
            float other_value = __shfl_xor_sync(FULL_MASK, value, offset);
            int other_index = __shfl_xor_sync(FULL_MASK, index, offset);
            if (other_value > value || (other_value == value && other_index < index)) {
                value = other_value;
                index = other_index;
            }
        }
#endif
        // Only NaN logits leave nothing chosen: take the first free one.
        if (index == none) {
            for (int e = 0; e < num_experts; ++e) {
                int owner_bit = e / WARP_SIZE;
                u32 taken = __shfl_sync(FULL_MASK, chosen, e % WARP_SIZE);
                if (!(taken >> owner_bit & 1)) {
                    index = e;
                    break;
                }
            }
            value = row[index];
        }
        if (index % WARP_SIZE == lane) chosen |= 1u << (index / WARP_SIZE);
        // The winner's logit came with it: no dependent read per round.
        float p = expf(value - max_logit) / total;
        sum += p;
        if (lane == 0) {
            out_experts[k] = (u32)index;
            out_weights[k] = p;
        }
    }
    if (normalize && lane == 0) {
        float scale = 1.0f / sum;
        for (int k = 0; k < top_k; ++k) out_weights[k] *= scale;
    }
}

#define ROUTE_WARP_KERNEL(name, PER_LANE)                                                  \
    extern "C" __global__ void name(const float* logits, u32* experts, float* weights, int n, \
                                    int num_experts, int top_k, int normalize) {             \
        await_inputs();                                                                      \
        route_in_warp<PER_LANE>(logits, experts, weights, n, num_experts, top_k, normalize);  \
    }

ROUTE_WARP_KERNEL(route_warp_4, 4)
ROUTE_WARP_KERNEL(route_warp_8, 8)
ROUTE_WARP_KERNEL(route_warp_16, 16)

// ---- Routers other than the plain softmax ---------------------------
//
// One warp per token, its experts' scores and choices in shared memory
// (as many experts as the block's shared memory holds; routing.rs sizes
// it), following the CPU's `route` (backend/cpu/moe.rs) step for step:
//   1. scores from the logits: a softmax over every expert, each expert's
//      sigmoid, or the logits themselves (SCORE_SOFTMAX_OF_CHOSEN, whose
//      weights are the softmax of the chosen logits);
//   2. the choice: score + `bias` (the correction bias; null: none);
//   3. with `groups` (0: none), the experts fall into that many equal
//      groups, each scored by the sum of its two best choices (its best
//      alone in groups of one), and every group but the `keep_groups`
//      best (ties to the lower group) is masked to -inf;
//   4. top_k by choice, ties to the lower index (masked experts last);
//   5. the chosen experts' scores as weights (softmax of them for
//      SCORE_SOFTMAX_OF_CHOSEN), divided by their sum when `renormalize`
//      (plus 1e-20 for sigmoid scores, as transformers adds), times
//      `scaling`.
// Comparisons are of floats, which equal the CPU's total order for every
// value a router produces (no NaN; no -0, whose sigmoid and softmax are
// positive). Dynamic shared memory: per warp, 3 · num_experts floats
// (scores, choices, group scores) and then num_experts bytes (chosen).

#define SCORE_SOFTMAX 0
#define SCORE_SIGMOID 1
#define SCORE_SOFTMAX_OF_CHOSEN 2

// The top two of the multiset {first, second, other_first, other_second},
// each pair ordered (first ≥ second).
__device__ __forceinline__ void merge_top_two(float* first, float* second, float other_first,
                                              float other_second) {
    if (other_first > *first) {
        *second = fmaxf(*first, other_second);
        *first = other_first;
    } else {
        *second = fmaxf(*second, other_first);
    }
}

extern "C" __global__ void route_general(const float* logits, const float* bias, u32* experts,
                                         float* weights, int n, int num_experts, int top_k,
                                         int score, int groups, int keep_groups,
                                         int renormalize, float scaling) {
    await_inputs();
    extern __shared__ float route_shared[];
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int warps = blockDim.x / WARP_SIZE;
    float* scores = route_shared + (i64)warp * 3 * num_experts;
    float* choice = scores + num_experts;
    float* group_score = choice + num_experts;
    u8* chosen = (u8*)(route_shared + (i64)warps * 3 * num_experts) + (i64)warp * num_experts;
    const i64 t = (i64)blockIdx.x * warps + warp;
    if (t >= n) return;
    const float* row = logits + t * num_experts;

    // 1 and 2.
    float max_logit = NEG_INF, total = 0.0f;
    if (score == SCORE_SOFTMAX) {
        for (int e = lane; e < num_experts; e += WARP_SIZE) max_logit = fmaxf(max_logit, row[e]);
        max_logit = warp_max(max_logit);
        for (int e = lane; e < num_experts; e += WARP_SIZE) total += expf(row[e] - max_logit);
        total = warp_sum(total);
    }
    for (int e = lane; e < num_experts; e += WARP_SIZE) {
        const float x = row[e];
        const float s = score == SCORE_SOFTMAX   ? expf(x - max_logit) / total
                        : score == SCORE_SIGMOID ? 1.0f / (1.0f + expf(-x))
                                                 : x;
        scores[e] = s;
        choice[e] = bias ? s + bias[e] : s;
        chosen[e] = 0;
    }
    __syncwarp();

    // 3.
    if (groups > 0) {
        const int size = num_experts / groups;
        for (int g = 0; g < groups; ++g) {
            float first = NEG_INF, second = NEG_INF;
            for (int i = lane; i < size; i += WARP_SIZE) {
                const float c = choice[g * size + i];
                if (c > first) {
                    second = first;
                    first = c;
                } else if (c > second) {
                    second = c;
                }
            }
            for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
                const float other_first = __shfl_xor_sync(FULL_MASK, first, offset);
                const float other_second = __shfl_xor_sync(FULL_MASK, second, offset);
                merge_top_two(&first, &second, other_first, other_second);
            }
            if (lane == 0) group_score[g] = size < 2 ? first : first + second;
        }
        __syncwarp();
        for (int g = lane; g < groups; g += WARP_SIZE) {
            const float mine = group_score[g];
            int ahead = 0;
            for (int o = 0; o < groups; ++o) {
                const float other = group_score[o];
                ahead += other > mine || (other == mine && o < g);
            }
            if (ahead >= keep_groups)
                for (int i = 0; i < size; ++i) choice[g * size + i] = NEG_INF;
        }
        __syncwarp();
    }

    // 4.
    const int none = 0x7fffffff;
    u32* out_experts = experts + t * top_k;
    float* out_weights = weights + t * top_k;
    for (int k = 0; k < top_k; ++k) {
        float value = NEG_INF;
        int index = none;
        for (int e = lane; e < num_experts; e += WARP_SIZE) {
            const float c = choice[e];
            if (!chosen[e] && (c > value || (c == value && e < index))) {
                value = c;
                index = e;
            }
        }
        for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
            const float other_value = __shfl_xor_sync(FULL_MASK, value, offset);
            const int other_index = __shfl_xor_sync(FULL_MASK, index, offset);
            if (other_value > value || (other_value == value && other_index < index)) {
                value = other_value;
                index = other_index;
            }
        }
        // Only NaN choices leave nothing chosen: take the first free one.
        for (int e = 0; index == none && e < num_experts; ++e) {
            if (!chosen[e]) index = e;
        }
        if (lane == 0) {
            chosen[index] = 1;
            out_experts[k] = (u32)index;
        }
        __syncwarp();
    }

    // 5.
    if (lane == 0) {
        float max_chosen = NEG_INF;
        if (score == SCORE_SOFTMAX_OF_CHOSEN)
            for (int k = 0; k < top_k; ++k) max_chosen = fmaxf(max_chosen, scores[out_experts[k]]);
        float sum = 0.0f;
        for (int k = 0; k < top_k; ++k) {
            float p = scores[out_experts[k]];
            if (score == SCORE_SOFTMAX_OF_CHOSEN) p = expf(p - max_chosen);
            out_weights[k] = p;
            sum += p;
        }
        if (score == SCORE_SOFTMAX_OF_CHOSEN) {
            const float chosen_total = sum;
            sum = 0.0f;
            for (int k = 0; k < top_k; ++k) {
                out_weights[k] /= chosen_total;
                sum += out_weights[k];
            }
        }
        float scale = scaling;
        if (renormalize) scale /= sum + (score == SCORE_SIGMOID ? 1e-20f : 0.0f);
        for (int k = 0; k < top_k; ++k) out_weights[k] *= scale;
    }
}

// One GPU's share of a routing when several divide the experts
// (parallel.rs): `own[e]` is e for the experts this GPU holds and one of
// them (a stand-in) for the others. A slot keeps its expert and weight when
// the GPU holds the expert, else takes the stand-in with weight 0, which
// adds exactly nothing to the weighted sum (its output is finite), so the
// decode kernels run unchanged over the GPU's own address table.
extern "C" __global__ void moe_own_slots(const u32* experts, const float* weights, const u32* own,
                                         u32* own_experts, float* own_weights, int slots) {
    await_inputs();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < slots; i += gridDim.x * blockDim.x) {
        const u32 e = experts[i];
        const u32 mine = own[e];
        own_experts[i] = mine;
        own_weights[i] = mine == e ? weights[i] : 0.0f;
    }
}

// xs[i] = x[slots[i] / top_k]: the rows of the tokens routed to one expert
// (a slot is token · top_k + rank).
extern "C" __global__ void gather_rows(const float* x, const u32* slots, float* xs, int m,
                                       int cols, int top_k) {
    await_inputs();
    i64 total = (i64)m * cols;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (i64)gridDim.x * blockDim.x) {
        i64 row = i / cols;
        int c = (int)(i % cols);
        xs[i] = x[(i64)(slots[row] / top_k) * cols + c];
    }
}

// out[slots[i] / top_k] += weights[slots[i]] · y[i]. A token routes to an
// expert at most once, so no two rows of one launch write the same output.
extern "C" __global__ void scatter_add_rows(float* out, const float* y, const u32* slots,
                                            const float* weights, int m, int cols,
                                            int top_k) {
    await_inputs();
    i64 total = (i64)m * cols;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (i64)gridDim.x * blockDim.x) {
        i64 row = i / cols;
        int c = (int)(i % cols);
        u32 slot = slots[row];
        out[(i64)(slot / top_k) * cols + c] += weights[slot] * y[i];
    }
}

// ---- One token's routed experts, without the host ----------------------
//
// `table[e]` is the device address of expert e's buffer (gate, up and down
// at the same offsets in every expert of a layer), `ids` the token's top_k
// experts from `route`. Every selected expert is resident when these run
// (the host makes sure, or knows the whole layer is), so neither the
// choice of experts nor the cache has to come back to the host.

// Offsets of one matrix of an expert: its codes from the expert's base,
// its scales and biases from its codes; `tiled` (q4 only): its codes are
// stored by tiles of CODE_TILE_ROWS rows (below).
struct ExpertPart {
    i64 offset;
    i64 scales;
    i64 biases;
    i64 tiled;
};

// ---- Tiled q4 expert codes ---------------------------------------------
//
// The tensor-core expert kernels read a 16-row tile a group at a time: a
// warp's load takes 8 bytes of each of the tile's rows. Stored row by row,
// a load touches sectors of eight rows a row apart, and a batch of groups
// spreads over the tile's whole span. A tiled matrix (device_expert.rs
// decides which) is stored by tiles of CODE_TILE_ROWS rows instead, each
// tile's 32 bytes of one group for all its rows together:
//
//   tile t, group k, row i of the tile: t · CODE_TILE_ROWS · row_bytes
//                                       + k · CODE_TILE_ROWS · 32 + i · 32
//
// so a warp's load of one group reads 256 contiguous bytes. Every reader
// of expert codes takes both forms: a row's group k lies at the row's
// address (expert_row) plus k · code_group_step. The scales and biases
// stay row by row. tile_q4_codes makes the form in place after upload.

// Bytes from a row's group of codes to its next group of `part`.
__device__ __forceinline__ int code_group_step(const ExpertPart& part) {
    return code_step(part.tiled);
}

// Row r's first group of codes of a matrix at `codes`, rows `row_bytes`
// long, stored row by row or (tiled) by tiles.
__device__ __forceinline__ const u8* code_row(const u8* codes, i64 r, i64 row_bytes,
                                              bool tiled) {
    if (!tiled) return codes + r * row_bytes;
    const i64 tile = r / CODE_TILE_ROWS;
    return codes + tile * CODE_TILE_ROWS * row_bytes + (r - tile * CODE_TILE_ROWS) * Q4_GROUP_BYTES;
}

// Rewrites the q4 codes at `codes` (gridDim.x tiles of CODE_TILE_ROWS rows
// of `row_bytes` bytes, 16-byte aligned) from row-by-row to tiled, in
// place: a block reads its tile into shared memory (CODE_TILE_ROWS ·
// row_bytes bytes of dynamic shared memory), then writes it back in the
// tiled order.
extern "C" __global__ void tile_q4_codes(u8* codes, int row_bytes) {
    await_inputs();
    extern __shared__ uint4 tile_codes[];
    uint4* tile = (uint4*)(codes + (i64)blockIdx.x * CODE_TILE_ROWS * row_bytes);
    const int pieces = CODE_TILE_ROWS * row_bytes / 16, row_pieces = row_bytes / 16;
    for (int i = threadIdx.x; i < pieces; i += blockDim.x) tile_codes[i] = tile[i];
    __syncthreads();
    // Piece d of the tiled form: group d / (2 · rows), row (d / 2) % rows,
    // half d % 2 of the row's 32 bytes of that group.
    for (int d = threadIdx.x; d < pieces; d += blockDim.x) {
        const int group = d / (2 * CODE_TILE_ROWS), row = (d / 2) % CODE_TILE_ROWS;
        tile[d] = tile_codes[row * row_pieces + 2 * group + d % 2];
    }
}

// What routed experts compute around their products: per-expert biases
// (null: none; gate and up [experts, inter], down [experts, hidden]) and,
// with limit > 0, gpt-oss's clamped SwiGLU g·σ(alpha·g)·(u + 1) of
// g = min(gate, limit), u = clamp(up, -limit, limit); else silu(gate)·up.
struct ExpertFfn {
    const float* gate_bias;
    const float* up_bias;
    const float* down_bias;
    float limit;
    float alpha;
};

// The activation of row r of `expert`'s gate and up products.
__device__ __forceinline__ float expert_act(const ExpertFfn& f, u32 expert, i64 r, int inter,
                                            float g, float u) {
    if (f.gate_bias) {
        g += f.gate_bias[(i64)expert * inter + r];
        u += f.up_bias[(i64)expert * inter + r];
    }
    if (f.limit > 0.0f) {
        g = fminf(g, f.limit);
        u = fminf(fmaxf(u, -f.limit), f.limit);
        return g / (1.0f + expf(-f.alpha * g)) * (u + 1.0f);
    }
    return silu(g) * u;
}

// `expert`'s down bias of output r (0 without biases).
__device__ __forceinline__ float expert_down_bias(const ExpertFfn& f, u32 expert, i64 r,
                                                  int hidden) {
    return f.down_bias ? f.down_bias[(i64)expert * hidden + r] : 0.0f;
}

// act[i, r] = expert_act(gate[i, r], up[i, r]) for m rows of one expert
// (the experts run one at a time).
extern "C" __global__ void expert_act_rows(const float* gate, const float* up, float* act,
                                           i64 m, int inter, u32 expert, ExpertFfn ffn) {
    await_inputs();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < m * inter;
         i += (i64)gridDim.x * blockDim.x) {
        act[i] = expert_act(ffn, expert, i % inter, inter, gate[i], up[i]);
    }
}

// y[i, r] += expert's down bias of r, for m rows (a no-op without biases).
extern "C" __global__ void expert_down_bias_rows(float* y, i64 m, int hidden, u32 expert,
                                                 ExpertFfn ffn) {
    await_inputs();
    if (!ffn.down_bias) return;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < m * hidden;
         i += (i64)gridDim.x * blockDim.x) {
        y[i] += expert_down_bias(ffn, expert, i % hidden, hidden);
    }
}

// Row r of one matrix of the expert at `base`: its first group of codes
// (code_group_step on to the next), its scales and biases.
__device__ __forceinline__ WeightRow expert_row(int dt, unsigned long long base,
                                                ExpertPart part, i64 r, int cols) {
    const u8* codes = (const u8*)base + part.offset;
    WeightRow row = weight_row(dt, codes, (const u16*)(codes + part.scales),
                               (const u16*)(codes + part.biases), r, cols);
    row.codes = code_row(codes, r, row_bytes(dt, cols), part.tiled);
    return row;
}

// GATE_UP_WARPS (geometry.rs): warps per block of moe_gate_up.
// Words in flight and blocks per SM to keep registers for (see linear.cu).
#ifndef GATE_UP_UNROLL
#define GATE_UP_UNROLL WORD_UNROLL
#endif
#ifndef GATE_UP_MIN_BLOCKS
#define GATE_UP_MIN_BLOCKS 1
#endif
#ifndef DOWN_UNROLL
#define DOWN_UNROLL WORD_UNROLL
#endif
#ifndef DOWN_MIN_BLOCKS
#define DOWN_MIN_BLOCKS 1
#endif

// act[k, r] = expert_act(gate_k[r] · x, up_k[r] · x) for expert k = ids[k]
// (experts[k] its id, for the biases).
// The kernel asks L2 for the layer's table of `experts` addresses before
// waiting for the router's ids, which it then looks up.
// Grid: (ceil(inter / GATE_UP_WARPS), top_k); a warp per row pair, whole
// rows (measured a little faster than splitting the columns of a row pair
// across a block).
template <int DT>
__device__ __forceinline__ void moe_gate_up(const unsigned long long* table,
                                                 const u32* ids, const float* x, float* act,
                                                 int inter, int hidden, ExpertPart gate,
                                                 ExpertPart up, ExpertFfn ffn,
                                                 const u32* experts) {
    int warp = threadIdx.x / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    i64 r = (i64)blockIdx.x * GATE_UP_WARPS + warp;
    if (r >= inter) return;
    unsigned long long base = table[ids[blockIdx.y]];
    WeightRow rows[2] = {expert_row(DT, base, gate, r, hidden),
                         expert_row(DT, base, up, r, hidden)};
    float acc[2] = {0.0f, 0.0f};
    const int words = hidden / WORD_COLS(DT);
    if (DT == DT_Q4 && gate.tiled) {
        dot_rows<DT, 2, true, GATE_UP_UNROLL, false, DT == DT_Q4>(rows, &x, 0, words, lane, acc);
    } else {
        dot_rows<DT, 2, true, GATE_UP_UNROLL>(rows, &x, 0, words, lane, acc);
    }
    float g = warp_sum(acc[0]);
    float u = warp_sum(acc[1]);
    if (lane == 0) {
        act[(i64)blockIdx.y * inter + r] = expert_act(ffn, experts[blockIdx.y], r, inter, g, u);
    }
}

// MAX_TOP_K (geometry.rs): most experts a token selects that moe_down takes
// (top_k); DOWN_WARPS: warps per block of moe_down.

// out[r] (+)= Σ_k weights[k] · (down_k[r] · act[k] + its bias), k in order; with
// `accumulate` added to out (the residual stream) instead of stored.
// Grid: hidden blocks; warp w takes experts w, w + DOWN_WARPS, ...
template <int DT>
__device__ __forceinline__ void moe_down(const unsigned long long* table, const u32* ids,
                                         const float* weights, const float* act, float* out,
                                         int hidden, int inter, int top_k, ExpertPart down,
                                         int accumulate, ExpertFfn ffn, const u32* experts) {
    __shared__ float partial[MAX_TOP_K];
    int warp = threadIdx.x / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    i64 r = blockIdx.x;
    int words = inter / WORD_COLS(DT);
    for (int k = warp; k < top_k; k += DOWN_WARPS) {
        WeightRow row = expert_row(DT, table[ids[k]], down, r, inter);
        const float* x = act + (i64)k * inter;
        float acc = 0.0f;
        if (DT == DT_Q4 && down.tiled) {
            dot_rows<DT, 1, true, DOWN_UNROLL, false, DT == DT_Q4>(&row, &x, 0, words, lane, &acc);
        } else {
            dot_rows<DT, 1, true, DOWN_UNROLL>(&row, &x, 0, words, lane, &acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) partial[k] = acc + expert_down_bias(ffn, experts[k], r, hidden);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int k = 0; k < top_k; ++k) total = fmaf(weights[k], partial[k], total);
        out[r] = accumulate ? out[r] + total : total;
    }
}

#define MOE_DECODE_KERNELS(suffix, DT)                                                     \
    extern "C" __global__ void __launch_bounds__(GATE_UP_WARPS * WARP_SIZE,                \
                                                 GATE_UP_MIN_BLOCKS)                       \
        moe_gate_up_##suffix(const unsigned long long* table, const u32* ids,              \
                             const float* x, float* act, int inter, int hidden,            \
                             ExpertPart gate, ExpertPart up, int experts, ExpertFfn ffn,   \
                             const u32* expert_ids) {                                      \
        prefetch_span(table, 8 * (i64)experts);                                            \
        await_inputs();                                                                    \
        moe_gate_up<DT>(table, ids, x, act, inter, hidden, gate, up, ffn, expert_ids);     \
    }                                                                                      \
    extern "C" __global__ void __launch_bounds__(DOWN_WARPS * WARP_SIZE, DOWN_MIN_BLOCKS)  \
        moe_down_##suffix(const unsigned long long* table, const u32* ids,                 \
                          const float* weights, const float* act, float* out, int hidden,  \
                          int inter, int top_k, ExpertPart down, int accumulate,           \
                          ExpertFfn ffn, const u32* expert_ids) {                          \
        await_inputs();                                                                    \
        moe_down<DT>(table, ids, weights, act, out, hidden, inter, top_k, down, accumulate, \
                     ffn, expert_ids);                                                     \
    }

MOE_DECODE_KERNELS(f32, DT_F32)
MOE_DECODE_KERNELS(bf16, DT_BF16)
MOE_DECODE_KERNELS(q8, DT_Q8)
MOE_DECODE_KERNELS(q4, DT_Q4)
MOE_DECODE_KERNELS(q3, DT_Q3)
MOE_DECODE_KERNELS(q2, DT_Q2)
MOE_DECODE_KERNELS(mxfp4, DT_MXFP4)
