//! What the converter writes, described as data: each canonical tensor is a
//! concatenation of row ranges taken from checkpoint tensors, which covers
//! direct copies, fused projections that are split, and interleaved layouts
//! that are reordered. Architectures build a plan; the converter executes it.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A checkpoint tensor as listed by its safetensors header.
#[derive(Clone, Debug)]
pub struct CheckpointTensor {
    pub shape: Vec<usize>,
    pub shard: usize,
}

/// Names and shapes of every tensor in a checkpoint, and where the model's
/// weights live (`model.` or, for multimodal checkpoints,
/// `model.language_model.`).
#[derive(Debug)]
pub struct CheckpointIndex {
    pub dir: PathBuf,
    pub shards: Vec<PathBuf>,
    pub tensors: BTreeMap<String, CheckpointTensor>,
    /// A stand-in for a checkpoint that has every tensor the architecture
    /// asks for, with the shape it asks for (`moeflux synth`).
    pub synthetic: bool,
}

impl CheckpointIndex {
    /// An index that accepts every tensor the plan asks for.
    pub fn synthetic(dir: &Path) -> CheckpointIndex {
        CheckpointIndex {
            dir: dir.to_path_buf(),
            shards: Vec::new(),
            tensors: BTreeMap::new(),
            synthetic: true,
        }
    }

    pub fn get(&self, name: &str) -> Option<&CheckpointTensor> {
        self.tensors.get(name)
    }

    /// Whether the checkpoint has `name` (a synthetic one has everything,
    /// so fused layouts are chosen where there is a choice).
    pub fn contains(&self, name: &str) -> bool {
        self.synthetic || self.tensors.contains_key(name)
    }

    /// The prefix under which the text model's layers are stored.
    pub fn text_prefix(&self) -> &'static str {
        if self
            .tensors
            .keys()
            .any(|n| n.starts_with("model.language_model."))
        {
            "model.language_model."
        } else {
            "model."
        }
    }

    fn shard_path(&self, name: &str) -> &Path {
        match self.tensors.get(name) {
            Some(t) => &self.shards[t.shard],
            None => &self.dir,
        }
    }
}

pub use crate::format::TensorRole;

/// Rows `[row_start, row_start + rows)` of a checkpoint tensor viewed as a
/// matrix `[product of leading dims, last dim]`.
#[derive(Clone, Debug)]
pub struct RowSource {
    pub tensor: String,
    pub row_start: usize,
    pub rows: usize,
}

/// Every `step`-th column from `start` of a source row: one half of an
/// interleaved pair (gpt-oss's gate and up columns alternate).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColumnPick {
    pub start: usize,
    pub step: usize,
}

impl ColumnPick {
    /// The first `count` picked columns of each row of `rows` (rows
    /// `width` wide), appended to `out`.
    pub fn apply(&self, rows: &[f32], width: usize, count: usize, out: &mut Vec<f32>) {
        for row in rows.chunks_exact(width) {
            out.extend(row.iter().skip(self.start).step_by(self.step).take(count));
        }
    }
}

#[derive(Clone, Debug)]
pub struct DenseTensorPlan {
    pub name: String,
    /// Canonical shape `[rows, cols]` (vectors are `[1, n]` with `shape_1d`).
    pub rows: usize,
    pub cols: usize,
    pub is_vector: bool,
    pub role: TensorRole,
    pub sources: Vec<RowSource>,
    /// Columns taken from each source row, when not all of them.
    pub columns: Option<(ColumnPick, usize)>,
}

/// One expert matrix (gate, up or down) of every expert of a layer.
#[derive(Clone, Debug)]
pub enum ExpertMatrix {
    /// One checkpoint tensor per expert, as on the Hub.
    PerExpert { names: Vec<String> },
    /// A fused `[E, R, C]` tensor; this matrix is rows `row_start..` of each
    /// expert's slice (transformers 5's `gate_up_proj` holds gate then up).
    Fused {
        tensor: String,
        rows_per_expert: usize,
        row_start: usize,
    },
    /// A fused `[E, C, R]` tensor stored input-major (gpt-oss's
    /// `gate_up_proj` `[E, hidden, 2·intermediate]`): row `r` of this
    /// matrix is column `pick.start + r·pick.step` of each expert's `C`
    /// rows.
    Transposed {
        tensor: String,
        rows_per_expert: usize,
        pick: ColumnPick,
    },
    /// A fused `[E, R, C]` tensor whose rows alternate between matrices
    /// (gpt-oss's MXFP4 `gate_up_proj_blocks`): row `r` of this matrix is
    /// row `pick.start + r·pick.step` of each expert's `R` rows.
    InterleavedRows {
        tensor: String,
        rows_per_expert: usize,
        pick: ColumnPick,
    },
}

