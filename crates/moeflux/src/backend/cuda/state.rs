//! A sequence's per-layer state on the device: KV caches and Gated
//! DeltaNet states, created, grown, copied, truncated, saved and restored
//! without leaving device memory except when saved.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::{CudaSlice, DevicePtr};

use super::geometry::DECODE_ATTN_MAX_SPLITS;
use super::{CudaBackend, grid_stride, int, long, ok};
use crate::backend::{AttentionShape, HostDeltaNetState, HostKv, KvRows, KvType};
use crate::config::LinearAttentionConfig;
use crate::error::Result;

/// Positions a KV cache holds at least once it holds any.
const MIN_KV_POSITIONS: usize = 256;

/// Keys and values of every position seen so far, each `[capacity,
/// kv_heads·head_dim]` values in the cache's [`KvType`] of which the first
/// `len - first` rows are valid: row `r` holds position `first + r`. They
/// lie in four planes of bytes, each with rows of its own size: the keys'
/// values (f32, bf16 bits or q8 codes), the keys' q8 scales, the values'
/// values and the values' q8 scales (a plane whose rows have no bytes, the
/// scales of the other types, is never read or written). `first` is 0
/// unless the shape has a sliding window, whose cache lets go of the
/// positions no later query sees when it next makes room, so it stays
/// within a few windows and chunks. It moves the rows it keeps to the
/// front of its own buffers when they hold them and the room asked for, so
/// a recorded decode step stays valid: such a step reads the row of its
/// new position from the cache's `row` word, which
/// `CudaBackend::kv_prepare_step` sets before every step (a sliding
/// window's rows are not its positions).
///
/// Growth: when an append does not fit, the capacity at least doubles (to
/// at least `MIN_KV_POSITIONS`) and the valid rows move to the new
/// buffers, so appending one token at a time costs amortised O(1) copies.
/// Truncation keeps the capacity: a session that rewinds and grows again
/// reuses it.
///
/// The length is shared with recorded decode steps (graph.rs), which
/// advance it when they are replayed without this code running.
///
/// A decode step that splits a head's positions over several blocks
/// merges their results through `partials` (`[heads][splits][head_dim +
/// 2]`) and `tickets` (a zeroed word per head, back to zero after each
/// step): the cache's own, so sequences decoded together and layers never
/// share them.
///
/// A latent cache (multi-head latent attention, `shape.latent`, always
/// f32) holds only keys, each row a position's latent and rotary key; its
/// decode steps take their partials from a temporary (mla.rs), and use the
/// tickets.
pub struct KvCache {
    shape: AttentionShape,
    kv: KvType,
    len: Arc<AtomicUsize>,
    first: usize,
    capacity: usize,
    /// The keys' values and scales, then the values' values and scales.
    planes: [CudaSlice<u8>; 4],
    partials: CudaSlice<f32>,
    tickets: CudaSlice<u32>,
    /// A sliding window's row of its next position, on the device.
    row: Option<CudaSlice<u32>>,
}

impl KvCache {
    fn width(&self) -> usize {
        self.shape.num_kv_heads * self.shape.head_dim
    }

    /// Bytes of a row of each plane (0: a plane this cache does not use).
    fn row_bytes(&self) -> [usize; 4] {
        plane_row_bytes(self.shape, self.kv)
    }

    /// Positions seen so far.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Rows held: the positions from `first` on.
    pub(super) fn held(&self) -> usize {
        self.len() - self.first
    }

    /// Whether the cache has a sliding window.
    pub(super) fn windowed(&self) -> bool {
        self.shape.window.is_some()
    }

    /// Positions the next query attends to.
    pub(super) fn attended_next(&self) -> usize {
        let seen = self.held() + 1;
        self.shape.window.map_or(seen, |w| w.min(seen))
    }

    /// The device word of a sliding window's next row (see [`KvCache`]).
    pub(super) fn row_word(&self, backend: &CudaBackend) -> Option<u64> {
        self.row.as_ref().map(|w| w.device_ptr(&backend.stream).0)
    }

    /// The geometry the cache was made for.
    pub(super) fn shape(&self) -> AttentionShape {
        self.shape
    }

