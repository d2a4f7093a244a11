//! Elementwise operations and moves of rows and columns
//! (kernels/elementwise.cu): residual adds, SwiGLU's silu(gate) · up,
//! sigmoid gates, RoPE, column splits; gathers and concatenations of rows
//! are device-to-device copies.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

use super::geometry::TABLE_WORDS;
use super::{CudaBackend, RopeFrequencies, Tensor, Weight, grid_stride, int, long, ok};
use crate::backend::Rope;
use crate::error::Result;

/// A table of up to [`TABLE_WORDS`] words as `fill_words` takes it.
#[repr(C)]
#[derive(Clone, Copy)]
struct TableWords {
    value: [u64; TABLE_WORDS],
}

// SAFETY: plain data laid out as the kernel's struct of u64s.
unsafe impl DeviceRepr for TableWords {}

impl CudaBackend {
    /// `values` in device memory. Up to [`TABLE_WORDS`] of them are
    /// written by a kernel from its arguments, which a recorded step
    /// repeats at every replay; more are copied from the host, which it
    /// cannot. Without several-token steps (`MOEFLUX_CUDA_BATCHED_STEPS=0`)
    /// they are copied, as before those.
    pub(super) fn device_table(&self, op: &str, values: &[u64]) -> Result<CudaSlice<u64>> {
        if values.len() > TABLE_WORDS || !self.batched_steps {
            self.note_unrecordable();
            return self.upload(op, values);
        }
        let mut words = TableWords {
            value: [0; TABLE_WORDS],
        };
        words.value[..values.len()].copy_from_slice(values);
        let mut table = self.alloc::<u64>(op, values.len())?;
        let n = int(values.len(), "table words");
        launch!(
            self,
            op,
            &self.kernels.fill_words,
            LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            &mut table,
            &words,
            &n
        );
        Ok(table)
    }

    pub(super) fn gather_rows(&self, x: &Tensor, ranges: &[Range<usize>]) -> Result<Tensor> {
        let rows = ranges.iter().map(|r| r.len()).sum();
        let mut out = self.tensor("gather_rows", rows, x.cols)?;
        let mut at = 0;
        for r in ranges.iter().filter(|r| !r.is_empty()) {
            let (from, to) = (r.start * x.cols, r.end * x.cols);
            ok(
                "gather_rows",
                self.stream.memcpy_dtod(
                    &x.data.slice(from..to),
                    &mut out.data.slice_mut(at..at + to - from),
                ),
            )?;
            at += to - from;
        }
        Ok(out)
    }

    pub(super) fn concat_rows(&self, parts: &[Tensor]) -> Result<Tensor> {
        let cols = parts.first().map_or(0, |p| p.cols);
        let mut out = self.tensor("concat_rows", parts.iter().map(|p| p.rows).sum(), cols)?;
        let mut at = 0;
        for p in parts.iter().filter(|p| p.rows > 0) {
            assert_eq!(p.cols, cols, "concat_rows: columns differ");
            let len = p.rows * p.cols;
            ok(
                "concat_rows",
                self.stream
                    .memcpy_dtod(&p.data.slice(..len), &mut out.data.slice_mut(at..at + len)),
            )?;
            at += len;
        }
        Ok(out)
    }

    pub(super) fn split_cols(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        assert_eq!(widths.iter().sum::<usize>(), x.cols, "split_cols widths");
        let (rows, src_cols) = (long(x.rows), int(x.cols, "columns"));
        let mut start = 0;
        widths
            .iter()
            .map(|&width| {
                let mut part = self.tensor("split_cols", x.rows, width)?;
                let (start_i, width_i) = (int(start, "column"), int(width, "width"));
                launch!(
                    self,
                    "copy_cols",
                    &self.kernels.copy_cols,
                    grid_stride(x.rows * width),
                    &x.data,
                    &mut part.data,
                    &rows,
                    &src_cols,
                    &start_i,
                    &width_i
                );
                start += width;
                Ok(part)
            })
            .collect::<Result<_>>()
    }

    pub(super) fn add_assign(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        let len = x.rows * x.cols;
        assert_eq!(len, y.rows * y.cols, "add_assign: shapes differ");
        self.add_assign_raw(&mut x.data, &y.data, len)
    }

    /// `x += y` over their first `len` values.
    pub(super) fn add_assign_raw(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        len: usize,
    ) -> Result<()> {
        let n = long(len);
        launch!(
            self,
            "add_assign",
            &self.kernels.add_assign,
            grid_stride(len),
            x,
            y,
            &n
        );
        Ok(())
    }