impl ExpertMatrix {
    pub fn source(&self, expert: usize, rows: usize) -> RowSource {
        match self {
            ExpertMatrix::PerExpert { names } => RowSource {
                tensor: names[expert].clone(),
                row_start: 0,
                rows,
            },
            ExpertMatrix::Fused {
                tensor,
                rows_per_expert,
                row_start,
            } => RowSource {
                tensor: tensor.clone(),
                row_start: expert * rows_per_expert + row_start,
                rows,
            },
            // The expert's whole slice, which the matrix is read across or
            // picked from.
            ExpertMatrix::Transposed {
                tensor,
                rows_per_expert,
                ..
            }
            | ExpertMatrix::InterleavedRows {
                tensor,
                rows_per_expert,
                ..
            } => RowSource {
                tensor: tensor.clone(),
                row_start: expert * rows_per_expert,
                rows: *rows_per_expert,
            },
        }
    }
}

#[derive(Clone, Debug)]
pub struct ExpertLayerPlan {
    pub layer: usize,
    pub num_experts: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub gate: ExpertMatrix,
    pub up: ExpertMatrix,
    pub down: ExpertMatrix,
}

#[derive(Debug, Default)]
pub struct ConversionPlan {
    /// Shape of every checkpoint tensor the plan reads.
    pub source_shapes: BTreeMap<String, Vec<usize>>,
    pub dense: Vec<DenseTensorPlan>,
    pub experts: Vec<ExpertLayerPlan>,
    /// Checkpoint tensors deliberately not converted, with the reason
    /// (vision tower, multi-token-prediction head, tied lm_head).
    pub skipped: Vec<(String, &'static str)>,
    /// Checkpoint tensors the architecture does not know.
    pub unknown: Vec<String>,
}

/// Builds a [`ConversionPlan`], checking names and shapes against the
/// checkpoint as it goes so errors name the offending tensor.
pub struct PlanBuilder<'a> {
    ckpt: &'a CheckpointIndex,
    plan: ConversionPlan,
    used: HashSet<String>,
}

impl<'a> PlanBuilder<'a> {
    pub fn new(ckpt: &'a CheckpointIndex) -> Self {
        PlanBuilder {
            ckpt,
            plan: ConversionPlan::default(),
            used: HashSet::new(),
        }
    }

    pub fn checkpoint(&self) -> &CheckpointIndex {
        self.ckpt
    }

    /// Checks that `name` exists with exactly `shape` and marks it used.
    pub fn expect(&mut self, name: &str, shape: &[usize]) -> Result<()> {
        self.plan
            .source_shapes
            .insert(name.to_string(), shape.to_vec());
        if self.ckpt.synthetic {
            return Ok(());
        }
        let t = self.ckpt.get(name).ok_or_else(|| {
            Error::tensor(
                &self.ckpt.dir,
                name,
                format!(
                    "missing from the checkpoint (expected shape {shape:?}); \
                     is this checkpoint complete and of the architecture its config.json names?"
                ),
            )
        })?;
        if t.shape != shape {
            return Err(Error::tensor(
                self.ckpt.shard_path(name),
                name,
                format!(
                    "expected shape {shape:?} from config.json, found {:?}",
                    t.shape
                ),
            ));
        }
        self.used.insert(name.to_string());
        Ok(())
    }

    /// A canonical matrix copied from one checkpoint tensor `[rows, cols]`.
    pub fn matrix(
        &mut self,
        canonical: String,
        role: TensorRole,
        source: &str,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.expect(source, &[rows, cols])?;
        self.whole(canonical, role, source, [rows, cols], None);
        Ok(())
    }

