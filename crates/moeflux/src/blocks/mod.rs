//! The model definition, written once against [`Backend`]: the building
//! blocks of the supported architectures (gated and plain attention, Gated
//! DeltaNet, sparse MoE with an optional shared expert, dense MLP) and the
//! decoder stack that composes them as the [`ModelConfig`] says.

pub mod attention;
pub mod batch;
pub mod decoder;
pub mod gated_delta_net;
pub mod mla;
pub mod moe;
pub mod mtp;

use std::ops::Range;

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::format::{MANIFEST_FILE, ModelDir, TensorRole};
use crate::quant::DType;

/// Loads canonical tensors from a model directory onto a backend, checking
/// each against the shape the configuration implies.
pub struct Weights<'a, B: Backend> {
    pub dir: &'a ModelDir,
    pub backend: &'a B,
}

impl<B: Backend> Weights<'_, B> {
    pub fn config(&self) -> &ModelConfig {
        self.dir.config()
    }

    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<B::Weight> {
        self.load(name, &[rows, cols], TensorRole::Matrix)
    }

    /// A router's matrix (or the shared expert's gate): multiplied with
    /// exact activations whatever the backend's options.
    pub fn router(&self, name: &str, rows: usize, cols: usize) -> Result<B::Weight> {
        self.load(name, &[rows, cols], TensorRole::Router)
    }

    /// Loads a tensor for `role`, which must be the role the converter
    /// recorded for it (directories from before roles were recorded take
    /// the model definition's word).
    fn load(&self, name: &str, shape: &[usize], role: TensorRole) -> Result<B::Weight> {
        let t = self.dir.tensor(name, shape)?;
        if let Some(recorded) = t.entry.role.filter(|&r| r != role) {
            return Err(Error::tensor(
                self.dir.root().join(MANIFEST_FILE),
                name,
                format!(
                    "recorded as a {recorded:?} tensor, but the model uses it as a {role:?}: \
                     the directory does not match its architecture; convert it again"
                ),
            ));
        }
        self.backend.load_weight(&t, role)
    }

    /// A vector or small table kept in f32 (norm weights, convolution
    /// taps, decay parameters).
    pub fn f32_tensor(&self, name: &str, shape: &[usize]) -> Result<B::Weight> {
        let t = self.dir.tensor(name, shape)?;
        if t.entry.dtype != DType::F32 {
            return Err(Error::tensor(
                self.dir.root().join(MANIFEST_FILE),
                name,
                format!(
                    "stored as {}, the engine needs f32 for this tensor",
                    t.entry.dtype.name()
                ),
            ));
        }
        self.load(name, shape, TensorRole::Vector)
    }
}

/// Runs `f` on each sequence's rows of `inputs` (`ranges` are the
/// sequences' rows in the batch) and returns the outputs one sequence after
/// another. A batch of one sequence passes its tensors through uncopied.
pub(crate) fn per_sequence<B: Backend>(
    b: &B,
    ranges: &[Range<usize>],
    inputs: Vec<B::Tensor>,
    mut f: impl FnMut(usize, Vec<B::Tensor>) -> Result<B::Tensor>,
) -> Result<B::Tensor> {
    if ranges.len() == 1 {
        return f(0, inputs);
    }
    let outputs: Vec<B::Tensor> = ranges
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let rows = inputs
                .iter()
                .map(|x| b.gather_rows(x, std::slice::from_ref(r)))
                .collect::<Result<_>>()?;
            f(i, rows)
        })
        .collect::<Result<_>>()?;
    b.concat_rows(&outputs)
}
