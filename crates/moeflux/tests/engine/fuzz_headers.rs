//! Fuzzing of the parsers that read untrusted headers: GGUF's
//! (`GgufFile::validate`) and safetensors' (`validate_safetensors`, what a
//! conversion runs on every shard). Each target runs for a bounded time
//! (`MOEFLUX_FUZZ_SECONDS`, default 3) on inputs derived from valid files:
//! bytes overwritten, count and length fields replaced by extreme values,
//! runs inserted, deleted and duplicated, files truncated and spliced;
//! and on files generated from random parameters (the property half:
//! every well-formed generated file parses).
//!
//! No input may panic, and a parse may never hold more memory at once than
//! [`ALLOCATION_FACTOR`] times the input's size plus [`ALLOCATION_SLACK`]
//! (a counting allocator measures the parsing thread): a count or length
//! field alone never makes it allocate, whatever it claims. A failure
//! prints the input's seed and iteration and writes the input to the
//! temporary folder.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use moeflux::convert::checkpoint::validate_safetensors;
use moeflux::convert::gguf::GgufFile;
use moeflux::util::SplitMix64;

/// Counts the bytes allocated by the thread that turned tracking on.
struct Counting;

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    let _ = TRACKING.try_with(|on| {
        if on.get() {
            let live = LIVE.get() + delta;
            LIVE.set(live);
            PEAK.set(PEAK.get().max(live));
        }
    });
}

