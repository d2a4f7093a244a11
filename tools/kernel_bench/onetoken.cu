// Times the one-token (decode) product kernels of the CUDA backend on the
// shapes of the qwen3-30b-a3b (and qwen3-next-80b-a3b experts) decode step:
// linear.cu's linear_vector (columns split across a block's warps) and
// linear_vector_rows, moe.cu's moe_gate_up and moe_down, and matvec_tc.cu's
// moe_down_tc_q4, next to load-only probes over the same rows (what memory
// alone allows) and the device-to-device copy bandwidth. Weights do not
// stay in L2: each launch of a recorded graph takes another copy of the
// matrix, or other experts; the dense products are also timed on one copy
// (weights in L2), what prefetching them ahead could at best give. The
// tensor-core down is checked against moe_down.
//
// On the GPU machine (it has nvcc), from the repository root:
//   bash tools/kernel_bench/run.sh ["-DWORD_UNROLL=2" ...]
// (one build and run per quoted set of -D options; none: the defaults).
// POOL_MB (default 400) sets the bytes of copies each dense shape cycles
// through.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "../../crates/moeflux/src/backend/cuda/kernels/common.cuh"
#include "../../crates/moeflux/src/backend/cuda/kernels/linear.cu"
#include "../../crates/moeflux/src/backend/cuda/kernels/moe.cu"
#include "../../crates/moeflux/src/backend/cuda/kernels/gemm.cu"
#include "../../crates/moeflux/src/backend/cuda/kernels/matvec_tc.cu"

// Load-only probes: the rows kernel's access pattern (2 rows per warp,
// U words of 4 bytes per lane in flight) with a XOR instead of the dot, and
// the same with 16-byte loads per lane.
template <int U, int W>
__global__ void __launch_bounds__(256) probe_rows(const u8* codes, int rows, int cols, u32* out) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    i64 r0 = ((i64)blockIdx.x * 8 + warp) * 2;
    if (r0 >= rows) return;
    i64 rb = cols / 2;
    const u8* a = codes + r0 * rb;
    const u8* b = codes + (r0 + 1) * rb;
    u32 acc = 0;
    int words = rb / (4 * W);
    for (int base = lane; base < words; base += U * 32) {
        u32 v[U][2][W];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int w = base + u * 32;
            if (w < words) {
                if (W == 1) {
                    v[u][0][0] = load_streaming(a + 4 * (i64)w);
                    v[u][1][0] = load_streaming(b + 4 * (i64)w);
                } else {
                    uint4 x = *(const uint4*)(a + 16 * (i64)w);
                    uint4 y = *(const uint4*)(b + 16 * (i64)w);
                    v[u][0][0] = x.x ^ x.y ^ x.z ^ x.w;
                    v[u][1][0] = y.x ^ y.y ^ y.z ^ y.w;
                }
            } else {
                v[u][0][0] = v[u][1][0] = 0;
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u][0][0] ^ v[u][1][0];
    }
    if (acc == 0x12345678u) out[0] = acc;
}

#define CHECK(call)                                                                     \
    do {                                                                                \
        cudaError_t e = (call);                                                         \
        if (e != cudaSuccess) {                                                         \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,                \
                    cudaGetErrorString(e));                                             \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

__global__ void fill_random(u32* p, i64 words, u32 seed) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < words;
         i += (i64)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        p[i] = h;
    }
}

// A value in [lo, hi) hashed from index i and the seed.
__device__ float hashed_value(i64 i, float lo, float hi, u32 seed) {
    u32 h = (u32)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    return lo + (hi - lo) * (float)(h >> 8) / 16777216.0f;
}

// bf16 values in [lo, hi).
__global__ void fill_bf16(u16* p, i64 n, float lo, float hi, u32 seed) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        p[i] = (u16)(__float_as_uint(hashed_value(i, lo, hi, seed)) >> 16);
    }
}

__global__ void fill_float(float* p, i64 n, float lo, float hi, u32 seed) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        p[i] = hashed_value(i, lo, hi, seed);
    }
}

static u32 seed = 1;