    /// How the cache stores keys and values.
    pub(super) fn kv_type(&self) -> KvType {
        self.kv
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn set_len(&self, len: usize) {
        self.len.store(len, Ordering::Relaxed);
    }

    /// What a recorded step bakes in: the buffers' addresses and capacity,
    /// and the length counter it advances (which a recording keeps alive,
    /// so no other cache can have the same one).
    pub(super) fn identity(&self, backend: &CudaBackend) -> [u64; 6] {
        let [keys, key_scales, values, value_scales] = self
            .planes
            .each_ref()
            .map(|p| p.device_ptr(&backend.stream).0);
        [
            keys,
            key_scales,
            values,
            value_scales,
            self.capacity as u64,
            Arc::as_ptr(&self.len) as u64,
        ]
    }

    /// The length counter, for a recording to advance on replay.
    pub(super) fn len_counter(&self) -> &Arc<AtomicUsize> {
        &self.len
    }

    /// The keys' values (a latent cache's rows).
    pub(super) fn keys(&self) -> &CudaSlice<u8> {
        &self.planes[0]
    }

    /// The keys' q8 scales (unused by the other types).
    pub(super) fn key_scales(&self) -> &CudaSlice<u8> {
        &self.planes[1]
    }

    pub(super) fn values(&self) -> &CudaSlice<u8> {
        &self.planes[2]
    }

    pub(super) fn value_scales(&self) -> &CudaSlice<u8> {
        &self.planes[3]
    }

    pub(super) fn partials(&self) -> &CudaSlice<f32> {
        &self.partials
    }

    pub(super) fn tickets(&self) -> &CudaSlice<u32> {
        &self.tickets
    }
}

/// Bytes of a row of each plane of a cache of `shape` and `kv` (see
/// [`KvCache`]): a latent cache has no values.
fn plane_row_bytes(shape: AttentionShape, kv: KvType) -> [usize; 4] {
    let width = shape.num_kv_heads * shape.head_dim;
    let (data, scales) = (kv.value_bytes() * width, kv.scale_bytes(width));
    match shape.latent {
        true => [data, scales, 0, 0],
        false => [data, scales, data, scales],
    }
}

/// Convolution history `[kernel - 1, conv_dim]` and recurrent state
/// `[value_heads, key_head_dim, value_head_dim]` of one Gated DeltaNet layer.
pub struct DeltaNetState {
    pub(super) conv: CudaSlice<f32>,
    pub(super) recurrent: CudaSlice<f32>,
    conv_len: usize,
    recurrent_len: usize,
}

fn linear_sizes(cfg: &LinearAttentionConfig) -> (usize, usize) {
    (
        (cfg.conv_kernel - 1) * cfg.conv_dim(),
        cfg.num_value_heads * cfg.key_head_dim * cfg.value_head_dim,
    )
}

impl CudaBackend {
    pub(super) fn kv_new(&self, shape: AttentionShape, kv: KvType) -> Result<KvCache> {
        let op = "new KV cache";
        let partials = match shape.latent {
            true => 0,
            false => shape.num_heads * DECODE_ATTN_MAX_SPLITS * (shape.head_dim + 2),
        };
        Ok(KvCache {
            shape,
            kv,
            len: Arc::new(AtomicUsize::new(0)),
            first: 0,
            capacity: 0,
            planes: [
                self.alloc(op, 0)?,
                self.alloc(op, 0)?,
                self.alloc(op, 0)?,
                self.alloc(op, 0)?,
            ],
            partials: self.alloc(op, partials)?,
            tickets: self.zeros(op, shape.num_heads)?,
            row: match shape.window {
                Some(_) => Some(self.zeros(op, 1)?),
                None => None,
            },
        })
    }

    /// Before a step of `rows` positions that may be recorded or replayed:
    /// room for them, and a sliding window's row word set to where the
    /// first goes.
    pub(super) fn kv_prepare_step(&self, cache: &mut KvCache, rows: usize) -> Result<()> {
        self.kv_reserve(cache, rows)?;
        let row = u32::try_from(cache.held()).expect("a KV cache's rows fit 32 bits");
        if let Some(word) = cache.row.as_mut() {
            self.set_word(word, row, "preparing a decode step")?;
        }
        Ok(())
    }

    /// Makes room for `extra` more positions (see [`KvCache`] on growth;
    /// a sliding window's cache first lets go of what no later query sees).
    pub(super) fn kv_reserve(&self, cache: &mut KvCache, extra: usize) -> Result<()> {
        if cache.held() + extra <= cache.capacity {
            return Ok(());
        }
        let len = cache.len();
        let first = len - cache.shape.retained(len).min(cache.held());
        let dropped = first - cache.first;
        let needed = cache.held() - dropped + extra;
        if cache.windowed() && needed <= cache.capacity {
            return self.kv_compact(cache, first);
        }
        let capacity = match cache.windowed() {
            true => (2 * needed).max(MIN_KV_POSITIONS),
            false => needed.max(2 * cache.capacity).max(MIN_KV_POSITIONS),
        };
        let valid = cache.held() - dropped;
        let op = "growing a KV cache";
        // Every plane is allocated before any replaces the old: a failure
        // leaves the cache as it was.
        let mut grown = Vec::with_capacity(4);
        for (old, &row) in cache.planes.iter().zip(&cache.row_bytes()) {
            let mut new = self.alloc::<u8>(op, capacity * row)?;
            if valid * row > 0 {
                let from = dropped * row;
                ok(
                    op,
                    self.stream.memcpy_dtod(
                        &old.slice(from..from + valid * row),
                        &mut new.slice_mut(..valid * row),
                    ),
                )?;
            }
            grown.push(new);
        }
        cache.planes = grown
            .try_into()
            .unwrap_or_else(|_| unreachable!("four planes"));
        cache.capacity = capacity;
        cache.first = first;
        Ok(())
    }

