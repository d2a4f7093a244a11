//! NCCL, loaded at run time like the CUDA driver: the collectives that
//! move a MoE layer's activations between the GPUs of one process
//! (parallel.rs). The binary runs without NCCL; only `--device cuda:0,1`
//! needs it, and says so when it is missing.
//!
//! The library is looked up by its runtime name (`libnccl.so.2`, which
//! the NCCL packages and the `nvidia-nccl` wheels install) and its
//! development name (`libnccl.so`), on the loader's search path.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaStream;

use crate::error::{Error, Result};

/// `ncclComm_t`.
type RawComm = *mut c_void;
/// `ncclResult_t`; 0 is success.
type Status = c_int;

/// `ncclUint8`: broadcasts copy bytes.
const UINT8: c_int = 1;
/// `ncclFloat32`: reductions sum f32 values.
const FLOAT32: c_int = 7;

/// `ncclSum`.
const SUM: c_int = 0;

/// The library names tried, in order.
const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

struct Library {
    _lib: libloading::Library,
    comm_init_all: unsafe extern "C" fn(*mut RawComm, c_int, *const c_int) -> Status,
    comm_destroy: unsafe extern "C" fn(RawComm) -> Status,
    group_start: unsafe extern "C" fn() -> Status,
    group_end: unsafe extern "C" fn() -> Status,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        *mut c_void,
    ) -> Status,
    reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        RawComm,
        *mut c_void,
    ) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    version: unsafe extern "C" fn(*mut c_int) -> Status,
}

// SAFETY: the function pointers are plain C entry points of a library kept
// loaded for the life of the process; NCCL's calls may come from any thread.
unsafe impl Send for Library {}
unsafe impl Sync for Library {}

fn library() -> Result<&'static Library> {
    static LIB: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let mut tried = Vec::new();
        for name in NAMES {
            // SAFETY: loading NCCL runs its initialisers, which only set up
            // the library itself.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => return load_symbols(lib).map_err(|e| format!("{name}: {e}")),
                Err(e) => tried.push(format!("{name}: {e}")),
            }
        }
        Err(tried.join("; "))
    })
    .as_ref()
    .map_err(|why| {
        Error::invalid(
            "--device",
            format!(
                "several GPUs exchange activations through NCCL, which could not be loaded \
                 ({why}); install it (Debian/Ubuntu: libnccl2; pip: nvidia-nccl-cu13) and put \
                 the folder holding libnccl.so.2 on LD_LIBRARY_PATH, or use one GPU"
            ),
        )
    })
}

fn load_symbols(lib: libloading::Library) -> std::result::Result<Library, libloading::Error> {
    // SAFETY: each symbol is looked up with NCCL's own C signature (nccl.h,
    // 2.x); the pointers stay valid while `_lib` is loaded.
    unsafe {
        Ok(Library {
            comm_init_all: *lib.get(b"ncclCommInitAll\0")?,
            comm_destroy: *lib.get(b"ncclCommDestroy\0")?,
            group_start: *lib.get(b"ncclGroupStart\0")?,
            group_end: *lib.get(b"ncclGroupEnd\0")?,
            broadcast: *lib.get(b"ncclBroadcast\0")?,
            reduce: *lib.get(b"ncclReduce\0")?,
            error_string: *lib.get(b"ncclGetErrorString\0")?,
            version: *lib.get(b"ncclGetVersion\0")?,
            _lib: lib,
        })
    }
}

fn check(lib: &Library, what: &str, status: Status) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: NCCL returns a static, NUL-terminated string for any status.
    let text = unsafe { CStr::from_ptr((lib.error_string)(status)) };
    Err(Error::Device {
        device: "NCCL".into(),
        msg: format!("{what}: {} (status {status})", text.to_string_lossy()),
    })
}

/// NCCL's version as `major.minor.patch`.
pub(super) fn version() -> Result<String> {
    let lib = library()?;
    let mut code: c_int = 0;
    // SAFETY: writes one int.
    check(lib, "reading the version", unsafe {
        (lib.version)(&mut code)
    })?;
    let code = code as u32;
    Ok(match code >= 10_000 {
        true => format!("{}.{}.{}", code / 10_000, code / 100 % 100, code % 100),
        false => format!("{}.{}.{}", code / 1000, code / 100 % 10, code % 100),
    })
}