    /// Plans `canonical` (`[rows, cols]`, a vector when `role` says so) from
    /// every row of checkpoint tensor `source`: all of each row, or the
    /// columns `columns` picks from rows of its width.
    fn whole(
        &mut self,
        canonical: String,
        role: TensorRole,
        source: &str,
        [rows, cols]: [usize; 2],
        columns: Option<(ColumnPick, usize)>,
    ) {
        self.plan.dense.push(DenseTensorPlan {
            name: canonical,
            rows,
            cols,
            is_vector: role == TensorRole::Vector,
            role,
            sources: vec![RowSource {
                tensor: source.to_string(),
                row_start: 0,
                rows,
            }],
            columns,
        });
    }

    /// A canonical matrix assembled from row ranges of tensors already
    /// checked with [`PlanBuilder::expect`].
    pub fn assembled(
        &mut self,
        canonical: String,
        role: TensorRole,
        cols: usize,
        sources: Vec<RowSource>,
    ) {
        let rows = sources.iter().map(|s| s.rows).sum();
        self.plan.dense.push(DenseTensorPlan {
            name: canonical,
            rows,
            cols,
            is_vector: false,
            role,
            sources,
            columns: None,
        });
    }

    /// A canonical matrix of columns `start..start + cols` of the
    /// checkpoint's `[rows, width]` matrix (a projection of concatenated
    /// inputs, split per input).
    pub fn matrix_columns(
        &mut self,
        canonical: String,
        role: TensorRole,
        source: &str,
        [rows, width]: [usize; 2],
        start: usize,
        cols: usize,
    ) -> Result<()> {
        self.expect(source, &[rows, width])?;
        let pick = ColumnPick { start, step: 1 };
        self.whole(canonical, role, source, [rows, cols], Some((pick, width)));
        Ok(())
    }

    /// A vector kept in f32; `shape` is the checkpoint's shape, flattened.
    pub fn vector(&mut self, canonical: String, source: &str, shape: &[usize]) -> Result<()> {
        self.expect(source, shape)?;
        let (rows, cols) = match shape {
            [n] => (1, *n),
            [rows, rest @ ..] => (*rows, rest.iter().product()),
            [] => (1, 1),
        };
        self.whole(canonical, TensorRole::Vector, source, [rows, cols], None);
        Ok(())
    }

    /// A `[rows, cols]` table kept in f32 from columns `pick` of the
    /// checkpoint's `[rows, width]` tensor (de-interleaving fused biases).
    pub fn vector_columns(
        &mut self,
        canonical: String,
        source: &str,
        [rows, width]: [usize; 2],
        pick: ColumnPick,
    ) -> Result<()> {
        self.expect(source, &[rows, width])?;
        let cols = (width.saturating_sub(pick.start)).div_ceil(pick.step);
        self.whole(
            canonical,
            TensorRole::Vector,
            source,
            [rows, cols],
            Some((pick, width)),
        );
        Ok(())
    }

    /// The routed experts of one layer from gpt-oss's fused tensors:
    /// `{prefix}gate_up_proj` `[E, hidden, 2·inter]` with gate and up in
    /// alternating columns, and `{prefix}down_proj` `[E, inter, hidden]`,
    /// both stored input-major.
    pub fn experts_transposed_interleaved(
        &mut self,
        layer: usize,
        prefix: &str,
        num_experts: usize,
        hidden: usize,
        intermediate: usize,
    ) -> Result<()> {
        let gate_up = format!("{prefix}gate_up_proj");
        let down = format!("{prefix}down_proj");
        self.expect(&gate_up, &[num_experts, hidden, 2 * intermediate])?;
        self.expect(&down, &[num_experts, intermediate, hidden])?;
        let transposed = |tensor: &str, rows_per_expert, start, step| ExpertMatrix::Transposed {
            tensor: tensor.to_string(),
            rows_per_expert,
            pick: ColumnPick { start, step },
        };
        self.plan.experts.push(ExpertLayerPlan {
            layer,
            num_experts,
            hidden,
            intermediate,
            gate: transposed(&gate_up, hidden, 0, 2),
            up: transposed(&gate_up, hidden, 1, 2),
            down: transposed(&down, intermediate, 0, 1),
        });
        Ok(())
    }

