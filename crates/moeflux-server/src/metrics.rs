//! `GET /metrics`: counters, gauges and histograms in Prometheus' text
//! format (version 0.0.4), written by the engine and the HTTP handlers.

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use moeflux::experts::ExpertStats;

/// A count that only grows.
#[derive(Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }

    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }
}

/// A value that goes up and down.
#[derive(Default)]
pub struct Gauge(AtomicI64);

impl Gauge {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    pub fn dec(&self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn set(&self, v: i64) {
        self.0.store(v, Ordering::Relaxed);
    }

    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Observations counted into cumulative buckets.
pub struct Histogram {
    bounds: &'static [f64],
    state: Mutex<HistogramState>,
}

#[derive(Default)]
struct HistogramState {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            state: Mutex::new(HistogramState {
                counts: vec![0; bounds.len()],
                ..HistogramState::default()
            }),
        }
    }

    pub fn observe(&self, v: f64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            s.counts[i] += 1;
        }
        s.sum += v;
        s.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, n) in self.bounds.iter().zip(&s.counts) {
            cumulative += n;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", s.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", s.sum, s.count);
    }
}

const LATENCY: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const SEQUENCES: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// Everything `/metrics` reports.
pub struct Metrics {
    pub requests: Counter,
    pub requests_finished: Counter,
    pub cancelled: Counter,
    pub rejected: Counter,
    pub client_errors: Counter,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    pub prefix_hits: Counter,
    pub prefix_tokens: Counter,
    pub prefix_cache_bytes: Gauge,
    pub draft_checks: Counter,
    pub drafted_tokens: Counter,
    pub accepted_drafts: Counter,
    pub queued: Gauge,
    pub running: Gauge,
    pub kv_reserved: Gauge,
    pub kv_in_use: Gauge,
    pub batch_sequences: Histogram,
    pub step_seconds: Histogram,
    pub queue_seconds: Histogram,
    pub ttft_seconds: Histogram,
    pub inter_token_seconds: Histogram,
    expert_hits: Counter,
    expert_misses: Counter,
    expert_bytes_read: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Counter::default(),
            requests_finished: Counter::default(),
            cancelled: Counter::default(),
            rejected: Counter::default(),
            client_errors: Counter::default(),
            prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            prefix_hits: Counter::default(),
            prefix_tokens: Counter::default(),
            prefix_cache_bytes: Gauge::default(),
            draft_checks: Counter::default(),
            drafted_tokens: Counter::default(),
            accepted_drafts: Counter::default(),
            queued: Gauge::default(),
            running: Gauge::default(),
            kv_reserved: Gauge::default(),
            kv_in_use: Gauge::default(),
            batch_sequences: Histogram::new(SEQUENCES),
            step_seconds: Histogram::new(LATENCY),
            queue_seconds: Histogram::new(LATENCY),
            ttft_seconds: Histogram::new(LATENCY),
            inter_token_seconds: Histogram::new(LATENCY),
            expert_hits: Counter::default(),
            expert_misses: Counter::default(),
            expert_bytes_read: Counter::default(),
        }
    }
}

impl Metrics {
    /// The expert store's counters since the model was opened.
    pub fn record_experts(&self, stats: &ExpertStats) {
        self.expert_hits.set(stats.hits + stats.prefetch_waits);
        self.expert_misses.set(stats.misses);
        self.expert_bytes_read.set(stats.bytes_read);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let counters = [
            (
                "moeflux_requests_total",
                "Generation requests accepted into the queue.",
                &self.requests,
            ),
            (
                "moeflux_requests_finished_total",
                "Requests whose every choice ended.",
                &self.requests_finished,
            ),
            (
                "moeflux_requests_cancelled_total",
                "Requests whose client went away before the end.",
                &self.cancelled,
            ),
            (
                "moeflux_requests_rejected_total",
                "Requests refused with 429: the queue was full.",
                &self.rejected,
            ),
            (
                "moeflux_client_errors_total",
                "Requests answered with a 4xx error.",
                &self.client_errors,
            ),
            (
                "moeflux_prompt_tokens_total",
                "Prompt tokens read.",
                &self.prompt_tokens,
            ),
            (
                "moeflux_generation_tokens_total",
                "Tokens generated.",
                &self.generated_tokens,
            ),
            (
                "moeflux_prefix_cache_hits_total",
                "Requests that resumed from a kept session's checkpoint.",
                &self.prefix_hits,
            ),
            (
                "moeflux_prefix_cache_tokens_total",
                "Prompt tokens not read again thanks to prefix reuse.",
                &self.prefix_tokens,
            ),
            (
                "moeflux_draft_checks_total",
                "Forward passes of a sequence that checked drafted tokens (speculative decoding).",
                &self.draft_checks,
            ),
            (
                "moeflux_drafted_tokens_total",
                "Tokens drafted for checking.",
                &self.drafted_tokens,
            ),
            (
                "moeflux_draft_accepted_tokens_total",
                "Drafted tokens the model agreed with: decode steps saved.",
                &self.accepted_drafts,
            ),
            (
                "moeflux_expert_cache_hits_total",
                "Expert lookups found in the cache (or a read ahead).",
                &self.expert_hits,
            ),
            (
                "moeflux_expert_cache_misses_total",
                "Expert lookups read from disk on demand.",
                &self.expert_misses,
            ),
            (
                "moeflux_expert_bytes_read_total",
                "Bytes of experts read from disk.",
                &self.expert_bytes_read,
            ),
        ];
        for (name, help, c) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                c.get()
            );
        }
        let (hits, misses) = (self.expert_hits.get(), self.expert_misses.get());
        let rate = match hits + misses {
            0 => 0.0,
            total => hits as f64 / total as f64,
        };
        let acceptance = match self.drafted_tokens.get() {
            0 => 0.0,
            drafted => self.accepted_drafts.get() as f64 / drafted as f64,
        };
        let gauges = [
            (
                "moeflux_queue_depth",
                "Requests waiting to join the batch.",
                self.queued.get() as f64,
            ),
            (
                "moeflux_running_requests",
                "Requests in the batch.",
                self.running.get() as f64,
            ),
            (
                "moeflux_kv_reserved_bytes",
                "KV cache bytes reserved by running requests.",
                self.kv_reserved.get() as f64,
            ),
            (
                "moeflux_prefix_cache_bytes",
                "KV cache bytes of sessions kept for prefix reuse.",
                self.prefix_cache_bytes.get() as f64,
            ),
            (
                "moeflux_kv_in_use_bytes",
                "KV cache bytes held by sessions.",
                self.kv_in_use.get() as f64,
            ),
            (
                "moeflux_expert_cache_hit_rate",
                "Share of expert lookups served without a read.",
                rate,
            ),
            (
                "moeflux_draft_acceptance_rate",
                "Share of drafted tokens the model agreed with.",
                acceptance,
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        self.batch_sequences.write(
            &mut out,
            "moeflux_batch_sequences",
            "Sequences in one forward pass.",
        );
        self.step_seconds.write(
            &mut out,
            "moeflux_step_seconds",
            "Time of one batched forward pass and sampling.",
        );
        self.queue_seconds.write(
            &mut out,
            "moeflux_queue_seconds",
            "Time from arrival to joining the batch.",
        );
        self.ttft_seconds.write(
            &mut out,
            "moeflux_time_to_first_token_seconds",
            "Time from arrival to a request's first token.",
        );
        self.inter_token_seconds.write(
            &mut out,
            "moeflux_inter_token_seconds",
            "Time between two tokens of a choice.",
        );
        out
    }
}