    /// Moves a sliding window's rows from position `first` on to the front
    /// of its buffers (through a temporary: the ranges may overlap).
    fn kv_compact(&self, cache: &mut KvCache, first: usize) -> Result<()> {
        let op = "moving a sliding window's rows";
        let (skip, valid) = (first - cache.first, cache.len() - first);
        let rows = cache.row_bytes();
        for (buffer, row) in cache.planes.iter_mut().zip(rows) {
            let (from, bytes) = (skip * row, valid * row);
            if bytes > 0 {
                let mut kept = self.alloc::<u8>(op, bytes)?;
                ok(
                    op,
                    self.stream
                        .memcpy_dtod(&buffer.slice(from..from + bytes), &mut kept),
                )?;
                ok(
                    op,
                    self.stream
                        .memcpy_dtod(&kept, &mut buffer.slice_mut(..bytes)),
                )?;
            }
        }
        cache.first = first;
        Ok(())
    }

    /// Appends `n` rows of keys and values (`[n, width]` each, f32),
    /// encoded as the cache's type. While a decode step is being recorded
    /// the rows go where the step's row word (on the device) says, so that
    /// replays append too.
    pub(super) fn kv_append(
        &self,
        cache: &mut KvCache,
        keys: &CudaSlice<f32>,
        values: &CudaSlice<f32>,
        n: usize,
    ) -> Result<()> {
        assert!(
            !cache.shape.latent,
            "kv_append: a latent cache holds no values"
        );
        let len = cache.len();
        self.kv_reserve(cache, n)?;
        let width = cache.width();
        let position = self.recorded_row(cache, n);
        let (width_l, n_i, start) = (long(width), int(n, "tokens"), long(cache.held()));
        let [cache_keys, key_scales, cache_values, value_scales] = &mut cache.planes;
        launch!(
            self,
            "kv_store",
            &self.kernels.kv(cache.kv).kv_store,
            grid_stride(n * width),
            cache_keys,
            key_scales,
            cache_values,
            value_scales,
            keys,
            values,
            &width_l,
            &n_i,
            &start,
            &position
        );
        cache.set_len(len + n);
        Ok(())
    }

    /// Makes room for `n` more positions and claims them for keys and
    /// values (or latents) that the caller's kernel stores itself (the
    /// one-token attention kernel and multi-head latent attention do):
    /// returns the cache row of the first, and the device word of a
    /// recorded step's row as [`CudaBackend::kv_append`] registers it.
    pub(super) fn kv_claim(&self, cache: &mut KvCache, n: usize) -> Result<(usize, u64)> {
        let len = cache.len();
        self.kv_reserve(cache, n)?;
        let position = self.recorded_row(cache, n);
        let row = cache.held();
        cache.set_len(len + n);
        Ok((row, position))
    }

    /// Makes room for one more position in each cache and counts it;
    /// returns each cache's position before, for kernels that store the
    /// new keys and values themselves (a decode step of several sequences,
    /// which reads them from the device when recorded).
    pub(super) fn kv_claim_each(&self, caches: &mut [&mut KvCache]) -> Result<Vec<i64>> {
        caches
            .iter_mut()
            .map(|cache| {
                let len = cache.len();
                self.kv_reserve(cache, 1)?;
                self.recorded_append(cache);
                let row = cache.held();
                cache.set_len(len + 1);
                Ok(row as i64)
            })
            .collect()
    }

    pub(super) fn kv_truncate_to(&self, cache: &mut KvCache, len: usize) {
        assert!(
            len >= cache.first,
            "a sliding-window cache cannot be cut back before its first held position"
        );
        cache.set_len(cache.len().min(len));
    }