// One stored matrix: codes, then scales, then biases.
struct Mat {
    u8* codes;
    u16* scales;
    u16* biases;
    int rows, cols, dt;
    i64 bytes() const {
        i64 g = (i64)rows * (cols / GROUP_SIZE);
        return (i64)rows * (dt == DT_Q4 ? cols / 2 : cols) + 4 * g;
    }
};

static void fill_mat(u8* base, int rows, int cols, int dt, Mat* m) {
    i64 code_bytes = (i64)rows * (dt == DT_Q4 ? cols / 2 : cols);
    i64 groups = (i64)rows * (cols / GROUP_SIZE);
    m->codes = base;
    m->scales = (u16*)(base + code_bytes);
    m->biases = m->scales + groups;
    m->rows = rows;
    m->cols = cols;
    m->dt = dt;
    fill_random<<<1024, 256>>>((u32*)base, code_bytes / 4, seed++);
    float top = dt == DT_Q4 ? 15.0f : 255.0f;
    fill_bf16<<<1024, 256>>>(m->scales, groups, 0.02f / top, 0.06f / top, seed++);
    fill_bf16<<<1024, 256>>>(m->biases, groups, -0.04f, -0.01f, seed++);
}

static std::vector<Mat> make_copies(int rows, int cols, int dt, i64 min_total) {
    Mat probe = {nullptr, nullptr, nullptr, rows, cols, dt};
    int copies = (int)std::max<i64>(2, (min_total + probe.bytes() - 1) / probe.bytes());
    std::vector<Mat> out(copies);
    for (auto& m : out) {
        u8* p;
        CHECK(cudaMalloc(&p, probe.bytes()));
        fill_mat(p, rows, cols, dt, &m);
    }
    return out;
}

// Microseconds per launch: a graph of `launches` calls of launch(i),
// replayed; the best of five replays.
static double time_launches(int launches, const std::function<void(cudaStream_t, int)>& launch) {
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < launches; ++i) launch(s, i);
    CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, g, 0));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
        CHECK(cudaEventRecord(a, s));
        CHECK(cudaGraphLaunch(exec, s));
        CHECK(cudaEventRecord(b, s));
        CHECK(cudaEventSynchronize(b));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        best = std::min(best, 1e3 * ms / launches);
    }
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaStreamDestroy(s));
    return best;
}

static std::vector<float> download(const float* p, int n) {
    std::vector<float> h(n);
    CHECK(cudaMemcpy(h.data(), p, 4 * (size_t)n, cudaMemcpyDeviceToHost));
    return h;
}

// Largest |a - b| over the largest |a|.
static double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
    double d = 0, m = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        d = std::max(d, (double)std::fabs(a[i] - b[i]));
        m = std::max(m, (double)std::fabs(a[i]));
    }
    return d / std::max(m, 1e-30);
}

static void report(const char* what, double us, double bytes) {
    printf("  %-34s %8.2f us  %7.1f GB/s\n", what, us, bytes / us / 1e3);
}

