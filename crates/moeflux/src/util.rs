//! Small shared helpers.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment of expert buffers: a page, so reads can bypass the page cache
/// (`O_DIRECT`) and every matrix inside starts on a SIMD-friendly boundary.
pub const BUFFER_ALIGN: usize = 4096;

/// A zero-initialised heap buffer aligned to [`BUFFER_ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn zeroed(len: usize) -> AlignedBuf {
        if len == 0 {
            // A dangling but aligned pointer; never dereferenced for len 0.
            let ptr = NonNull::new(BUFFER_ALIGN as *mut u8).unwrap();
            return AlignedBuf { ptr, len };
        }
        let layout = Self::layout(len);
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }

    pub fn from_slice(data: &[u8]) -> AlignedBuf {
        let mut buf = AlignedBuf::zeroed(data.len());
        buf.copy_from_slice(data);
        buf
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, BUFFER_ALIGN).expect("buffer size overflows")
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `zeroed` with this exact layout.
            unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
        }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes (or len is 0).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len bytes and uniquely owned.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// A small seeded random number generator (SplitMix64): synthetic
/// weights, benchmark tokens and test data that are the same on every run.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Where moeflux keeps what it can rebuild (converted bundled model,
/// compiled GPU kernels): see [`crate::tuning::cache_dir`].
pub fn cache_dir() -> std::path::PathBuf {
    crate::tuning::cache_dir()
}

/// Hex form of a 64-bit checksum as stored in manifests.
pub fn hex64(v: u64) -> String {
    format!("{v:016x}")
}

pub fn parse_hex64(s: &str) -> Option<u64> {
    (s.len() == 16)
        .then(|| u64::from_str_radix(s, 16).ok())
        .flatten()
}

/// Human-readable byte count (binary units).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

/// Receives progress of long work (conversion, benchmarks); the CLI draws
/// a bar.
pub trait Progress: Sync {
    /// `total` units of work are ahead.
    fn start(&self, _total: u64) {}
    /// `done` more units were completed; `what` names the current step.
    fn advance(&self, _done: u64, _what: &str) {}
    fn finish(&self) {}
    /// A line for the user about the work (a wait, a choice made).
    fn note(&self, _text: &str) {}
}

/// Reports nothing.
pub struct NoProgress;
impl Progress for NoProgress {}

/// Parses a JSON file that may be absent.
pub(crate) fn read_json_if_present(
    path: &std::path::Path,
) -> crate::error::Result<Option<(std::path::PathBuf, serde_json::Value)>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(crate::error::Error::io(path, "reading", e)),
    };
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| crate::error::Error::bad_file(path, format!("malformed JSON: {e}")))?;
    if !value.is_object() {
        return Err(crate::error::Error::bad_file(
            path,
            "expected a JSON object at the top",
        ));
    }
    Ok(Some((path.to_path_buf(), value)))
}
