//! Where a conversion writes, and what it may replace.
//!
//! A conversion never deletes anything moeflux did not write: `--force`
//! replaces only an empty directory or a moeflux model directory holding
//! nothing but the files its manifest lists; input and output may not be
//! the same folder or nested in each other.
//!
//! Several processes may convert into the same output at once (a server,
//! scripts, tests starting together on an empty cache). Each takes an
//! exclusive lock on `.NAME.moeflux-lock` beside the output for the whole
//! conversion, stages into a folder of its own, and the processes that
//! waited use the result of the one that finished first. Whoever holds the
//! lock knows no other process is writing, so it removes the folders that
//! killed runs left behind (and puts back an output that a run killed in
//! the middle of replacing it had moved aside).

use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::format::manifest::FORMAT_NAME;
use crate::format::{MANIFEST_FILE, Manifest};

/// Suffixes of the folders a conversion keeps beside its output while it
/// runs; all are named `.NAME.moeflux-<suffix>-<pid>-<nonce>`.
pub(crate) const STAGING: &str = "partial";
const REPLACED: &str = "old";
/// Unpacked sources (the bundled model's checkpoint) staged beside the
/// output.
pub(crate) const SOURCE: &str = "source";

/// The output path's parent folder and file name.
fn split(output: &Path) -> Result<(PathBuf, String)> {
    let name = match output.components().next_back() {
        Some(Component::Normal(name)) => name.to_string_lossy().into_owned(),
        _ => {
            return Err(Error::invalid(
                "-o",
                format!("`{}` does not name a directory to create", output.display()),
            ));
        }
    };
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name))
}

/// The absolute, symlink-free form of a path that may not exist yet: its
/// deepest existing ancestor canonicalised, the rest appended.
fn absolute(path: &Path) -> PathBuf {
    let mut rest = Vec::new();
    let mut cursor = path.to_path_buf();
    loop {
        if let Ok(real) = cursor.canonicalize() {
            return rest.iter().rev().fold(real, |acc, part| acc.join(part));
        }
        match (cursor.file_name(), cursor.parent()) {
            (Some(name), Some(parent)) => {
                rest.push(name.to_os_string());
                cursor = if parent.as_os_str().is_empty() {
                    PathBuf::from(".")
                } else {
                    parent.to_path_buf()
                };
            }
            _ => return path.to_path_buf(),
        }
    }
}

/// Refuses an output that is the input, inside it, or contains it, before
/// anything is written.
pub(crate) fn check_not_nested(input: &Path, output: &Path) -> Result<()> {
    let (i, o) = (absolute(input), absolute(output));
    let why = if i == o {
        "is the input checkpoint itself"
    } else if o.starts_with(&i) {
        "is inside the input checkpoint"
    } else if i.starts_with(&o) {
        "contains the input checkpoint"
    } else {
        return Ok(());
    };
    Err(Error::invalid(
        "-o",
        format!(
            "`{}` {why} (`{}`); write the model to a folder of its own beside the checkpoint",
            output.display(),
            input.display()
        ),
    ))
}

/// Whether `dir` holds a moeflux manifest.
pub(crate) fn is_model_dir(dir: &Path) -> bool {
    Manifest::read(&dir.join(MANIFEST_FILE)).is_ok()
}

/// Checks that an existing output may be replaced: it is a directory, and
/// either empty or a moeflux model holding only the files its manifest
/// lists.
fn check_replaceable(output: &Path) -> Result<()> {
    let manifest_path = output.join(MANIFEST_FILE);
    let entries = std::fs::read_dir(output)
        .map_err(|e| Error::io(output, "listing", e))?
        .count();
    if entries == 0 {
        return Ok(());
    }
    let manifest = Manifest::read(&manifest_path).map_err(|_| {
        Error::bad_file(
            output,
            format!(
                "exists and is not a {FORMAT_NAME} model directory (no readable {MANIFEST_FILE}); \
                 --force replaces only an empty folder or a model moeflux wrote: \
                 choose another output or remove it yourself"
            ),
        )
    })?;
    let mut known: Vec<PathBuf> = manifest
        .files
        .iter()
        .map(|f| PathBuf::from(&f.path))
        .collect();
    known.push(PathBuf::from(MANIFEST_FILE));
    if let Some(foreign) = foreign_file(output, Path::new(""), &known)? {
        return Err(Error::bad_file(
            output,
            format!(
                "is a moeflux model but also holds `{}`, which moeflux did not write; \
                 --force does not delete other files: move it away or choose another output",
                foreign.display()
            ),
        ));
    }
    Ok(())
}