// Dense products of one token: `parts` matrices sharing x, as one launch.
static void bench_dense(const char* name, std::vector<std::pair<int, int>> parts, int dt,
                        int accumulate) {
    const i64 pool = (getenv("POOL_MB") ? atoll(getenv("POOL_MB")) : 400ll) << 20;
    std::vector<std::vector<Mat>> mats;
    i64 bytes = 0;
    int cols = parts[0].second, total_rows = 0;
    for (auto [r, c] : parts) {
        mats.push_back(make_copies(r, c, dt, pool / (i64)parts.size()));
        bytes += mats.back()[0].bytes();
        total_rows += r;
    }
    int copies = (int)mats[0].size();
    for (auto& m : mats) copies = std::min(copies, (int)m.size());
    float *x, *out_old;
    CHECK(cudaMalloc(&x, 4 * (size_t)cols));
    CHECK(cudaMalloc(&out_old, 4 * (size_t)total_rows));
    fill_float<<<64, 256>>>(x, cols, -1.0f, 1.0f, seed++);
    auto jobs_for = [&](int copy, int rows_per_block, float* out) {
        MatvecJobs j = {};
        j.count = (int)parts.size();
        int blocks = 0, row0 = 0;
        for (size_t p = 0; p < parts.size(); ++p) {
            const Mat& m = mats[p][copy];
            j.job[p] = {m.codes, m.scales, m.biases, out + row0, m.rows, blocks};
            blocks += (m.rows + rows_per_block - 1) / rows_per_block;
            row0 += m.rows;
        }
        return std::make_pair(j, blocks);
    };
    auto k_split = dt == DT_Q4 ? linear_vector_q4 : linear_vector_q8;
    auto k_rows = dt == DT_Q4 ? linear_vector_q4_rows : linear_vector_q8_rows;
    printf("%s: %d rows x %d cols, %s, %.2f MiB per launch, %d copies\n", name, total_rows,
           cols, dt == DT_Q4 ? "q4" : "q8", bytes / 1048576.0, copies);
    auto launch_split = [&](cudaStream_t s, int i, float* out) {
        auto [j, blocks] = jobs_for(i % copies, VEC_ROWS, out);
        k_split<<<blocks, VEC_WARPS * 32, 0, s>>>(j, x, cols, accumulate);
    };
    auto launch_rows = [&](cudaStream_t s, int i, float* out) {
        auto [j, blocks] = jobs_for(i % copies, VEC_WARPS * ROWS_PER_WARP, out);
        k_rows<<<blocks, VEC_WARPS * 32, 0, s>>>(j, x, cols, accumulate);
    };
    const int launches = 200;
    report("linear_vector (columns split)",
           time_launches(launches, [&](cudaStream_t s, int i) { launch_split(s, i, out_old); }),
           bytes);
    report("linear_vector_rows",
           time_launches(launches, [&](cudaStream_t s, int i) { launch_rows(s, i, out_old); }),
           bytes);
    report("linear_vector_rows, weights in L2",
           time_launches(launches, [&](cudaStream_t s, int) { launch_rows(s, 0, out_old); }),
           bytes);
    report("linear_vector, weights in L2",
           time_launches(launches, [&](cudaStream_t s, int) { launch_split(s, 0, out_old); }),
           bytes);
    if (parts.size() == 1 && dt == DT_Q4 && parts[0].first >= 65536) {
        // The tensor-core product for matrices of many rows, checked
        // against linear_vector_rows.
        int groups = cols / 64;
        int smem = 4 * (groups * 96 + groups + (groups & 1));
        float* out_tc;
        CHECK(cudaMalloc(&out_tc, 4 * (size_t)total_rows));
        int sms = 0;
        CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        for (int per_sm : {1, 2, 4}) {
            auto launch_tc = [&](cudaStream_t s, int i, float* out) {
                const Mat& m = mats[0][i % copies];
                linear_vector_tc_q4<<<sms * per_sm, TC_VECTOR_WARPS * 32, smem, s>>>(
                    m.codes, m.scales, m.biases, x, out, m.rows, cols);
            };
            launch_tc(0, 0, out_tc);
            launch_rows(0, 0, out_old);
            CHECK(cudaDeviceSynchronize());
            printf("  linear_vector_tc_q4 (%d blocks per SM) vs rows: max diff / max |out| = %.2e\n",
                   per_sm, rel_diff(download(out_old, total_rows), download(out_tc, total_rows)));
            report("linear_vector_tc_q4", time_launches(launches, [&](cudaStream_t s, int i) {
                launch_tc(s, i, out_tc); }), bytes);
        }
        CHECK(cudaFree(out_tc));
    }
    if (parts.size() == 1 && dt == DT_Q4) {
        u32* sink;
        CHECK(cudaMalloc(&sink, 4));
        int rows = parts[0].first;
        int blocks = (rows + 15) / 16;
        report("probe: 4-byte loads, U=4", time_launches(launches, [&](cudaStream_t s, int i) {
            probe_rows<4, 1><<<blocks, 256, 0, s>>>(mats[0][i % copies].codes, rows, cols, sink); }), bytes);
        report("probe: 4-byte loads, U=8", time_launches(launches, [&](cudaStream_t s, int i) {
            probe_rows<8, 1><<<blocks, 256, 0, s>>>(mats[0][i % copies].codes, rows, cols, sink); }), bytes);
        report("probe: 16-byte loads, U=1", time_launches(launches, [&](cudaStream_t s, int i) {
            probe_rows<1, 4><<<blocks, 256, 0, s>>>(mats[0][i % copies].codes, rows, cols, sink); }), bytes);
        report("probe: 16-byte loads, U=2", time_launches(launches, [&](cudaStream_t s, int i) {
            probe_rows<2, 4><<<blocks, 256, 0, s>>>(mats[0][i % copies].codes, rows, cols, sink); }), bytes);
    }
    for (auto& v : mats)
        for (auto& m : v) CHECK(cudaFree(m.codes));
    CHECK(cudaFree(x));
    CHECK(cudaFree(out_old));
}