    /// The positions a later query can see (a sliding window's newest, as
    /// the CPU holds them), in the cache's encoding.
    pub(super) fn kv_to_host(&self, cache: &KvCache) -> Result<HostKv> {
        let len = cache.len();
        let first = len - cache.shape.retained(len).min(cache.held());
        let (skip, valid) = (first - cache.first, len - first);
        let op = "saving a KV cache";
        let rows = cache.row_bytes();
        let mut bytes = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for ((plane, row), out) in cache.planes.iter().zip(rows).zip(&mut bytes) {
            if valid * row > 0 {
                let from = skip * row;
                *out = ok(
                    op,
                    self.stream
                        .clone_dtoh(&plane.slice(from..from + valid * row)),
                )?;
            }
        }
        ok(op, self.stream.synchronize())?;
        let [keys, key_scales, values, value_scales] = bytes;
        let values_held = match cache.shape.latent {
            true => 0,
            false => valid * cache.width(),
        };
        Ok(HostKv {
            first,
            keys: host_rows(cache.kv, valid * cache.width(), keys, key_scales),
            values: host_rows(cache.kv, values_held, values, value_scales),
        })
    }

    pub(super) fn kv_from_host(&self, shape: AttentionShape, host: HostKv) -> Result<KvCache> {
        let kv = host.keys.kv_type();
        let width = shape.num_kv_heads * shape.head_dim;
        let held = host.keys.len() / width;
        let mut cache = self.kv_new(shape, kv)?;
        self.kv_reserve(&mut cache, held)?;
        cache.first = host.first;
        let rows = cache.row_bytes();
        let mut sides = [host.keys, host.values].into_iter().flat_map(|side| {
            let mut bytes = Vec::new();
            side.write_bytes(&mut bytes);
            let scales = bytes.split_off(kv.value_bytes() * side.len());
            [bytes, scales]
        });
        for (plane, row) in cache.planes.iter_mut().zip(rows) {
            let bytes = sides.next().expect("four planes");
            if row > 0 && !bytes.is_empty() {
                assert_eq!(bytes.len(), held * row, "KV import: rows of the planes");
                ok(
                    "loading a KV cache",
                    self.stream
                        .memcpy_htod(&bytes, &mut plane.slice_mut(..bytes.len())),
                )?;
            }
        }
        cache.set_len(host.first + held);
        Ok(cache)
    }

    pub(super) fn linear_new(&self, cfg: &LinearAttentionConfig) -> Result<DeltaNetState> {
        let (conv_len, recurrent_len) = linear_sizes(cfg);
        Ok(DeltaNetState {
            conv: self.zeros("new Gated DeltaNet state", conv_len)?,
            recurrent: self.zeros("new Gated DeltaNet state", recurrent_len)?,
            conv_len,
            recurrent_len,
        })
    }

    pub(super) fn linear_clone(&self, state: &DeltaNetState) -> Result<DeltaNetState> {
        let copy = |src: &CudaSlice<f32>, len: usize| {
            let mut dst = self.alloc::<f32>("copying a Gated DeltaNet state", len)?;
            if len > 0 {
                ok(
                    "copying a Gated DeltaNet state",
                    self.stream
                        .memcpy_dtod(&src.slice(..len), &mut dst.slice_mut(..len)),
                )?;
            }
            Ok(dst)
        };
        Ok(DeltaNetState {
            conv: copy(&state.conv, state.conv_len)?,
            recurrent: copy(&state.recurrent, state.recurrent_len)?,
            conv_len: state.conv_len,
            recurrent_len: state.recurrent_len,
        })
    }

    pub(super) fn linear_to_host(&self, state: &DeltaNetState) -> Result<HostDeltaNetState> {
        Ok(HostDeltaNetState {
            conv: self.download("saving a Gated DeltaNet state", &state.conv, state.conv_len)?,
            recurrent: self.download(
                "saving a Gated DeltaNet state",
                &state.recurrent,
                state.recurrent_len,
            )?,
        })
    }

    pub(super) fn linear_from_host(
        &self,
        cfg: &LinearAttentionConfig,
        host: HostDeltaNetState,
    ) -> Result<DeltaNetState> {
        let (conv_len, recurrent_len) = linear_sizes(cfg);
        assert!(
            host.conv.len() == conv_len && host.recurrent.len() == recurrent_len,
            "Gated DeltaNet state import: sizes {} and {} do not match the layer's {conv_len} and {recurrent_len}",
            host.conv.len(),
            host.recurrent.len()
        );
        Ok(DeltaNetState {
            conv: self.upload("loading a Gated DeltaNet state", &host.conv)?,
            recurrent: self.upload("loading a Gated DeltaNet state", &host.recurrent)?,
            conv_len,
            recurrent_len,
        })
    }
}

/// Rows of `len` values of type `kv` from a cache's planes: the values'
/// bytes and their scales' (q8; empty for the other types).
fn host_rows(kv: KvType, len: usize, mut values: Vec<u8>, scales: Vec<u8>) -> KvRows {
    values.extend(scales);
    KvRows::read_bytes(kv, len, &values)
        .expect("a cache's planes hold whole rows")
        .0
}