    /// The routed experts of one layer, per-expert or fused in the
    /// checkpoint, whichever it has.
    pub fn experts(
        &mut self,
        layer: usize,
        prefix: &str,
        num_experts: usize,
        hidden: usize,
        intermediate: usize,
    ) -> Result<()> {
        let fused_gate_up = format!("{prefix}gate_up_proj");
        let fused_down = format!("{prefix}down_proj");
        let (gate, up, down) = if self.ckpt.contains(&fused_gate_up) {
            self.expect(&fused_gate_up, &[num_experts, 2 * intermediate, hidden])?;
            self.expect(&fused_down, &[num_experts, hidden, intermediate])?;
            let fused = |tensor: &str, rows_per_expert, row_start| ExpertMatrix::Fused {
                tensor: tensor.to_string(),
                rows_per_expert,
                row_start,
            };
            (
                fused(&fused_gate_up, 2 * intermediate, 0),
                fused(&fused_gate_up, 2 * intermediate, intermediate),
                fused(&fused_down, hidden, 0),
            )
        } else {
            let mut per_expert = |proj: &str, shape: [usize; 2]| -> Result<ExpertMatrix> {
                let names = (0..num_experts)
                    .map(|e| {
                        let name = format!("{prefix}{e}.{proj}.weight");
                        self.expect(&name, &shape).map(|_| name)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(ExpertMatrix::PerExpert { names })
            };
            (
                per_expert("gate_proj", [intermediate, hidden])?,
                per_expert("up_proj", [intermediate, hidden])?,
                per_expert("down_proj", [hidden, intermediate])?,
            )
        };
        self.plan.experts.push(ExpertLayerPlan {
            layer,
            num_experts,
            hidden,
            intermediate,
            gate,
            up,
            down,
        });
        Ok(())
    }

    /// The routed experts of one layer from gpt-oss's MXFP4 tensors, as the
    /// checkpoint reader presents them: `{prefix}gate_up_proj_blocks`
    /// `[E, 2·inter, hidden]` with gate and up in alternating rows, and
    /// `{prefix}down_proj_blocks` `[E, hidden, inter]`.
    pub fn experts_interleaved_rows(
        &mut self,
        layer: usize,
        prefix: &str,
        num_experts: usize,
        hidden: usize,
        intermediate: usize,
    ) -> Result<()> {
        let gate_up = format!("{prefix}gate_up_proj_blocks");
        let down = format!("{prefix}down_proj_blocks");
        self.expect(&gate_up, &[num_experts, 2 * intermediate, hidden])?;
        self.expect(&down, &[num_experts, hidden, intermediate])?;
        let rows = |start| ExpertMatrix::InterleavedRows {
            tensor: gate_up.clone(),
            rows_per_expert: 2 * intermediate,
            pick: ColumnPick { start, step: 2 },
        };
        self.plan.experts.push(ExpertLayerPlan {
            layer,
            num_experts,
            hidden,
            intermediate,
            gate: rows(0),
            up: rows(1),
            down: ExpertMatrix::Fused {
                tensor: down,
                rows_per_expert: hidden,
                row_start: 0,
            },
        });
        Ok(())
    }

    /// Marks a tensor as deliberately left out.
    pub fn skip(&mut self, name: &str, why: &'static str) {
        if self.used.insert(name.to_string()) {
            self.plan.skipped.push((name.to_string(), why));
        }
    }

    /// Finishes the plan: tensors under the given prefixes are skipped with
    /// the given reason, anything else unused is reported as unknown.
    pub fn finish<S: AsRef<str>>(mut self, skip_prefixes: &[(S, &'static str)]) -> ConversionPlan {
        for name in self.ckpt.tensors.keys() {
            if self.used.contains(name) {
                continue;
            }
            match skip_prefixes
                .iter()
                .find(|(p, _)| name.starts_with(p.as_ref()))
            {
                Some((_, why)) => self.plan.skipped.push((name.clone(), why)),
                None => self.plan.unknown.push(name.clone()),
            }
        }
        self.plan
    }
}