// A layer's routed experts, as moeflux stores them on the device: per
// expert one buffer with gate, up and down, each codes then scales then
// biases.
static void bench_experts(int num_experts, int top_k, int hidden, int inter) {
    const int dt = DT_Q4;
    Mat g = {nullptr, nullptr, nullptr, inter, hidden, dt};
    Mat d = {nullptr, nullptr, nullptr, hidden, inter, dt};
    i64 gate_bytes = g.bytes(), down_bytes = d.bytes();
    i64 expert_bytes = 2 * gate_bytes + down_bytes;
    std::vector<unsigned long long> table(num_experts);
    for (int e = 0; e < num_experts; ++e) {
        u8* p;
        CHECK(cudaMalloc(&p, expert_bytes));
        Mat m;
        fill_mat(p, inter, hidden, dt, &m);
        fill_mat(p + gate_bytes, inter, hidden, dt, &m);
        fill_mat(p + 2 * gate_bytes, hidden, inter, dt, &m);
        table[e] = (unsigned long long)p;
    }
    i64 gate_codes = (i64)inter * hidden / 2, down_codes = (i64)hidden * inter / 2;
    i64 gate_groups = (i64)inter * (hidden / GROUP_SIZE), down_groups = (i64)hidden * (inter / GROUP_SIZE);
    ExpertPart gate = {0, gate_codes, gate_codes + 2 * gate_groups};
    ExpertPart up = {gate_bytes, gate_codes, gate_codes + 2 * gate_groups};
    ExpertPart down = {2 * gate_bytes, down_codes, down_codes + 2 * down_groups};
    const int launches = 200;
    // Distinct random experts per launch.
    std::vector<u32> ids(launches * top_k);
    srand(7);
    for (int l = 0; l < launches; ++l) {
        for (int k = 0; k < top_k; ++k) {
            u32 e;
            bool again;
            do {
                e = rand() % num_experts;
                again = false;
                for (int j = 0; j < k; ++j) again |= ids[l * top_k + j] == e;
            } while (again);
            ids[l * top_k + k] = e;
        }
    }
    unsigned long long* d_table;
    u32* d_ids;
    float *x, *act_old, *weights, *out_old, *out_new;
    CHECK(cudaMalloc(&d_table, 8 * (size_t)num_experts));
    CHECK(cudaMemcpy(d_table, table.data(), 8 * (size_t)num_experts, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&d_ids, 4 * ids.size()));
    CHECK(cudaMemcpy(d_ids, ids.data(), 4 * ids.size(), cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&x, 4 * (size_t)hidden));
    CHECK(cudaMalloc(&act_old, 4 * (size_t)top_k * inter));
    CHECK(cudaMalloc(&weights, 4 * (size_t)top_k));
    CHECK(cudaMalloc(&out_old, 4 * (size_t)hidden));
    CHECK(cudaMalloc(&out_new, 4 * (size_t)hidden));
    fill_float<<<64, 256>>>(x, hidden, -1.0f, 1.0f, seed++);
    fill_float<<<64, 256>>>(weights, top_k, 0.05f, 0.2f, seed++);
    auto old_gu = [&](cudaStream_t s, int i) {
        moe_gate_up_q4<<<dim3((inter + GATE_UP_WARPS - 1) / GATE_UP_WARPS, top_k),
                         GATE_UP_WARPS * 32, 0, s>>>(d_table, d_ids + i * top_k, x, act_old,
                                                     inter, hidden, gate, up, num_experts);
    };
    auto old_down = [&](cudaStream_t s, int i) {
        moe_down_q4<<<hidden, DOWN_WARPS * 32, 0, s>>>(d_table, d_ids + i * top_k, weights,
                                                        act_old, out_old, hidden, inter, top_k,
                                                        down, 0);
    };
    // matvec_tc.cu's launch: TC_DOWN_SPLIT warps per expert, at most
    // TC_DOWN_MAX_WARPS; shared memory as experts.rs's down_tc_shared_bytes.
    int groups = inter / 64;
    int smem_tc_down =
        4 * (top_k * (groups * 96 + groups + (groups & 1)) + 16 * top_k * TC_DOWN_SPLIT);
    CHECK(cudaFuncSetAttribute(moe_down_tc_q4, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               smem_tc_down));
    int tc_warps = std::min(top_k * TC_DOWN_SPLIT, TC_DOWN_MAX_WARPS);
    auto tc_down = [&](cudaStream_t s, int i) {
        moe_down_tc_q4<<<(hidden + 15) / 16, tc_warps * 32, smem_tc_down, s>>>(
            d_table, d_ids + i * top_k, weights, act_old, out_new, hidden, inter, top_k, down, 0);
    };
    printf("experts: %d of %d, hidden %d, inter %d, q4; gate+up %.2f MiB, down %.2f MiB per launch\n",
           top_k, num_experts, hidden, inter, top_k * 2 * gate_bytes / 1048576.0,
           top_k * down_bytes / 1048576.0);
    old_gu(0, 0);
    old_down(0, 0);
    tc_down(0, 0);
    CHECK(cudaDeviceSynchronize());
    printf("  moe_down_tc vs moe_down: max diff / max |out| = %.2e\n",
           rel_diff(download(out_old, hidden), download(out_new, hidden)));
    report("moe_gate_up", time_launches(launches, old_gu), top_k * 2.0 * gate_bytes);
    report("moe_down", time_launches(launches, old_down), top_k * (double)down_bytes);
    report("moe_down_tc (tensor cores)", time_launches(launches, tc_down), top_k * (double)down_bytes);
    for (auto p : table) CHECK(cudaFree((void*)p));
}

