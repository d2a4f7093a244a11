// Elementwise operations, column copies and rotary embeddings; every
// kernel loops grid-stride over its elements.

// TABLE_WORDS: the most words of a table written by fill_words.
// Launch geometry comes from the host: compile.rs passes the constants of
// geometry.rs as -D options, so a launch and its kernel cannot disagree.
#if !defined(TABLE_WORDS)
#error "elementwise.cu: launch geometry missing (compile.rs passes geometry.rs as -D options)"
#endif

#define GRID_STRIDE(i, total)                                                  \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (total);      \
         i += (i64)gridDim.x * blockDim.x)

extern "C" __global__ void add_assign(float* x, const float* y, i64 n) {
    await_inputs();
    GRID_STRIDE(i, n) { x[i] += y[i]; }
}

// x[r, c] += bias[c]: a projection's bias on every row.
extern "C" __global__ void add_bias(float* x, const float* bias, i64 rows, int cols) {
    await_inputs();
    GRID_STRIDE(i, rows * cols) { x[i] += bias[i % cols]; }
}

// out = silu(gate) · up
extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, i64 n) {
    await_inputs();
    GRID_STRIDE(i, n) { out[i] = silu(gate[i]) * up[i]; }
}

// x *= sigmoid(gate), elementwise.
extern "C" __global__ void mul_sigmoid(float* x, const float* gate, i64 n) {
    await_inputs();
    GRID_STRIDE(i, n) { x[i] *= sigmoid(gate[i]); }
}

// x[r, c] *= sigmoid(gate[r]): one gate per row.
extern "C" __global__ void mul_sigmoid_rows(float* x, const float* gate, i64 rows, int cols) {
    await_inputs();
    GRID_STRIDE(i, rows * cols) { x[i] *= sigmoid(gate[i / cols]); }
}

// dst[r, c] = src[r, start + c] for c < width.
extern "C" __global__ void copy_cols(const float* src, float* dst, i64 rows, int src_cols,
                                     int start, int width) {
    await_inputs();
    GRID_STRIDE(i, rows * width) {
        i64 r = i / width;
        int c = (int)(i % width);
        dst[i] = src[r * src_cols + start + c];
    }
}

// Rotates the first 2·half features of each head_dim group of every row,
// row t at position start_pos + t, the halves against each other (NeoX);
// inv_freq holds the half frequencies, computed in f32 on the host exactly
// as the CPU backend computes them; cos and sin are multiplied by `scale`
// (YaRN's attention factor, else 1). `start_pos` from `position` on the
// device when given (a recorded step).
extern "C" __global__ void rope(float* x, const float* inv_freq, i64 rows, int cols,
                                int head_dim, int half, i64 start_pos, float scale,
                                const u32* position) {
    await_inputs();
    if (position) start_pos = *position;
    int heads = cols / head_dim;
    GRID_STRIDE(i, rows * heads * half) {
        i64 t = i / ((i64)heads * half);
        int rest = (int)(i % ((i64)heads * half));
        int h = rest / half;
        int k = rest % half;
        float angle = (float)(start_pos + t) * inv_freq[k];
        float c = cosf(angle) * scale;
        float s = sinf(angle) * scale;
        float* head = x + t * cols + (i64)h * head_dim;
        float x1 = head[k];
        float x2 = head[k + half];
        head[k] = x1 * c - x2 * s;
        head[k + half] = x2 * c + x1 * s;
    }
}

// A small table passed by value (device addresses of the caches of a
// decode step of several sequences): a recorded step writes it again at
// every replay from its own launch arguments, with no host memory.
struct TableWords {
    u64 value[TABLE_WORDS];
};

// dst[i] = words.value[i] for i < n (n ≤ TABLE_WORDS). One block.
extern "C" __global__ void fill_words(u64* dst, TableWords words, int n) {
    await_inputs();
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = words.value[i];
}