/// One rank's communicator, with the stream its collectives run on (the
/// rank's compute stream, so they are ordered with its kernels).
pub(super) struct Comm {
    raw: RawComm,
    stream: Arc<CudaStream>,
}

// SAFETY: a communicator is used by one thread at a time (the caller of
// the collectives below holds the backend), which NCCL allows.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    /// Communicators for the devices of `streams`, rank i on `streams[i]`'s
    /// device, all in this process.
    pub(super) fn for_streams(streams: &[Arc<CudaStream>]) -> Result<Vec<Comm>> {
        let lib = library()?;
        let devices: Vec<c_int> = streams
            .iter()
            .map(|s| s.context().ordinal() as c_int)
            .collect();
        let mut raw = vec![std::ptr::null_mut(); streams.len()];
        // SAFETY: `raw` has room for one communicator per device listed.
        check(lib, "creating the communicators", unsafe {
            (lib.comm_init_all)(raw.as_mut_ptr(), devices.len() as c_int, devices.as_ptr())
        })?;
        Ok(raw
            .into_iter()
            .zip(streams)
            .map(|(raw, stream)| Comm {
                raw,
                stream: stream.clone(),
            })
            .collect())
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if let Ok(lib) = library() {
            // SAFETY: the communicator was created by ncclCommInitAll and
            // is destroyed once; a failure leaves nothing to clean up.
            unsafe { (lib.comm_destroy)(self.raw) };
        }
    }
}

/// The collectives of one step over every rank, issued from one thread:
/// NCCL requires them grouped (`ncclGroupStart` ... `ncclGroupEnd`).
pub(super) struct Group {
    lib: &'static Library,
    ended: bool,
}

impl Group {
    pub(super) fn start() -> Result<Group> {
        let lib = library()?;
        // SAFETY: no arguments.
        check(lib, "starting a group", unsafe { (lib.group_start)() })?;
        Ok(Group { lib, ended: false })
    }

    /// `bytes` bytes at `data` broadcast from rank `root`: the root's are
    /// sent, every other rank's overwritten.
    ///
    /// # Safety
    /// `data` is a device address on `comm`'s device valid for `bytes`
    /// bytes until the work queued on `comm`'s stream is done.
    pub(super) unsafe fn broadcast(
        &self,
        comm: &Comm,
        data: u64,
        bytes: usize,
        root: usize,
    ) -> Result<()> {
        let ptr = data as *mut c_void;
        // SAFETY: as the caller promises; in place (send = receive buffer).
        check(self.lib, "broadcasting activations", unsafe {
            (self.lib.broadcast)(
                ptr,
                ptr,
                bytes,
                UINT8,
                root as c_int,
                comm.raw,
                comm.stream.cu_stream() as *mut c_void,
            )
        })
    }

    /// The sum over ranks of `count` f32 values of `data` into the root's
    /// `data`.
    ///
    /// # Safety
    /// As [`Group::broadcast`].
    pub(super) unsafe fn reduce_sum(
        &self,
        comm: &Comm,
        data: u64,
        count: usize,
        root: usize,
    ) -> Result<()> {
        let ptr = data as *mut c_void;
        // SAFETY: as the caller promises; in place on the root, which NCCL
        // allows, and the others' buffers are only read.
        check(self.lib, "summing partial expert outputs", unsafe {
            (self.lib.reduce)(
                ptr,
                ptr,
                count,
                FLOAT32,
                SUM,
                root as c_int,
                comm.raw,
                comm.stream.cu_stream() as *mut c_void,
            )
        })
    }

    /// Ends the group: its collectives are queued on their streams.
    pub(super) fn end(mut self) -> Result<()> {
        self.ended = true;
        // SAFETY: no arguments.
        check(self.lib, "ending a group", unsafe {
            (self.lib.group_end)()
        })
    }
}

impl Drop for Group {
    /// A group left by an error is still ended, so NCCL's state stays
    /// consistent for the next step.
    fn drop(&mut self) {
        if !self.ended {
            // SAFETY: no arguments.
            unsafe { (self.lib.group_end)() };
        }
    }
}
