//! What differs between the operating systems moeflux runs on: reads past
//! the page cache, memory sizes and peak RSS. Linux and macOS have real
//! implementations; elsewhere files open buffered and the sizes are
//! unknown (`None`).

use std::fs::File;
use std::io;
use std::path::Path;

/// Opens `path` for reading past the page cache where the system allows:
/// `O_DIRECT` on Linux, `F_NOCACHE` on macOS. Some file systems (tmpfs)
/// refuse `O_DIRECT`; they have no disk to bypass, so a buffered open
/// serves the same purpose there.
#[cfg(target_os = "linux")]
pub(crate) fn open_uncached(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;

    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    options
        .clone()
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .or_else(|_| options.open(path))
}

/// Opens `path` for reading past the page cache where the system allows:
/// `O_DIRECT` on Linux, `F_NOCACHE` on macOS. A file whose `F_NOCACHE` is
/// refused stays buffered, as Linux falls back to for file systems that
/// refuse `O_DIRECT`.
#[cfg(target_os = "macos")]
pub(crate) fn open_uncached(path: &Path) -> io::Result<File> {
    use std::os::fd::AsRawFd;

    let file = File::open(path)?;
    // SAFETY: `fcntl` on a descriptor the file owns; F_NOCACHE takes an int.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) };
    Ok(file)
}

/// Opens `path` for reading (buffered: no way past the page cache is
/// known for this system).
#[cfg(not(any(target_os = "linux", target_os = "macos")))]
pub(crate) fn open_uncached(path: &Path) -> io::Result<File> {
    File::open(path)
}

/// Physical memory in bytes (Linux `MemTotal`, macOS `hw.memsize`).
#[cfg(target_os = "linux")]
pub(crate) fn physical_memory() -> Option<u64> {
    meminfo("MemTotal:")
}

/// Memory available to new allocations in bytes (Linux `MemAvailable`).
#[cfg(target_os = "linux")]
pub(crate) fn available_memory() -> Option<u64> {
    meminfo("MemAvailable:")
}

#[cfg(target_os = "linux")]
fn meminfo(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Physical memory in bytes (Linux `MemTotal`, macOS `hw.memsize`).
#[cfg(target_os = "macos")]
pub(crate) fn physical_memory() -> Option<u64> {
    let mut bytes = 0u64;
    let mut len = size_of::<u64>();
    // SAFETY: `hw.memsize` is a 64-bit integer, written into `bytes` whose
    // size `len` gives.
    let rc = unsafe {
        libc::sysctlbyname(
            c"hw.memsize".as_ptr(),
            (&raw mut bytes).cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    (rc == 0 && len == size_of::<u64>()).then_some(bytes)
}

/// Memory available to new allocations in bytes: on macOS the free and
/// inactive pages.
#[cfg(target_os = "macos")]
pub(crate) fn available_memory() -> Option<u64> {
    use std::sync::OnceLock;

    // One send right to the host port for the process (each call of
    // `mach_host_self` adds a reference to it).
    static HOST: OnceLock<libc::mach_port_t> = OnceLock::new();
    // SAFETY: a Mach trap without arguments. (libc would have the `mach2`
    // crate used for it; the function is the same.)
    #[allow(deprecated)]
    let host = *HOST.get_or_init(|| unsafe { libc::mach_host_self() });
    // SAFETY: a plain-data struct, which the call fills.
    let mut stats: libc::vm_statistics64 = unsafe { std::mem::zeroed() };
    let mut count = libc::HOST_VM_INFO64_COUNT;
    // SAFETY: `stats` holds `count` integers; the kernel writes at most
    // that many and lowers `count` to what it wrote.
    let rc = unsafe {
        libc::host_statistics64(
            host,
            libc::HOST_VM_INFO64,
            (&raw mut stats).cast(),
            &mut count,
        )
    };
    if rc != libc::KERN_SUCCESS {
        return None;
    }
    // SAFETY: a constant the system library sets before `main`.
    let page = unsafe { libc::vm_page_size } as u64;
    // Free + inactive pages (free_count includes speculative ones): the nearest match to MemAvailable.
    let (free, inactive) = (stats.free_count, stats.inactive_count);
    Some((free as u64 + inactive as u64) * page)
}

/// Physical memory in bytes: unknown on this system.
#[cfg(not(any(target_os = "linux", target_os = "macos")))]
pub(crate) fn physical_memory() -> Option<u64> {
    None
}

/// Memory available to new allocations: unknown on this system.
#[cfg(not(any(target_os = "linux", target_os = "macos")))]
pub(crate) fn available_memory() -> Option<u64> {
    None
}

/// The process's peak resident set size in bytes (Linux `VmHWM`).
#[cfg(target_os = "linux")]
pub(crate) fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The process's peak resident set size in bytes (macOS `getrusage`, whose
/// `ru_maxrss` is in bytes there, not KiB as on Linux).
#[cfg(target_os = "macos")]
pub(crate) fn peak_rss() -> Option<u64> {
    // SAFETY: a plain-data struct, which the call fills.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid `rusage` to write.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    (rc == 0).then_some(usage.ru_maxrss as u64)
}

/// The process's peak resident set size: unknown on this system.
#[cfg(not(any(target_os = "linux", target_os = "macos")))]
pub(crate) fn peak_rss() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_sizes_are_consistent() {
        if let (Some(total), Some(available)) = (physical_memory(), available_memory()) {
            assert!(total > 0 && available <= total, "{available} of {total}");
        }
        if cfg!(any(target_os = "linux", target_os = "macos")) {
            assert!(physical_memory().is_some_and(|b| b > 0));
            assert!(available_memory().is_some());
            assert!(peak_rss().is_some_and(|b| b > 0));
        }
    }

    /// Block-aligned positional reads, as the expert store issues them,
    /// return the file's bytes through an uncached handle.
    #[test]
    fn uncached_open_reads_the_file() {
        use std::os::unix::fs::FileExt;

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("experts");
        let bytes: Vec<u8> = (0..3 * 4096).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let file = open_uncached(&path).unwrap();
        let mut buf = crate::util::AlignedBuf::zeroed(4096);
        file.read_exact_at(&mut buf, 4096).unwrap();
        assert_eq!(&buf[..], &bytes[4096..2 * 4096]);
    }
}
