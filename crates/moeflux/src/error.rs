//! Errors reported to users: each says what went wrong, where (file, tensor,
//! option) and, where it can, how to fix it.

use std::path::{Path, PathBuf};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An operating-system error while touching a file. The OS error is
    /// part of the message, not a separate `source`, so a report that
    /// prints the chain of causes does not print it twice.
    #[error("{}: {action}: {cause}", path.display())]
    Io {
        path: PathBuf,
        action: &'static str,
        cause: std::io::Error,
    },

    /// A file exists but its contents are not what was expected
    /// (malformed JSON, wrong size, bad header, ...).
    #[error("{}: {msg}", path.display())]
    BadFile { path: PathBuf, msg: String },

    /// The model's configuration is malformed or names something moeflux does
    /// not implement.
    #[error("{}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },

    /// A tensor is missing, has the wrong shape or an unsupported dtype.
    #[error("{}: tensor `{name}`: {msg}", path.display())]
    Tensor {
        path: PathBuf,
        name: String,
        msg: String,
    },

    /// Stored data does not match the checksum recorded in the manifest.
    #[error(
        "{}: checksum mismatch in {what} (manifest says {expected:016x}, data hashes to {actual:016x}); \
         the file is corrupt or was modified: convert the model again"
    , path.display())]
    Checksum {
        path: PathBuf,
        what: String,
        expected: u64,
        actual: u64,
    },

    /// A compute device (GPU) failed an operation.
    #[error("{device}: {msg}")]
    Device { device: String, msg: String },

    /// A user-supplied option or argument is out of range.
    #[error("{option}: {msg}")]
    InvalidArgument { option: String, msg: String },

    /// The work was stopped on request (Ctrl-C, a cancelled request)
    /// before it completed; nothing half-done was kept.
    #[error("interrupted")]
    Interrupted,
}

impl Error {
    pub fn io(path: impl AsRef<Path>, action: &'static str, source: std::io::Error) -> Self {
        Error::Io {
            path: path.as_ref().to_path_buf(),
            action,
            cause: source,
        }
    }

    pub fn bad_file(path: impl AsRef<Path>, msg: impl Into<String>) -> Self {
        Error::BadFile {
            path: path.as_ref().to_path_buf(),
            msg: msg.into(),
        }
    }

    pub fn config(path: impl AsRef<Path>, msg: impl Into<String>) -> Self {
        Error::Config {
            path: path.as_ref().to_path_buf(),
            msg: msg.into(),
        }
    }

    pub fn tensor(path: impl AsRef<Path>, name: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Tensor {
            path: path.as_ref().to_path_buf(),
            name: name.into(),
            msg: msg.into(),
        }
    }

    pub fn invalid(option: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::InvalidArgument {
            option: option.into(),
            msg: msg.into(),
        }
    }
}