static void print_regs(const char* name, const void* f) {
    cudaFuncAttributes a;
    CHECK(cudaFuncGetAttributes(&a, f));
    printf("  %-26s %3d registers, %zu bytes local\n", name, a.numRegs, a.localSizeBytes);
}

int main() {
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
    print_regs("linear_vector_q4", (const void*)linear_vector_q4);
    print_regs("linear_vector_q4_rows", (const void*)linear_vector_q4_rows);
    print_regs("moe_gate_up_q4", (const void*)moe_gate_up_q4);
    print_regs("moe_down_q4", (const void*)moe_down_q4);
    print_regs("moe_down_tc_q4", (const void*)moe_down_tc_q4);
    {
        // Device copy bandwidth: the ceiling.
        size_t n = 1ull << 30;
        void *a, *b;
        CHECK(cudaMalloc(&a, n));
        CHECK(cudaMalloc(&b, n));
        CHECK(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
        cudaEvent_t e0, e1;
        CHECK(cudaEventCreate(&e0));
        CHECK(cudaEventCreate(&e1));
        CHECK(cudaEventRecord(e0));
        for (int i = 0; i < 5; ++i) CHECK(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        printf("device copy: %.0f GB/s (read + write)\n", 2.0 * 5 * n / (ms * 1e-3) / 1e9);
        CHECK(cudaFree(a));
        CHECK(cudaFree(b));
    }
    bench_dense("q, k, v (30B)", {{4096, 2048}, {512, 2048}, {512, 2048}}, DT_Q4, 0);
    bench_dense("o_proj (30B)", {{2048, 4096}}, DT_Q4, 1);
    bench_dense("router (30B, q8)", {{128, 2048}}, DT_Q8, 0);
    bench_dense("LM head (30B)", {{151936, 2048}}, DT_Q4, 0);
    bench_experts(128, 8, 2048, 768);
    bench_experts(512, 10, 2048, 512);
    // The LM head's shape as one expert's down: the tensor-core down kernel on a large matrix.
    bench_experts(1, 1, 151936, 2048);
    CHECK(cudaGetLastError());
    return 0;
}