/// The first file under `root/rel` that is neither listed in `known` nor
/// a folder leading to one.
fn foreign_file(root: &Path, rel: &Path, known: &[PathBuf]) -> Result<Option<PathBuf>> {
    let dir = root.join(rel);
    for entry in std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, "listing", e))? {
        let entry = entry.map_err(|e| Error::io(&dir, "listing", e))?;
        let path = rel.join(entry.file_name());
        let kind = entry
            .file_type()
            .map_err(|e| Error::io(entry.path(), "reading", e))?;
        if kind.is_dir() && known.iter().any(|k| k.starts_with(&path) && *k != path) {
            if let Some(found) = foreign_file(root, &path, known)? {
                return Ok(Some(found));
            }
        } else if !(kind.is_file() && known.contains(&path)) {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

/// Checks what can be checked about an output before any work: it is not
/// a file, and it either does not exist or may be replaced.
pub(crate) fn check_output(output: &Path, overwrite: bool) -> Result<()> {
    split(output)?;
    if let Some(file) = output
        .ancestors()
        .skip(1)
        .find(|a| a.exists() && !a.is_dir())
    {
        return Err(Error::invalid(
            "-o",
            format!(
                "`{}` is a file, so `{}` cannot be created inside it",
                file.display(),
                output.display()
            ),
        ));
    }
    match std::fs::metadata(output) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(output, "reading", e)),
        Ok(m) if !m.is_dir() => Err(Error::invalid(
            "-o",
            format!(
                "`{}` is a file; the output is a directory: name a folder to create",
                output.display()
            ),
        )),
        Ok(_) if !overwrite => Err(Error::bad_file(
            output,
            "already exists; choose another output or pass --force to replace it",
        )),
        Ok(_) => check_replaceable(output),
    }
}

/// The exclusive right to write one output, held for a whole conversion.
/// Dropping it removes the lock file.
pub struct OutputLock {
    output: PathBuf,
    parent: PathBuf,
    name: String,
    lock_path: PathBuf,
    file: File,
    /// Parent folders this lock created, removed again if nothing was
    /// committed into them.
    created: Vec<PathBuf>,
    committed: bool,
    /// Whether taking the lock put back a model a killed run had moved
    /// aside.
    restored: bool,
}

