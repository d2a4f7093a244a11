//! Launch geometry: the constants that the host's launch configurations
//! and the kernels share, defined here and nowhere else.
//!
//! compile.rs passes every one to NVRTC as `-DNAME=VALUE`; the kernel
//! files define none of them and stop with `#error` when one is missing,
//! so a launch and its kernel cannot disagree. `MOEFLUX_CUDA_DEFINES` may
//! not override them (compile.rs refuses it: the host launches with these
//! values); change them here. tools/nvrtc_check.py reads this file to
//! pass the same options, so every entry stays on one line as
//! `NAME: type = decimal literal;` (the macro accepts literals only).

/// Defines each constant and [`DEFINES`], the list compile.rs passes.
macro_rules! geometry {
    ($($(#[$doc:meta])* $name:ident: $ty:ty = $value:literal;)*) => {
        $($(#[$doc])* pub(super) const $name: $ty = $value;)*

        /// Every constant by its name in the kernels, in declaration order.
        pub(super) const DEFINES: &[(&str, u64)] = &[$((stringify!($name), $name as u64)),*];
    };
}

geometry! {
    // ---- linear.cu
    /// Warps (weight rows) per block of the products of a few tokens
    /// (`linear_*_t1`, `linear_*_t8`).
    LINEAR_WARPS: usize = 4;
    /// Warps per block of the one-token products (`linear_vector_*`).
    VEC_WARPS: usize = 8;
    /// Rows per block of the one-token products that split a row's columns
    /// across the block's warps.
    VEC_ROWS: usize = 4;
    /// Rows per warp of their whole-rows variant (`linear_vector_*_rows`),
    /// whose blocks cover `VEC_WARPS · ROWS_PER_WARP` rows.
    ROWS_PER_WARP: usize = 2;
    /// Matrices one launch of the one-token products covers (the length of
    /// `MatvecJobs`).
    MAX_JOBS: usize = 4;

    // ---- linear_few.cu
    /// Warps (16-row tiles) per block and tokens per pass of the products
    /// of a few tokens on the tensor cores (`linear_few_q4_*`).
    FEW_LINEAR_WARPS: usize = 8;
    FEW_LINEAR_TOKENS: usize = 16;

    // ---- matvec_tc.cu
    /// Lanes of a warp whose B registers hold values in the tensor-core
    /// products (so 4 · 2 · 12 = 96 words of B table per 64 columns).
    TC_B_LANES: usize = 12;
    /// Warps per block of `linear_vector_tc_q4`.
    TC_VECTOR_WARPS: usize = 8;
    /// Warps per selected expert of `moe_down_tc_q4`, and its most warps
    /// per block.
    TC_DOWN_SPLIT: usize = 2;
    TC_DOWN_MAX_WARPS: usize = 16;

    // ---- elementwise.cu
    /// Most words of a table `fill_words` writes from its arguments (the
    /// six cache tables of a decode step of 64 sequences: keys, key
    /// scales, values, value scales, partials, tickets; 3 KiB of kernel
    /// arguments).
    TABLE_WORDS: usize = 384;

    // ---- norm.cu
    /// Most threads per block of the norm kernels (their launch bound).
    NORM_THREADS: u32 = 1024;
    /// Warps (heads) per block of `qk_norm_rope`.
    QK_WARPS: usize = 4;

    // ---- kv_cache.cu
    /// Values of a head row sharing one q8 scale in a KV cache: one warp's
    /// (the kernels quantize a block with a warp reduction); the host's
    /// `kv::Q8_BLOCK`.
    KV_Q8_BLOCK: usize = 32;

    // ---- attention.cu
    /// Warps per block of `attention` (a block per token and head).
    ATTN_WARPS: usize = 4;
    /// Values per lane of `attention`'s head (head dimensions up to
    /// `ATTN_MAX_PER_LANE · 32`).
    ATTN_MAX_PER_LANE: usize = 16;
    /// Warps per block of the one-token attention kernels.
    DECODE_ATTN_WARPS: usize = 16;
    /// Warps per block of the one-token attention kernels that take a KV
    /// head's whole group of query heads (`attention_decode_grouped_*`).
    GD_WARPS: usize = 8;
    /// Most blocks a head's positions are split over by the one-token
    /// kernels (flash-decoding; a KV cache's `partials` are sized for it,
    /// and their merge takes a lane per split, so at most 32). The kernels
    /// take the number in use as an argument.
    DECODE_ATTN_MAX_SPLITS: usize = 32;
    /// Warps, query rows per warp (the tensor-core MMA's 16), keys per
    /// staged tile and the words of padding after a staged row (making
    /// its stride ≡ 8 mod 16 words) of the prefill attention kernels
    /// (`flash_attention_*`).
    FA_WARPS: usize = 4;
    FA_ROWS_PER_WARP: usize = 16;
    FA_KEYS: usize = 32;
    FA_WORD_PAD: usize = 8;

    // ---- mla.cu
    /// Threads per block, each its `MLA_ABSORB_COLUMNS` latent columns, and
    /// tokens per block of `mla_absorb_query` (latents up to
    /// `MLA_ABSORB_THREADS · MLA_ABSORB_COLUMNS` wide); the widest
    /// non-rotary query part it stages.
    MLA_ABSORB_THREADS: u32 = 128;
    MLA_ABSORB_COLUMNS: usize = 4;
    MLA_ABSORB_TOKENS: usize = 16;
    MLA_MAX_NOPE: usize = 256;
    /// Warps, query rows per warp, keys per staged tile (one per lane) and
    /// the padding of a staged row of `mla_attention`, and latent values
    /// per lane of it and of `mla_value_out` (latents up to
    /// `32 · MLA_VALUES_PER_LANE` wide).
    MLA_WARPS: usize = 4;
    MLA_ROWS_PER_WARP: usize = 4;
    MLA_KEYS: usize = 32;
    MLA_KEY_PAD: usize = 4;
    MLA_VALUES_PER_LANE: usize = 16;
    /// Warps (value rows in turn) and tokens per block of `mla_value_out`.
    MLA_OUT_WARPS: usize = 8;
    MLA_OUT_TOKENS: usize = 16;

    // ---- gated_delta_net.cu
    /// Warps (value columns) per block of `gdn_recurrence`, and the key
    /// rows each lane holds (key head dimensions up to `32 · GDN_LANE_ROWS`).
    GDN_WARPS: usize = 16;
    GDN_LANE_ROWS: usize = 8;

    // ---- gdn_chunked.cu
    /// Tokens per chunk, threads per block, the largest head dimension and
    /// the state columns per block of the chunked delta rule.
    GDN_CHUNK: usize = 64;
    GDN_CHUNK_THREADS: u32 = 256;
    GDN_MAX_DIM: usize = 128;
    GDN_STATE_COLS: usize = 32;

    // ---- gemm.cu
    /// Weight rows and tokens per block, and threads per block, of the
    /// tensor-core products (`linear_tc_*`).
    GEMM_BM: usize = 128;
    GEMM_BN: usize = 64;
    GEMM_THREADS: u32 = 256;
    /// Stages in flight in the q4 products of int8 activations (gemm.cu's
    /// and the routed experts'), and the bytes of one of gemm.cu's
    /// (`I8Stage` of 128 rows and 64 tokens; the kernel checks the size).
    I8_STAGES: usize = 4;
    GEMM_I8_STAGE_BYTES: usize = 10240;

    // ---- moe.cu
    /// Threads per block of `route` (one block per token, more than 512
    /// experts).
    ROUTE_THREADS: u32 = 256;
    /// Rows of a tile of tiled q4 expert codes (moe.cu, device_expert.rs):
    /// the tensor-core kernels' 16-row MMA tiles, not a tunable.
    CODE_TILE_ROWS: usize = 16;
    /// Warps (rows) per block of one token's expert gate/up kernels.
    GATE_UP_WARPS: usize = 8;
    /// Warps per block of one token's expert down kernels.
    DOWN_WARPS: usize = 8;
    /// Most experts per token one token's expert kernels take.
    MAX_TOP_K: usize = 32;

    // ---- moe_prefill.cu
    /// Weight rows a block keeps in shared memory (128 rows of down, or 64
    /// rows of gate and the same 64 of up), slots per tile, and threads per
    /// block of the routed experts of many tokens.
    MP_BM: usize = 128;
    MP_BN: usize = 32;
    MP_THREADS: u32 = 128;
    /// Stages in flight in the q4 kernels, and the bytes of one
    /// (`MoeQ4Stage`: 128 rows of 48 bytes of codes, 32 slots' hi and lo
    /// rows of 72 bf16, 128 scales and biases and 32 sums as f32; the
    /// kernel checks the size).
    MP_STAGES: usize = 3;
    MP_Q4_STAGE_BYTES: usize = 16512;
    /// Bytes of a stage of the routed experts' q4 kernels of int8
    /// activations (gemm.cu's `I8Stage` of 128 rows and 32 slots: 32 bytes
    /// of codes a row, 64 int8 activations and four f32 params a slot, a
    /// scale and a bias a row as f32; the kernel checks the size).
    MP_I8_STAGE_BYTES: usize = 7680;

    // ---- moe_few.cu
    /// Threads of the one block that groups a call's slots by expert.
    GROUP_THREADS: u32 = 512;
    /// Warps per block of the routed experts of a few tokens per expert
    /// (each a 16-row tile), most slots per tile (two MMA column tiles of
    /// four tokens), and the 16-row tiles each warp of their down takes.
    FEW_WARPS: usize = 8;
    FEW_SLOTS: usize = 8;
    FEW_DOWN_TILES: usize = 2;
}
