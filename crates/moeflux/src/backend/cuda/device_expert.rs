//! An expert's form on the device, shared by the VRAM cache, its pinned
//! host tier and the kernels that run experts: where gate, up and down lie
//! in an expert's buffer, and the cache's key.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};

use super::Matrix;
use crate::experts::ExpertStore;
use crate::quant::MatrixLayout;

/// (expert store, layer, expert)
pub(super) type VramKey = (u64, u32, u32);
/// Offsets of an expert's matrices in its device buffer (and pinned slot)
/// are aligned to this.
pub(super) const PART_ALIGN: usize = 256;

/// An expert's gate, up and down matrices in one device buffer.
pub(super) struct DeviceExpert {
    pub(super) data: CudaSlice<u8>,
    /// (offset, layout) of gate, up and down.
    pub(super) parts: [(usize, MatrixLayout); 3],
}

/// Where one matrix of an expert lies in the expert's buffer, as the fused
/// kernels take it (`ExpertPart` in moe.cu): its codes from the buffer's
/// start, its scales and biases from its codes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertPart {
    offset: i64,
    scales: i64,
    biases: i64,
}

// SAFETY: three i64s, laid out as the kernels' struct of three long longs.
unsafe impl DeviceRepr for ExpertPart {}

/// The placement of gate, up and down, the same in every expert of a layer.
#[derive(Clone, Copy, Debug)]
pub(super) struct PartsLayout(pub(super) [(usize, MatrixLayout); 3]);

impl PartsLayout {
    pub(super) fn part(&self, i: usize) -> ExpertPart {
        let (offset, layout) = self.0[i];
        ExpertPart {
            offset: offset as i64,
            scales: layout.scales_offset as i64,
            biases: layout.biases_offset as i64,
        }
    }
}

impl DeviceExpert {
    /// The device address of the buffer (valid while `self` lives).
    pub(super) fn address(&self, stream: &CudaStream) -> u64 {
        let (ptr, _sync) = self.data.device_ptr(stream);
        ptr
    }

    pub(super) fn matrix(&self, part: usize, name: &'static str) -> Matrix<'_> {
        let (offset, layout) = self.parts[part];
        Matrix {
            name,
            layout,
            data: &self.data,
            offset,
            int8: false,
        }
    }
}

/// The intermediate size of experts laid out as `parts` (gate, up, down)
/// for a hidden size of `hidden`, checked against the down projection.
pub(super) fn expert_inter(parts: &[(usize, MatrixLayout); 3], hidden: usize) -> usize {
    let (gate, down) = (parts[0].1, parts[2].1);
    assert!(
        gate.cols == hidden && down.rows == hidden && down.cols == gate.rows,
        "routed experts: expert shapes [{}, {}] and [{}, {}] for hidden size {hidden}",
        gate.rows,
        gate.cols,
        down.rows,
        down.cols
    );
    gate.rows
}

/// Bytes of one expert of `layer`'s gate, up and down (codes, scales and
/// biases): what computing it reads.
pub(super) fn expert_bytes(store: &ExpertStore, layer: usize) -> u64 {
    let blob = store
        .blob_layout(layer)
        .expect("routed experts of an MoE layer");
    [blob.gate, blob.up, blob.down]
        .iter()
        .map(|(_, l)| l.total_bytes as u64)
        .sum()
}

/// An expert's parts in a device buffer (or pinned slot).
#[derive(Clone, Copy)]
pub(super) struct DeviceLayout {
    pub(super) parts: [(usize, MatrixLayout); 3],
    pub(super) total: usize,
}

impl DeviceLayout {
    /// The layout of every expert of `layer`: parts one after another,
    /// each aligned to [`PART_ALIGN`].
    pub(super) fn of(store: &ExpertStore, layer: usize) -> DeviceLayout {
        let blob = store
            .blob_layout(layer)
            .expect("routed experts of an MoE layer");
        let mut parts = [blob.gate, blob.up, blob.down];
        let mut total = 0;
        for part in parts.iter_mut() {
            part.0 = total;
            total += part.1.total_bytes.next_multiple_of(PART_ALIGN);
        }
        DeviceLayout { parts, total }
    }
}