    pub(super) fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let len = gate.rows * gate.cols;
        assert_eq!(len, up.rows * up.cols, "silu_mul: shapes differ");
        Ok(Tensor {
            rows: gate.rows,
            cols: gate.cols,
            data: self.silu_mul_raw(&gate.data, &up.data, len)?,
        })
    }

    pub(super) fn silu_mul_raw(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        len: usize,
    ) -> Result<CudaSlice<f32>> {
        let mut out = self.alloc::<f32>("silu_mul", len)?;
        let n = long(len);
        launch!(
            self,
            "silu_mul",
            &self.kernels.silu_mul,
            grid_stride(len),
            gate,
            up,
            &mut out,
            &n
        );
        Ok(out)
    }

    pub(super) fn add_bias(&self, x: &mut Tensor, bias: &Weight) -> Result<()> {
        assert_eq!(bias.vector_len("add_bias"), x.cols, "add_bias: bias width");
        let (rows, cols) = (long(x.rows), int(x.cols, "columns"));
        launch!(
            self,
            "add_bias",
            &self.kernels.add_bias,
            grid_stride(x.rows * x.cols),
            &mut x.data,
            &bias.data,
            &rows,
            &cols
        );
        Ok(())
    }

    pub(super) fn mul_sigmoid(&self, x: &mut Tensor, gate: &Tensor) -> Result<()> {
        let len = x.rows * x.cols;
        if gate.cols == 1 {
            assert_eq!(gate.rows, x.rows, "mul_sigmoid: one gate per row");
            let (rows, cols) = (long(x.rows), int(x.cols, "columns"));
            launch!(
                self,
                "mul_sigmoid_rows",
                &self.kernels.mul_sigmoid_rows,
                grid_stride(len),
                &mut x.data,
                &gate.data,
                &rows,
                &cols
            );
        } else {
            assert_eq!(len, gate.rows * gate.cols, "mul_sigmoid: shapes differ");
            let n = long(len);
            launch!(
                self,
                "mul_sigmoid",
                &self.kernels.mul_sigmoid,
                grid_stride(len),
                &mut x.data,
                &gate.data,
                &n
            );
        };
        Ok(())
    }

    pub(super) fn rope(&self, x: &mut Tensor, rope: Rope, start_pos: usize) -> Result<()> {
        assert!(
            rope.head_dim > 0
                && x.cols.is_multiple_of(rope.head_dim)
                && rope.rotary_dim <= rope.head_dim
                && rope.rotary_dim.is_multiple_of(2),
            "rope: {} columns, head_dim {}, rotary_dim {}",
            x.cols,
            rope.head_dim,
            rope.rotary_dim
        );
        let half = rope.rotary_dim / 2;
        if half == 0 {
            return Ok(());
        }
        let frequencies = self.rope_frequencies(rope)?;
        let total = x.rows * (x.cols / rope.head_dim) * half;
        let (rows, cols, head_dim, half, start, scale) = (
            long(x.rows),
            int(x.cols, "columns"),
            int(rope.head_dim, "head_dim"),
            int(half, "rotary half"),
            long(start_pos),
            rope.attention_factor(),
        );
        // A recorded step reads its position from the device.
        let position = self.recorded_position();
        launch!(
            self,
            "rope",
            &self.kernels.rope,
            grid_stride(total),
            &mut x.data,
            &*frequencies,
            &rows,
            &cols,
            &head_dim,
            &half,
            &start,
            &scale,
            &position
        );
        Ok(())
    }

    /// Rotary frequencies, computed in f32 exactly as the CPU backend does
    /// ([`Rope::inv_frequencies`], transformers' RotaryEmbedding), uploaded
    /// once per rope.
    pub(super) fn rope_frequencies(&self, rope: Rope) -> Result<RopeFrequencies> {
        let mut cache = self.rope_frequencies.lock().unwrap();
        let yarn = rope.yarn.map(|y| {
            [
                y.factor.to_bits(),
                y.original_max_position_embeddings as u64,
                y.beta_fast.to_bits(),
                y.beta_slow.to_bits(),
                u64::from(y.truncate),
            ]
        });
        let key = (rope.rotary_dim, rope.theta.to_bits(), yarn);
        if let Some(frequencies) = cache.get(&key) {
            return Ok(frequencies.clone());
        }
        let inv_freq = rope.inv_frequencies();
        let frequencies = Arc::new(self.upload("rope", &inv_freq)?);
        cache.insert(key, frequencies.clone());
        Ok(frequencies)
    }
}