// SAFETY: every call is forwarded to the system allocator; the counters
// are const-initialised thread locals, which allocate nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        // SAFETY: forwarded.
        unsafe { System.dealloc(p, layout) };
        note(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, size: usize) -> *mut u8 {
        // SAFETY: forwarded.
        let q = unsafe { System.realloc(p, layout, size) };
        if !q.is_null() {
            note(size as isize - layout.size() as isize);
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A parse may hold this many times its input's size at once: each byte
/// of a header becomes at most a few words of parsed values (a
/// safetensors shape element of two bytes, `0,`, is an 8-byte integer; a
/// GGUF string of one byte a `String` and its entry).
const ALLOCATION_FACTOR: usize = 16;
/// Plus this much: error messages, the parsers' fixed tables.
const ALLOCATION_SLACK: usize = 64 << 10;

/// Runs `parse` on `input`: whether it panicked, and the most memory it
/// held at once.
fn run(parse: fn(&[u8], &Path) -> bool, input: &[u8]) -> (bool, usize) {
    LIVE.set(0);
    PEAK.set(0);
    TRACKING.set(true);
    let outcome =
        std::panic::catch_unwind(|| parse(input, Path::new("fuzzed"))).map_err(std::mem::drop);
    TRACKING.set(false);
    (outcome.is_err(), PEAK.get().max(0) as usize)
}

/// Values that break length and count arithmetic.
const EXTREMES: [u64; 14] = [
    0,
    1,
    2,
    0x7f,
    0xff,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    1 << 62,
    i64::MAX as u64,
    u64::MAX,
];

/// One random change to `input`, mostly within its first `focus` bytes
/// (the header).
fn mutate(rng: &mut SplitMix64, input: &mut Vec<u8>, focus: usize, seeds: &[Vec<u8>]) {
    let below = |rng: &mut SplitMix64, n: usize| (rng.next_u64() % n.max(1) as u64) as usize;
    let focus = focus.clamp(1, input.len().max(1));
    match rng.next_u64() % 7 {
        0 => {
            for _ in 0..1 + below(rng, 4) {
                if !input.is_empty() {
                    let at = below(rng, focus);
                    input[at] = rng.next_u64() as u8;
                }
            }
        }
        1 => {
            let value = match rng.next_u64() % 3 {
                0 => EXTREMES[below(rng, EXTREMES.len())],
                1 => input.len() as u64 + below(rng, 3) as u64,
                _ => (input.len() as u64).wrapping_mul(8),
            };
            let width = if rng.next_u64().is_multiple_of(2) {
                4
            } else {
                8
            };
            let at = below(rng, focus);
            let bytes = value.to_le_bytes();
            for (i, &b) in bytes[..width].iter().enumerate() {
                if let Some(slot) = input.get_mut(at + i) {
                    *slot = b;
                }
            }
        }
        2 => {
            let at = below(rng, focus + 1).min(input.len());
            let run: Vec<u8> = (0..1 + below(rng, 16))
                .map(|_| rng.next_u64() as u8)
                .collect();
            input.splice(at..at, run);
        }
        3 => {
            let at = below(rng, focus).min(input.len());
            let end = (at + 1 + below(rng, 32)).min(input.len());
            input.drain(at..end);
        }
        4 => input.truncate(below(rng, input.len() + 1)),
        5 => {
            let other = &seeds[below(rng, seeds.len())];
            let (cut, from) = (below(rng, input.len() + 1), below(rng, other.len() + 1));
            input.truncate(cut);
            input.extend_from_slice(&other[from..]);
        }
        _ => {
            let at = below(rng, focus).min(input.len());
            let end = (at + 1 + below(rng, 64)).min(input.len());
            let copy = input[at..end].to_vec();
            let to = below(rng, input.len() + 1);
            input.splice(to..to, copy);
        }
    }
}

/// How long each target runs.
fn budget() -> Duration {
    let seconds = std::env::var("MOEFLUX_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(3.0);
    Duration::from_secs_f64(seconds)
}

/// Fuzzes `parse` from `seeds` (each with the size of its header, where
/// mutations concentrate) and from `generate`d files for the time budget;
/// returns how many inputs ran and how many parsed.
fn fuzz(
    name: &str,
    parse: fn(&[u8], &Path) -> bool,
    seeds: &[(Vec<u8>, usize)],
    generate: fn(&mut SplitMix64) -> Vec<u8>,
) -> (usize, usize) {
    let seed = 0x5eed_0000 + name.len() as u64;
    let mut rng = SplitMix64(seed);
    let corpus: Vec<Vec<u8>> = seeds.iter().map(|(s, _)| s.clone()).collect();
    let deadline = Instant::now() + budget();
    let (mut runs, mut parsed) = (0, 0);
    while Instant::now() < deadline {
        let generated = runs % 4 == 3;
        let (mut input, focus) = if generated {
            let file = generate(&mut rng);
            // Every generated file is well formed: it must parse.
            let (panicked, _) = run(parse, &file);
            assert!(!panicked, "{name}: a generated file panicked");
            assert!(
                parse(&file, Path::new("generated")),
                "{name}: a well-formed generated file was refused (seed {seed:#x}, run {runs})"
            );
            let focus = file.len();
            (file, focus)
        } else {
            let (s, focus) = &seeds[runs % seeds.len()];
            (s.clone(), *focus)
        };
        for _ in 0..1 + rng.next_u64() % 4 {
            mutate(&mut rng, &mut input, focus, &corpus);
        }
        let (panicked, peak) = run(parse, &input);
        let limit = ALLOCATION_FACTOR * input.len() + ALLOCATION_SLACK;
        if panicked || peak > limit {
            let path = std::env::temp_dir().join(format!("moeflux-fuzz-{name}-{runs}.bin"));
            std::fs::write(&path, &input).unwrap();
            panic!(
                "{name}: input {} (seed {seed:#x}, run {runs}, {} bytes) {}",
                path.display(),
                input.len(),
                if panicked {
                    "panicked".to_string()
                } else {
                    format!("held {peak} bytes at once, over {limit}")
                }
            );
        }
        parsed += usize::from(parse(&input, Path::new("fuzzed")));
        runs += 1;
    }
    println!("{name}: {runs} inputs in {:?}, {parsed} parsed", budget());
    (runs, parsed)
}

fn gguf_ok(bytes: &[u8], path: &Path) -> bool {
    GgufFile::validate(bytes, path).is_ok()
}

fn safetensors_ok(bytes: &[u8], path: &Path) -> bool {
    validate_safetensors(bytes, path).is_ok()
}

fn formats() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/formats")
}

/// A GGUF string: its u64 length, then its bytes.
fn gguf_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A well-formed GGUF v3 file from random parameters: metadata of every
/// value type (arrays of numbers and of strings among them) and f32 or
/// f16 tensors of one to four dimensions, aligned, their data present.
fn generate_gguf(rng: &mut SplitMix64) -> Vec<u8> {
    let mut header = b"GGUF".to_vec();
    header.extend(3u32.to_le_bytes());
    let tensors = (rng.next_u64() % 4) as usize;
    let kvs = (rng.next_u64() % 6) as usize;
    header.extend((tensors as u64).to_le_bytes());
    header.extend((kvs as u64).to_le_bytes());
    for k in 0..kvs {
        gguf_string(&mut header, &format!("fuzz.key{k}"));
        let kind = (rng.next_u64() % 13) as u32;
        header.extend(kind.to_le_bytes());
        let scalar = |rng: &mut SplitMix64, kind: u32, out: &mut Vec<u8>| match kind {
            0 | 1 => out.push(rng.next_u64() as u8),
            7 => out.push((rng.next_u64() % 2) as u8),
            2 | 3 => out.extend((rng.next_u64() as u16).to_le_bytes()),
            4..=6 => out.extend((rng.next_u64() as u32 & 0x3fff_ffff).to_le_bytes()),
            8 => gguf_string(out, &"ab".repeat((rng.next_u64() % 5) as usize)),
            _ => out.extend((rng.next_u64() & 0x3fff_ffff_ffff_ffff).to_le_bytes()),
        };
        if kind == 9 {
            let elem = [0u32, 4, 6, 8, 10][(rng.next_u64() % 5) as usize];
            let count = rng.next_u64() % 5;
            header.extend(elem.to_le_bytes());
            header.extend(count.to_le_bytes());
            for _ in 0..count {
                scalar(rng, elem, &mut header);
            }
        } else {
            scalar(rng, kind, &mut header);
        }
    }
    let mut offsets = Vec::new();
    let mut data = 0u64;
    for t in 0..tensors {
        gguf_string(&mut header, &format!("blk.{t}.weight"));
        let dims = 1 + (rng.next_u64() % 4) as u32;
        header.extend(dims.to_le_bytes());
        let mut elements = 1u64;
        for _ in 0..dims {
            let d = 1 + rng.next_u64() % 6;
            elements *= d;
            header.extend(d.to_le_bytes());
        }
        let (ty, width) = if rng.next_u64().is_multiple_of(2) {
            (0u32, 4)
        } else {
            (1, 2)
        };
        header.extend(ty.to_le_bytes());
        header.extend(data.to_le_bytes());
        offsets.push(data);
        data = (data + elements * width).next_multiple_of(32);
    }
    header.resize(header.len().next_multiple_of(32), 0);
    header.resize(header.len() + data as usize, 0);
    header
}

/// A well-formed safetensors file from random parameters: a few tensors
/// of common types and small shapes, their data present.
fn generate_safetensors(rng: &mut SplitMix64) -> Vec<u8> {
    use safetensors::tensor::{Dtype, TensorView};
    let count = (rng.next_u64() % 4) as usize;
    let tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = (0..count)
        .map(|i| {
            let (dtype, width) = [
                (Dtype::F32, 4),
                (Dtype::BF16, 2),
                (Dtype::U8, 1),
                (Dtype::F8_E4M3, 1),
            ][(rng.next_u64() % 4) as usize];
            let shape: Vec<usize> = (0..(rng.next_u64() % 4))
                .map(|_| 1 + (rng.next_u64() % 5) as usize)
                .collect();
            let bytes = vec![0u8; shape.iter().product::<usize>() * width];
            (format!("model.t{i}.weight"), dtype, shape, bytes)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// Headers of GGUF files the `gguf` package wrote, and the malformed corpus.
#[test]
fn gguf_headers_never_panic_or_overallocate() {
    let dir = formats().join("gguf");
    let mut seeds = Vec::new();
    for name in ["types.gguf", "qwen3_5_moe-00001-of-00002.gguf"] {
        let path = dir.join(name);
        let bytes = std::fs::read(&path).unwrap();
        let header = GgufFile::open(&path)
            .unwrap()
            .tensors()
            .iter()
            .map(|t| t.start)
            .min()
            .unwrap_or(bytes.len());
        seeds.push((bytes, header));
    }
    for entry in std::fs::read_dir(dir.join("malformed")).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        let len = bytes.len();
        seeds.push((bytes, len));
    }
    let (runs, parsed) = fuzz("gguf", gguf_ok, &seeds, generate_gguf);
    assert!(runs >= 200, "only {runs} inputs ran");
    assert!(
        parsed > 0,
        "no fuzzed GGUF parsed: the mutations never left a file whole"
    );
}

/// safetensors files as transformers writes them (small ones made here)
/// and the fixtures' headers.
#[test]
fn safetensors_headers_never_panic_or_overallocate() {
    let mut rng = SplitMix64(7);
    let mut seeds: Vec<(Vec<u8>, usize)> = (0..8)
        .map(|_| {
            let file = generate_safetensors(&mut rng);
            let header = 8 + u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
            (file, header)
        })
        .collect();
    let fixture = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_moe/hf/model.safetensors"),
    )
    .unwrap();
    let header = 8 + u64::from_le_bytes(fixture[..8].try_into().unwrap()) as usize;
    seeds.push((fixture[..header].to_vec(), header));
    let (runs, parsed) = fuzz("safetensors", safetensors_ok, &seeds, generate_safetensors);
    assert!(runs >= 200, "only {runs} inputs ran");
    assert!(parsed > 0, "no fuzzed safetensors file parsed");
}

/// The allocation bound holds where a length field claims more than the
/// file has: such inputs are refused before anything is allocated for
/// them.
#[test]
fn claimed_lengths_allocate_nothing() {
    // A GGUF whose first key claims 2^40 bytes, and one claiming 2^60
    // metadata entries.
    let mut key = b"GGUF".to_vec();
    key.extend(3u32.to_le_bytes());
    key.extend(0u64.to_le_bytes());
    key.extend(1u64.to_le_bytes());
    key.extend((1u64 << 40).to_le_bytes());
    let mut entries = b"GGUF".to_vec();
    entries.extend(3u32.to_le_bytes());
    entries.extend(0u64.to_le_bytes());
    entries.extend((1u64 << 60).to_le_bytes());
    // A safetensors file whose header claims 2^40 bytes.
    let mut st = (1u64 << 40).to_le_bytes().to_vec();
    st.extend(b"{}");
    for (parse, input) in [
        (gguf_ok as fn(&[u8], &Path) -> bool, key),
        (gguf_ok, entries),
        (safetensors_ok, st),
    ] {
        let (panicked, peak) = run(parse, &input);
        assert!(!panicked && !parse(&input, Path::new("claims")));
        assert!(peak <= ALLOCATION_SLACK, "held {peak} bytes");
    }
    // The counter sees what a parse holds.
    let (_, peak) = run(
        |bytes, _| !std::hint::black_box(vec![1u8; 1000 * bytes.len()]).is_empty(),
        &[0u8; 100],
    );
    assert!(peak >= 100_000, "{peak}");
}
