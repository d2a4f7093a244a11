//! Statistics a backend reports in the same terms whatever its device.

use serde::Serialize;

/// What a device's own expert cache (a GPU's VRAM, fed from a pinned
/// host tier) and the copies feeding it have done since the backend was
/// created. Every routed expert a layer uses counts once, as a hit, a
/// miss or an expert computed on the CPU (hybrid decode); misses and
/// prefetches are uploaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DeviceExpertStats {
    /// Experts found in VRAM when a layer used them (prefetched included).
    pub hits: u64,
    /// Experts a layer used that were not in VRAM: uploaded on demand.
    pub misses: u64,
    /// Hits on experts a prefetch uploaded.
    pub prefetch_hits: u64,
    /// Experts uploaded ahead of use (the next layer's router's guess).
    pub prefetches: u64,
    /// Every upload: misses and prefetches.
    pub uploads: u64,
    /// Bytes copied from host to device for uploads (over PCIe).
    pub uploaded_bytes: u64,
    /// Time the copy stream spent copying those bytes (device events).
    pub copy_nanos: u64,
    pub evictions: u64,
    pub resident_bytes: u64,
    /// `None` until the first upload when the budget is automatic.
    pub budget_bytes: Option<u64>,
    /// Layers whose experts are all resident: their tokens are decoded
    /// without returning the routing to the host.
    pub complete_layers: u64,
    /// Uploads whose bytes were already in the pinned host tier.
    pub pinned_hits: u64,
    /// Uploads whose bytes came from the expert store (then pinned).
    pub pinned_misses: u64,
    pub pinned_bytes: u64,
    pub pinned_budget_bytes: u64,
    /// Expert bytes the calls of several tokens used, each distinct expert
    /// of a layer once per call: the weights a batched step must read at
    /// least (the calls grouped on the device count these and no hits).
    pub batched_expert_bytes: u64,
    /// Bytes of activations, routing weights and partial sums sent between
    /// GPUs that divide the experts (0 on one).
    pub exchanged_bytes: u64,
    /// Experts a decode step used that were not in VRAM and that the CPU
    /// computed from host memory instead of uploading them.
    pub cpu_experts: u64,
    /// Bytes of those experts (read by the CPU, not copied).
    pub cpu_expert_bytes: u64,
    /// Host time the CPU spent computing them.
    pub cpu_nanos: u64,
}

impl DeviceExpertStats {
    /// The work done between `earlier` and `self` (sizes and budgets as
    /// of `self`).
    pub fn since(&self, earlier: &DeviceExpertStats) -> DeviceExpertStats {
        DeviceExpertStats {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            prefetch_hits: self.prefetch_hits - earlier.prefetch_hits,
            prefetches: self.prefetches - earlier.prefetches,
            uploads: self.uploads - earlier.uploads,
            uploaded_bytes: self.uploaded_bytes - earlier.uploaded_bytes,
            copy_nanos: self.copy_nanos - earlier.copy_nanos,
            evictions: self.evictions - earlier.evictions,
            pinned_hits: self.pinned_hits - earlier.pinned_hits,
            pinned_misses: self.pinned_misses - earlier.pinned_misses,
            batched_expert_bytes: self.batched_expert_bytes - earlier.batched_expert_bytes,
            exchanged_bytes: self.exchanged_bytes - earlier.exchanged_bytes,
            cpu_experts: self.cpu_experts - earlier.cpu_experts,
            cpu_expert_bytes: self.cpu_expert_bytes - earlier.cpu_expert_bytes,
            cpu_nanos: self.cpu_nanos - earlier.cpu_nanos,
            ..*self
        }
    }

    /// Share of the experts the GPU computed that were found in VRAM.
    pub fn hit_rate(&self) -> f64 {
        match self.hits + self.misses {
            0 => 1.0,
            uses => self.hits as f64 / uses as f64,
        }
    }

    /// Host-to-device throughput of the uploads while the copy stream was
    /// copying, in GB/s.
    pub fn copy_gb_s(&self) -> Option<f64> {
        (self.copy_nanos > 0).then(|| self.uploaded_bytes as f64 / self.copy_nanos as f64)
    }

    /// The CPU's throughput on the experts it computed, in GB/s of their
    /// bytes.
    pub fn cpu_gb_s(&self) -> Option<f64> {
        (self.cpu_nanos > 0).then(|| self.cpu_expert_bytes as f64 / self.cpu_nanos as f64)
    }
}
