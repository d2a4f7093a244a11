//! The backends' conformance suite (common/ops.rs) on the CPU backend:
//! each SIMD kernel set this machine runs against the scalar reference,
//! with f32 activations (every operation, the batched and device-failure
//! checks) and with int8 activations (the operations they change, with
//! their bound, and the batched check). A set this machine lacks says
//! "skipped". The CUDA backend runs the same suite in tests/cuda.rs.

mod common;

use common::backends::cpu;
use common::ops::{Activations, backend_tests};

backend_tests!(cpu_scalar, || cpu("scalar", Activations::F32));
backend_tests!(cpu_avx2, || cpu("avx2", Activations::F32));
backend_tests!(cpu_avx512, || cpu("avx512", Activations::F32));
backend_tests!(cpu_neon, || cpu("neon", Activations::F32));

backend_tests!(int8 cpu_scalar_int8, || cpu("scalar", Activations::Int8));
backend_tests!(int8 cpu_avx2_int8, || cpu("avx2", Activations::Int8));
backend_tests!(int8 cpu_avx512_int8, || cpu("avx512", Activations::Int8));
backend_tests!(int8 cpu_neon_int8, || cpu("neon", Activations::Int8));
