//! The backends the conformance suite ([`super::ops`]) runs on: a
//! constructor per backend, `None` where this machine lacks it, and the
//! little each backend type must offer the suite beyond [`Backend`].

use moeflux::backend::Backend;
use moeflux::backend::cpu::{Activations, CpuBackend, CpuOptions, KernelSet};
use moeflux::backend::cuda::{CudaBackend, CudaOptions, device_count};

/// What the suite needs of a backend type beyond [`Backend`]: putting host
/// data on it, reading a routing's weights back, and the bound of its
/// model-level checks.
pub trait Conformance: Backend {
    /// A `[rows, cols]` tensor holding `data`.
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Self::Tensor;

    /// A routing's weights, every token's in order, on the host.
    fn routing_weights(&self, routing: &Self::Routing) -> Vec<f32>;

    /// Runs `f` as the engine runs a decode step it records (on CUDA,
    /// routed experts of few tokens grouped on the device).
    fn as_engine_step<R>(&self, f: impl FnOnce() -> R) -> R {
        f()
    }

    /// Bound on the relative L2 error of any row of logits of sequences
    /// run batched against each run alone (`common::batch`).
    const BATCHED_BOUND: f64;
}

impl Conformance for CpuBackend {
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Self::Tensor {
        moeflux::backend::cpu::Tensor::new(rows, cols, data.to_vec())
    }

    fn routing_weights(&self, routing: &Self::Routing) -> Vec<f32> {
        routing.weights.clone()
    }

    const BATCHED_BOUND: f64 = 1e-5;
}

impl Conformance for CudaBackend {
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Self::Tensor {
        self.tensor_from_host(rows, cols, data)
            .expect("a tensor uploaded")
    }

    fn routing_weights(&self, routing: &Self::Routing) -> Vec<f32> {
        routing
            .weights_to_host()
            .expect("routing weights downloaded")
    }

    fn as_engine_step<R>(&self, f: impl FnOnce() -> R) -> R {
        CudaBackend::as_engine_step(self, f)
    }

    /// A batch of several decode tokens runs the many-row kernels a lone
    /// decode token does not: the bound of prefill against decode.
    const BATCHED_BOUND: f64 = 1e-4;
}

/// The reference every backend is compared with: the CPU backend with its
/// portable scalar kernels and f32 activations.
pub fn reference() -> CpuBackend {
    CpuBackend::default().with_kernels(KernelSet::scalar())
}

/// The CPU backend with the kernel set called `kernels` and the given
/// activations; `None` where this machine lacks that set.
pub fn cpu(kernels: &str, activations: Activations) -> Option<CpuBackend> {
    let kernels = KernelSet::named(kernels)?;
    Some(
        CpuBackend::with_options(CpuOptions {
            activations,
            ..CpuOptions::default()
        })
        .with_kernels(kernels),
    )
}

/// The CUDA backend on device 0, or `None` (after saying so) when this
/// machine has no CUDA device. `MOEFLUX_REQUIRE_CUDA` makes a missing
/// device a failure; a device that is there but fails to initialise always
/// is one.
pub fn cuda_with(options: CudaOptions) -> Option<CudaBackend> {
    match device_count() {
        Ok(0) => {
            assert!(
                std::env::var_os("MOEFLUX_REQUIRE_CUDA").is_none(),
                "no CUDA device found, but MOEFLUX_REQUIRE_CUDA is set"
            );
            println!("skipped: no CUDA device");
            None
        }
        Ok(_) => Some(CudaBackend::with_options(0, options).unwrap_or_else(|e| {
            panic!("a CUDA device is present but the backend failed to initialise: {e}")
        })),
        Err(e) => panic!("the CUDA driver is installed but failing: {e}"),
    }
}

pub fn cuda() -> Option<CudaBackend> {
    cuda_with(CudaOptions::default())
}
