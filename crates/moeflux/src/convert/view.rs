//! Hugging Face tensors as views of stored tensors.
//!
//! The architecture plans (`arch/`) name tensors as Hugging Face checkpoints
//! do. Other layouts store the same weights under other names, stacked,
//! reordered or transformed: MLX stacks routed experts into
//! `switch_mlp` tensors, GGUF renames everything, splits Qwen3-Next's fused
//! projections, reorders Qwen3.5's value heads and stores norms as `1 + w`.
//! A [`View`] presents one Hugging Face tensor as rows of a stored tensor:
//! a row offset, an optional row and column reordering and an element-wise
//! inverse transform. [`Views`] turns a [`Store`] (the stored tensors,
//! decoded element by element) and its views into a [`TensorSource`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::TensorSource;
use super::plan::{CheckpointIndex, CheckpointTensor, RowSource};
use crate::error::{Error, Result};
use crate::quant::{DType, EncodedRows, GROUP_SIZE, MatrixLayout};

/// Stored tensors, decoded to f32.
pub(crate) trait Store: Sync {
    /// Appends `len` elements of stored tensor `tensor`, from element
    /// `start` in row-major order, as f32.
    fn read_elements(
        &self,
        tensor: &str,
        start: usize,
        len: usize,
        out: &mut Vec<f32>,
    ) -> Result<()>;

    /// The file holding a stored tensor, for messages.
    fn path_of(&self, tensor: &str) -> &Path;

    /// Bits per weight of a stored tensor (scales included).
    fn bits_per_weight(&self, tensor: &str) -> Option<f64>;

    /// Whether rows of `cols` weights of the stored tensor are already in
    /// moeflux's encoding `dtype` (codes, bf16 scales and biases per group
    /// of 64), so they can be copied without re-quantization.
    fn stored_as(&self, _tensor: &str, _dtype: DType) -> bool {
        false
    }

    /// Appends stored row `row` (of `cols` weights) in moeflux's encoding,
    /// for a tensor [`Store::stored_as`] accepted. Returns `false` when this
    /// row cannot be copied exactly (its scales do not fit bf16).
    fn append_encoded_row(
        &self,
        _tensor: &str,
        _row: usize,
        _cols: usize,
        _out: &mut EncodedRows,
    ) -> Result<bool> {
        Ok(false)
    }

    /// What the stored tensor is, for notes ("MLX 4-bit, groups of 64").
    fn describe(&self, _tensor: &str) -> Option<String> {
        None
    }
}

/// An element-wise transform undoing what a format applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    None,
    /// Norm weights stored as `1 + w` (llama.cpp and MLX for the `1 + w`
    /// norm style): `w = s - 1`.
    MinusOne,
    /// `A_log` stored as `A = -exp(A_log)` (llama.cpp's `ssm_a`):
    /// `A_log = ln(-A)`.
    LnOfNegated,
}

/// One Hugging Face tensor as rows of a stored tensor viewed as
/// `[elements / cols, cols]`, `cols` the last dimension of `shape`.
#[derive(Clone, Debug)]
pub(crate) struct View {
    /// The stored tensor.
    pub tensor: String,
    /// The shape the Hugging Face checkpoint has.
    pub shape: Vec<usize>,
    /// The stored row of this view's row 0.
    pub row_offset: usize,
    /// Row `r` of the view is stored row `row_offset + rows[r]`.
    pub rows: Option<Arc<[usize]>>,
    /// Column `c` of the view is stored column `cols[c]`.
    pub cols: Option<Arc<[usize]>>,
    pub op: Op,
}

impl View {
    /// The whole stored tensor, as it is.
    pub fn of(tensor: &str, shape: Vec<usize>) -> View {
        View {
            tensor: tensor.to_string(),
            shape,
            row_offset: 0,
            rows: None,
            cols: None,
            op: Op::None,
        }
    }

    pub fn width(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }

    pub fn height(&self) -> usize {
        let w = self.width();
        self.shape
            .iter()
            .product::<usize>()
            .checked_div(w)
            .unwrap_or(0)
    }

    fn stored_row(&self, r: usize) -> usize {
        self.row_offset + self.rows.as_ref().map_or(r, |m| m[r])
    }

    /// Whether rows are copied unchanged (no column order, no transform).
    fn plain_rows(&self) -> bool {
        self.cols.is_none() && self.op == Op::None
    }
}

/// Counts of how quantized source tensors were written, reported once at
/// the end of a conversion.
#[derive(Default)]
pub(crate) struct Notes {
    lines: Mutex<Vec<String>>,
    tensors: Mutex<BTreeMap<String, BTreeSet<String>>>,
}

impl Notes {
    /// A line to report as it is.
    pub fn say(&self, line: String) {
        self.lines.lock().unwrap().push(line);
    }

    /// Records that source tensor `tensor` was written as `what` says.
    pub fn add(&self, what: String, tensor: &str) {
        self.tensors
            .lock()
            .unwrap()
            .entry(what)
            .or_default()
            .insert(tensor.to_string());
    }

    pub fn lines(&self) -> Vec<String> {
        let mut lines = self.lines.lock().unwrap().clone();
        lines.extend(
            self.tensors
                .lock()
                .unwrap()
                .iter()
                .map(|(what, names)| format!("{} tensor(s) {what}", names.len())),
        );
        lines
    }
}

/// A [`TensorSource`] of Hugging Face tensors viewed over a [`Store`].
pub(crate) struct Views<S> {
    pub store: S,
    pub views: BTreeMap<String, View>,
    pub dir: PathBuf,
    pub notes: Notes,
}

