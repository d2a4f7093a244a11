//! Recorded decode steps (CUDA graphs). With every expert resident a
//! decode step is several hundred small launches whose cost is the host's
//! work of issuing them, not the GPU's. So the second step over a
//! sequence's state buffers is captured into a graph, and later steps
//! replay it: the token and the position are written to two device words
//! the recorded kernels read (embed, q/k RoPE, KV store, attention), and
//! the KV caches' lengths are advanced here, as the recorded code would
//! have.
//!
//! A recording bakes in the addresses of the state buffers (KV caches,
//! Gated DeltaNet states) and every weight, so it is keyed by the state:
//! a KV cache that grows to new buffers, or another session, gets its own.
//! Replays compute exactly what the recorded code computes: the same
//! kernels with the same arguments.
//!
//! `MOEFLUX_CUDA_GRAPHS=0` turns recording off (and so does profiling,
//! which times each launch).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, DevicePtr, DevicePtrMut};

use super::{CudaBackend, KvCache, LinearState, Tensor, ok};
use crate::error::Result;

/// Recordings kept (one per live sequence, typically).
const MAX_RECORDINGS: usize = 8;

/// The device words a step being recorded reads its inputs from, and the
/// KV caches it appends to.
pub(super) struct Capture {
    token: u64,
    position: u64,
    kv_lens: Vec<Arc<AtomicUsize>>,
}

struct Recording {
    graph: CudaGraph,
    token: CudaSlice<u32>,
    position: CudaSlice<u32>,
    logits: CudaSlice<f32>,
    kv_lens: Vec<Arc<AtomicUsize>>,
}

// SAFETY: a recording is only touched under the backend's mutex, and the
// graph's handles are usable from any thread of the context.
unsafe impl Send for Recording {}

#[derive(Default)]
pub(super) struct Recordings {
    by_key: HashMap<u64, Recording>,
    /// Keys by age, oldest first.
    order: VecDeque<u64>,
    /// Keys seen once: a step is recorded the second time its state is
    /// seen, after one ordinary step has created what the first use of a
    /// state creates (rotary tables, say).
    seen: HashSet<u64>,
}

pub(super) fn enabled_by_env() -> bool {
    std::env::var_os("MOEFLUX_CUDA_GRAPHS").is_none_or(|v| v != "0")
}

impl CudaBackend {
    /// The device word holding the position of the step being recorded,
    /// registering `kv_len` (a KV cache it appends to); 0 (no word) when
    /// nothing is being recorded.
    pub(super) fn recorded_position(&self, kv_len: Option<&Arc<AtomicUsize>>) -> u64 {
        let mut capture = self.capture.lock().unwrap();
        match capture.as_mut() {
            None => 0,
            Some(capture) => {
                if let Some(len) = kv_len {
                    capture.kv_lens.push(len.clone());
                }
                capture.position
            }
        }
    }

    /// The device word holding the token of the step being recorded.
    pub(super) fn recorded_token(&self) -> Option<u64> {
        self.capture.lock().unwrap().as_ref().map(|c| c.token)
    }

    pub(super) fn state_key(
        &self,
        kv: &mut [&mut KvCache],
        linear: &[&LinearState],
    ) -> Option<u64> {
        if !self.graphs_enabled {
            return None;
        }
        let mut key = xxhash_rust::xxh3::Xxh3::new();
        for cache in kv.iter_mut() {
            let len = cache.len();
            self.kv_reserve(cache, len + 1);
            for word in cache.identity(self) {
                key.update(&word.to_le_bytes());
            }
        }
        for state in linear {
            key.update(&state.conv.device_ptr(&self.stream).0.to_le_bytes());
            key.update(&state.recurrent.device_ptr(&self.stream).0.to_le_bytes());
        }
        Some(key.digest())
    }

    /// Sets a recording's token and position words. Memsets, not copies:
    /// they need no host buffer and are queued like kernels.
    fn set_step_inputs(
        &self,
        token_word: &mut CudaSlice<u32>,
        position_word: &mut CudaSlice<u32>,
        token: u32,
        position: usize,
    ) {
        let op = "setting a recorded step's inputs";
        let position = u32::try_from(position)
            .unwrap_or_else(|_| panic!("{op}: position {position} exceeds 32 bits"));
        for (word, value) in [(token_word, token), (position_word, position)] {
            let (ptr, _sync) = word.device_ptr_mut(&self.stream);
            // SAFETY: one 32-bit word at a live device allocation, on the
            // backend's stream.
            ok(op, unsafe {
                cudarc::driver::sys::cuMemsetD32Async(ptr, value, 1, self.stream.cu_stream())
                    .result()
            });
        }
    }

    /// A fresh device copy of a recording's logits.
    fn copy_logits(&self, logits: &CudaSlice<f32>) -> Tensor {
        let mut out = self.tensor("recorded step", 1, logits.len());
        ok(
            "recorded step",
            self.stream.memcpy_dtod(logits, &mut out.data),
        );
        out
    }

    pub(super) fn replay(&self, key: u64, token: u32, position: usize) -> Option<Tensor> {
        let mut recordings = self.recordings.lock().unwrap();
        let recording = recordings.by_key.get_mut(&key)?;
        self.set_step_inputs(
            &mut recording.token,
            &mut recording.position,
            token,
            position,
        );
        ok("replaying a decode step", recording.graph.launch());
        for len in &recording.kv_lens {
            len.fetch_add(1, Ordering::Relaxed);
        }
        Some(self.copy_logits(&recording.logits))
    }

    pub(super) fn record(
        &self,
        key: u64,
        token: u32,
        position: usize,
        logits_len: usize,
        step: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor> {
        if self.recordings.lock().unwrap().seen.insert(key) {
            return step();
        }
        let op = "recording a decode step";
        let mut token_word = self.alloc::<u32>(op, 1);
        let mut position_word = self.alloc::<u32>(op, 1);
        let mut logits = self.alloc::<f32>(op, logits_len);
        self.set_step_inputs(&mut token_word, &mut position_word, token, position);
        *self.capture.lock().unwrap() = Some(Capture {
            token: token_word.device_ptr(&self.stream).0,
            position: position_word.device_ptr(&self.stream).0,
            kv_lens: Vec::new(),
        });
        ok(
            op,
            self.stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED),
        );
        let computed = step().map(|out| {
            assert_eq!(
                out.rows * out.cols,
                logits_len,
                "{op}: the step's logits are not {logits_len} values"
            );
            ok(op, self.stream.memcpy_dtod(&out.data, &mut logits));
        });
        let capture = self.capture.lock().unwrap().take().expect("set above");
        let graph = ok(op, self.stream.end_capture(CUgraphInstantiate_flags(0)));
        computed?;
        let graph = graph.unwrap_or_else(|| panic!("{op}: the capture recorded nothing"));
        ok(op, graph.launch());
        let out = self.copy_logits(&logits);
        let mut recordings = self.recordings.lock().unwrap();
        if recordings.by_key.len() >= MAX_RECORDINGS
            && let Some(oldest) = recordings.order.pop_front()
        {
            recordings.by_key.remove(&oldest);
        }
        recordings.order.push_back(key);
        recordings.by_key.insert(
            key,
            Recording {
                graph,
                token: token_word,
                position: position_word,
                logits,
                kv_lens: capture.kv_lens,
            },
        );
        Ok(out)
    }
}
