//! An expert's form on the device, shared by the VRAM cache, its pinned
//! host tier and the kernels that run experts: where gate, up and down lie
//! in an expert's buffer, and the cache's key.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};

use super::Matrix;
use super::geometry::CODE_TILE_ROWS;
use crate::experts::ExpertStore;
use crate::quant::{DType, MatrixLayout};

/// (expert store, layer, expert)
pub(super) type VramKey = (u64, u32, u32);
/// Offsets of an expert's matrices in its device buffer (and pinned slot)
/// are aligned to this.
pub(super) const PART_ALIGN: usize = 256;

/// Most bytes of one tile of tiled codes: `tile_q4_codes` holds a tile in
/// shared memory, within what every device of compute capability 8.0 or
/// later allows a block (99 KiB on sm_86 and sm_89). A q4 row of up to
/// 12,288 columns.
pub(super) const CODE_TILE_MAX_BYTES: usize = 96 << 10;

/// Whether a matrix laid out as `layout` is stored tiled on a device that
/// tiles expert codes (`tile_q4_codes` in moe.cu describes the form): q4
/// codes in whole tiles of [`CODE_TILE_ROWS`] rows, a tile within
/// [`CODE_TILE_MAX_BYTES`]. Its groups of 16 rows' codes then lie
/// together, so the tensor-core kernels' loads read memory in order.
pub(super) fn tileable(layout: &MatrixLayout) -> bool {
    layout.dtype == DType::Q4
        && layout.rows.is_multiple_of(CODE_TILE_ROWS)
        && CODE_TILE_ROWS * layout.row_bytes <= CODE_TILE_MAX_BYTES
}

/// An expert's gate, up and down matrices in one device buffer.
pub(super) struct DeviceExpert {
    pub(super) data: CudaSlice<u8>,
    pub(super) parts: PartsLayout,
}

/// Where one matrix of an expert lies in the expert's buffer, as the fused
/// kernels take it (`ExpertPart` in moe.cu): its codes from the buffer's
/// start, its scales and biases from its codes, and whether its codes
/// are tiled (1) or row by row (0).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertPart {
    offset: i64,
    scales: i64,
    biases: i64,
    tiled: i64,
}

// SAFETY: four i64s, laid out as the kernels' struct of four long longs.
unsafe impl DeviceRepr for ExpertPart {}

/// The placement of gate, up and down, the same in every expert of a
/// layer, and whether their [`tileable`] matrices are tiled.
#[derive(Clone, Copy, Debug)]
pub(super) struct PartsLayout {
    /// (offset, layout) of gate, up and down.
    pub(super) matrices: [(usize, MatrixLayout); 3],
    pub(super) tiled: bool,
}

impl PartsLayout {
    pub(super) fn part(&self, i: usize) -> ExpertPart {
        let (offset, layout) = self.matrices[i];
        ExpertPart {
            offset: offset as i64,
            scales: layout.scales_offset as i64,
            biases: layout.biases_offset as i64,
            tiled: i64::from(self.is_tiled(i)),
        }
    }

    /// Whether matrix `i`'s codes are tiled.
    pub(super) fn is_tiled(&self, i: usize) -> bool {
        self.tiled && tileable(&self.matrices[i].1)
    }
}

impl DeviceExpert {
    /// The device address of the buffer (valid while `self` lives).
    pub(super) fn address(&self, stream: &CudaStream) -> u64 {
        let (ptr, _sync) = self.data.device_ptr(stream);
        ptr
    }

    /// Matrix `part` as a dense product takes it: stored row by row.
    pub(super) fn matrix(&self, part: usize, name: &'static str) -> Matrix<'_> {
        assert!(
            !self.parts.is_tiled(part),
            "{name}: tiled codes are read by the expert kernels only"
        );
        let (offset, layout) = self.parts.matrices[part];
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

/// An expert's parts in a device buffer (or pinned slot, where the codes
/// stay row by row: a device buffer's are tiled after upload).
#[derive(Clone, Copy)]
pub(super) struct DeviceLayout {
    pub(super) parts: PartsLayout,
    pub(super) total: usize,
}

impl DeviceLayout {
    /// The layout of every expert of `layer`: parts one after another,
    /// each aligned to [`PART_ALIGN`]; with `tiled`, [`tileable`] ones
    /// tiled in VRAM.
    pub(super) fn of(store: &ExpertStore, layer: usize, tiled: bool) -> DeviceLayout {
        let blob = store
            .blob_layout(layer)
            .expect("routed experts of an MoE layer");
        let mut parts = [blob.gate, blob.up, blob.down];
        let mut total = 0;
        for part in parts.iter_mut() {
            part.0 = total;
            total += part.1.total_bytes.next_multiple_of(PART_ALIGN);
        }
        // The kernels take an expert's matrices as one type (experts.rs).
        let one_type = parts.iter().all(|(_, l)| l.dtype == parts[0].1.dtype);
        DeviceLayout {
            parts: PartsLayout {
                matrices: parts,
                tiled: tiled && one_type,
            },
            total,
        }
    }
}