impl<S: Store> Views<S> {
    pub fn new(store: S, views: BTreeMap<String, View>, dir: &Path) -> Views<S> {
        Views {
            store,
            views,
            dir: dir.to_path_buf(),
            notes: Notes::default(),
        }
    }

    /// The checkpoint index the architecture plans read: every view's name
    /// and shape; `shards` lists the files, `shard_of` places a stored
    /// tensor in one.
    pub fn index(&self, shards: Vec<PathBuf>, shard_of: impl Fn(&str) -> usize) -> CheckpointIndex {
        CheckpointIndex {
            dir: self.dir.clone(),
            shards,
            tensors: self
                .views
                .iter()
                .map(|(name, v)| {
                    (
                        name.clone(),
                        CheckpointTensor {
                            shape: v.shape.clone(),
                            shard: shard_of(&v.tensor),
                        },
                    )
                })
                .collect(),
            synthetic: false,
        }
    }

    fn view(&self, name: &str) -> Result<&View> {
        self.views
            .get(name)
            .ok_or_else(|| Error::tensor(&self.dir, name, "missing from the checkpoint"))
    }
}

impl<S: Store> TensorSource for Views<S> {
    fn read_rows(&self, src: &RowSource, out: &mut Vec<f32>) -> Result<()> {
        let v = self.view(&src.tensor)?;
        let w = v.width();
        if src.row_start + src.rows > v.height() {
            return Err(Error::tensor(
                self.store.path_of(&v.tensor),
                &src.tensor,
                format!(
                    "rows {}..{} asked of a tensor of {} rows",
                    src.row_start,
                    src.row_start + src.rows,
                    v.height()
                ),
            ));
        }
        let maps_fit = v.rows.as_ref().is_none_or(|m| m.len() == v.height())
            && v.cols
                .as_ref()
                .is_none_or(|m| m.len() == w && m.iter().all(|&c| c < w));
        if !maps_fit {
            return Err(Error::tensor(
                self.store.path_of(&v.tensor),
                &src.tensor,
                format!(
                    "its shape {:?} does not fit the layout the format implies",
                    v.shape
                ),
            ));
        }
        let before = out.len();
        let mut r = 0;
        while r < src.rows {
            let first = v.stored_row(src.row_start + r);
            let mut n = 1;
            while r + n < src.rows && v.stored_row(src.row_start + r + n) == first + n {
                n += 1;
            }
            self.store.read_elements(&v.tensor, first * w, n * w, out)?;
            r += n;
        }
        let values = &mut out[before..];
        if let Some(cols) = &v.cols {
            let mut row = vec![0f32; w];
            for chunk in values.chunks_exact_mut(w) {
                row.copy_from_slice(chunk);
                for (o, &c) in chunk.iter_mut().zip(cols.iter()) {
                    *o = row[c];
                }
            }
        }
        match v.op {
            Op::None => {}
            Op::MinusOne => values.iter_mut().for_each(|x| *x -= 1.0),
            Op::LnOfNegated => values.iter_mut().for_each(|x| *x = (-*x).ln()),
        }
        if values.iter().any(|x| !x.is_finite()) {
            return Err(Error::tensor(
                self.store.path_of(&v.tensor),
                &src.tensor,
                "contains NaN or infinite values; the checkpoint is damaged",
            ));
        }
        Ok(())
    }

    fn stored_bits(&self, tensor: &str) -> Option<f64> {
        self.store.bits_per_weight(&self.views.get(tensor)?.tensor)
    }

    fn encoded_source_rows(
        &self,
        sources: &[RowSource],
        layout: &MatrixLayout,
    ) -> Option<Result<EncodedRows>> {
        if !layout.dtype.is_quantized() {
            return None;
        }
        let mut described = BTreeSet::new();
        let mut exact = true;
        for src in sources {
            let v = self.views.get(&src.tensor)?;
            if let Some(what) = self.store.describe(&v.tensor) {
                described.insert(what);
            }
            if !(v.plain_rows()
                && v.width() == layout.cols
                && self.store.stored_as(&v.tensor, layout.dtype))
            {
                exact = false;
            }
        }
        if described.is_empty() {
            return None;
        }
        let what = described.into_iter().collect::<Vec<_>>().join(", ");
        let note = |text: String| {
            for src in sources {
                self.notes.add(text.clone(), &src.tensor);
            }
        };
        if exact {
            let mut enc = EncodedRows::default();
            for src in sources {
                let v = &self.views[&src.tensor];
                for r in src.row_start..src.row_start + src.rows {
                    match self.store.append_encoded_row(
                        &v.tensor,
                        v.stored_row(r),
                        layout.cols,
                        &mut enc,
                    ) {
                        Ok(true) => {}
                        Ok(false) => {
                            note(format!(
                                "in {what} whose scales or biases are not exact in bf16: \
                                 dequantized and re-quantized to {}",
                                layout.dtype.name()
                            ));
                            return None;
                        }
                        Err(e) => return Some(Err(e)),
                    }
                }
            }
            note(format!(
                "in {what}: copied into {} bit for bit",
                layout.dtype.name()
            ));
            return Some(Ok(enc));
        }
        note(format!(
            "in {what}: dequantized and re-quantized to {} (groups of {GROUP_SIZE})",
            layout.dtype.name()
        ));
        None
    }

    fn notes(&self) -> Vec<String> {
        self.notes.lines()
    }
}
