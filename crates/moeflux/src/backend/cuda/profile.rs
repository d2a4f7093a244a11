//! Device time per operation, for finding where a token's time goes: with
//! `MOEFLUX_CUDA_PROFILE=1` every launch is bracketed by timing events and
//! the totals per operation are printed to stderr when the backend is
//! dropped. Off by default: the events cost host time of their own.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

pub(super) struct Profiler {
    launches: Mutex<Vec<(String, CudaEvent, CudaEvent)>>,
    created: std::time::Instant,
}

impl Profiler {
    pub(super) fn from_env() -> Option<Profiler> {
        crate::tuning::cuda_profile().then(|| Profiler {
            launches: Mutex::new(Vec::new()),
            created: std::time::Instant::now(),
        })
    }

    fn event(stream: &CudaStream) -> CudaEvent {
        // Profiling is a developer's switch (MOEFLUX_CUDA_PROFILE); a
        // device that cannot record an event cannot be profiled.
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap_or_else(|e| panic!("profiling: recording an event: {e}"))
    }

    /// An event before a launch.
    pub(super) fn mark(&self, stream: &CudaStream) -> CudaEvent {
        Self::event(stream)
    }

    /// Records a launch of `op` that began at `start`.
    pub(super) fn record(&self, op: &str, start: CudaEvent, stream: &CudaStream) {
        let end = Self::event(stream);
        self.launches
            .lock()
            .unwrap()
            .push((op.to_string(), start, end));
    }

    /// Launches, device time and share per operation, most time first.
    pub(super) fn report(&self) -> String {
        let launches = std::mem::take(&mut *self.launches.lock().unwrap());
        let mut by_op: BTreeMap<String, (u64, f64)> = BTreeMap::new();
        let mut total = 0.0;
        for (op, start, end) in &launches {
            let ms = f64::from(start.elapsed_ms(end).unwrap_or(0.0));
            let entry = by_op.entry(op.clone()).or_default();
            entry.0 += 1;
            entry.1 += ms;
            total += ms;
        }
        let mut rows: Vec<_> = by_op.into_iter().collect();
        rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
        let mut out = format!(
            "CUDA profile: {} launches, {:.1} ms of kernels in {:.1} s since the backend started\n",
            launches.len(),
            total,
            self.created.elapsed().as_secs_f64()
        );
        for (op, (count, ms)) in rows {
            out += &format!(
                "  {op:<28} {count:>8} launches {ms:>10.2} ms {:>5.1}%  {:>7.2} us each\n",
                100.0 * ms / total.max(1e-9),
                1000.0 * ms / count as f64
            );
        }
        out
    }
}