impl OutputLock {
    /// Takes the lock on `output`, waiting while another process holds it
    /// (calling `on_wait` once if it has to); `cancel` stops the wait.
    /// Then cleans what killed runs left beside the output.
    pub fn acquire(
        output: &Path,
        cancel: Option<&AtomicBool>,
        on_wait: &dyn Fn(&Path),
    ) -> Result<OutputLock> {
        let (parent, name) = split(output)?;
        let created = create_parents(&parent)?;
        let lock_path = parent.join(format!(".{name}.moeflux-lock"));
        let mut waited = false;
        let file = loop {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&lock_path)
                .map_err(|e| Error::io(&lock_path, "creating the lock file", e))?;
            match file.try_lock() {
                Ok(()) => {
                    // The holder before us removes the file as it lets go;
                    // a lock on a removed file guards nothing.
                    if same_file(&file, &lock_path) {
                        break file;
                    }
                    continue;
                }
                Err(std::fs::TryLockError::WouldBlock) => {}
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(Error::io(&lock_path, "locking", e));
                }
            }
            if !waited {
                on_wait(output);
                waited = true;
            }
            if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                return Err(Error::Interrupted);
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let mut lock = OutputLock {
            output: output.to_path_buf(),
            parent,
            name,
            lock_path,
            file,
            created,
            committed: false,
            restored: false,
        };
        lock.restored = lock.recover()?;
        Ok(lock)
    }

    /// The output this lock guards.
    pub fn output(&self) -> &Path {
        &self.output
    }

    /// Whether taking the lock put back a model that a run killed while
    /// replacing it had moved aside.
    pub fn restored(&self) -> bool {
        self.restored
    }

    /// A new, empty, uniquely named folder beside the output.
    pub(crate) fn side_folder(&self, suffix: &str) -> Result<SideFolder> {
        let path = self.parent.join(format!(
            ".{}.moeflux-{suffix}-{}-{}",
            self.name,
            std::process::id(),
            nonce()
        ));
        std::fs::create_dir(&path).map_err(|e| Error::io(&path, "creating", e))?;
        Ok(SideFolder { path, keep: false })
    }

    /// Moves a complete staged model into place, replacing the output if
    /// there is one (checked again now: it may have changed since the
    /// conversion started).
    pub(crate) fn commit(&mut self, mut staged: SideFolder, overwrite: bool) -> Result<()> {
        let output = self.output.clone();
        if output.exists() {
            check_output(&output, overwrite)?;
            let aside = self.parent.join(format!(
                ".{}.moeflux-{REPLACED}-{}-{}",
                self.name,
                std::process::id(),
                nonce()
            ));
            std::fs::rename(&output, &aside)
                .map_err(|e| Error::io(&output, "moving the old model aside", e))?;
            if let Err(e) = std::fs::rename(&staged.path, &output) {
                let _ = std::fs::rename(&aside, &output);
                return Err(Error::io(&output, "renaming into place", e));
            }
            std::fs::remove_dir_all(&aside)
                .map_err(|e| Error::io(&aside, "removing the old model", e))?;
        } else {
            std::fs::rename(&staged.path, &output)
                .map_err(|e| Error::io(&output, "renaming into place", e))?;
        }
        staged.keep = true;
        self.committed = true;
        Ok(())
    }

    /// Removes the side folders of runs that were killed, after putting
    /// back an output one of them had moved aside; returns whether it did.
    fn recover(&self) -> Result<bool> {
        let prefix = format!(".{}.moeflux-", self.name);
        let lock_name = format!("{prefix}lock");
        let mut leftovers = Vec::new();
        for entry in
            std::fs::read_dir(&self.parent).map_err(|e| Error::io(&self.parent, "listing", e))?
        {
            let entry = entry.map_err(|e| Error::io(&self.parent, "listing", e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&prefix) && name != lock_name {
                leftovers.push(entry.path());
            }
        }
        let replaced = format!("{prefix}{REPLACED}-");
        let mut restored = false;
        if !self.output.exists()
            && let Some(old) = leftovers.iter().find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&replaced))
                    && is_model_dir(p)
            })
        {
            std::fs::rename(old, &self.output).map_err(|e| {
                Error::io(
                    &self.output,
                    "restoring the model a killed run moved aside",
                    e,
                )
            })?;
            restored = true;
        }
        for path in leftovers.iter().filter(|p| p.exists()) {
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(path)
            } else {
                std::fs::remove_file(path)
            };
            removed.map_err(|e| Error::io(path, "removing what a killed run left", e))?;
        }
        Ok(restored)
    }
}

impl Drop for OutputLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.lock_path);
        let _ = self.file.unlock();
        if !self.committed {
            for dir in &self.created {
                if std::fs::remove_dir(dir).is_err() {
                    break;
                }
            }
        }
    }
}

/// A folder beside the output, removed when dropped unless committed.
pub(crate) struct SideFolder {
    pub path: PathBuf,
    keep: bool,
}

impl Drop for SideFolder {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Creates `dir` and its missing ancestors; returns the ones it created,
/// deepest first.
fn create_parents(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut missing = Vec::new();
    let mut cursor = Some(dir);
    while let Some(d) = cursor {
        if d.as_os_str().is_empty() || d.exists() {
            break;
        }
        missing.push(d.to_path_buf());
        cursor = d.parent();
    }
    for d in missing.iter().rev() {
        match std::fs::create_dir(d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && d.is_dir() => {}
            Err(e) => return Err(Error::io(d, "creating folder", e)),
        }
    }
    Ok(missing)
}

#[cfg(unix)]
fn same_file(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Distinguishes side folders of one process.
fn nonce() -> u64 {
    use std::sync::atomic::AtomicU64;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as u64);
    (nanos << 16) ^ COUNTER.fetch_add(1, Ordering::Relaxed)
}
