//! Large downloads (a step's logits) through page-locked memory: a copy
//! from the device into it runs at the bus's speed, where one into
//! pageable memory is staged by the driver. A batch's logits stay where
//! the device wrote them: each sequence's part is lent to the host
//! ([`HostValues`]), and the buffer serves a later download once nothing
//! holds any part of it. Where every lent buffer is still held (sessions
//! kept aside with their last logits), or the values are too many to keep
//! page-locked, the parts are copied out of a staging buffer instead.

use std::sync::Arc;

use cudarc::driver::PinnedHostSlice;

use super::{CudaBackend, Tensor, ok};
use crate::backend::{HostValues, into_parts, split_parts};
use crate::error::Result;

/// Values from which downloads go through page-locked memory (a
/// vocabulary's logits; small downloads are not worth it).
const PINNED_DOWNLOAD_MIN: usize = 1 << 14;

/// Buffers lent at once: a step's logits while the previous step's are
/// still held, and a few sessions holding older ones.
const MAX_LENT: usize = 4;

/// Most values a lent buffer holds (64 MiB): a decode step's logits of
/// many sequences, not every row of a long prompt's (a perplexity
/// chunk's), which are copied out rather than keep that much page-locked
/// memory for later steps.
const MAX_LENT_VALUES: usize = 1 << 24;

/// The page-locked buffers of large downloads.
#[derive(Default)]
pub(super) struct Downloads {
    /// Buffers whose values are lent; free when held only here.
    lent: Vec<Arc<LentBuffer>>,
    /// The buffer copies are made from when every lent one is held.
    staging: Option<PinnedHostSlice<f32>>,
}

/// A page-locked buffer holding one download's values (its first `len`).
struct LentBuffer {
    pinned: PinnedHostSlice<f32>,
    /// The buffer's memory, read while lent.
    values: *const f32,
    len: usize,
}

// SAFETY: `values` points into `pinned`, which is Send and Sync; the values
// are written only through `Arc::get_mut`, while nothing else holds them.
unsafe impl Send for LentBuffer {}
unsafe impl Sync for LentBuffer {}

impl AsRef<[f32]> for LentBuffer {
    fn as_ref(&self) -> &[f32] {
        // SAFETY: the first `len` values of the buffer, written and waited
        // for before the buffer was lent, and not written while it is.
        unsafe { std::slice::from_raw_parts(self.values, self.len) }
    }
}

impl CudaBackend {
    pub(super) fn to_host(&self, x: &Tensor) -> Result<Vec<f32>> {
        let len = x.rows * x.cols;
        if len < PINNED_DOWNLOAD_MIN {
            return self.download("to_host", &x.data, len);
        }
        let mut downloads = self.downloads.lock().unwrap();
        Ok(self.staged(&mut downloads, x, len)?.to_vec())
    }

    /// `x`'s values cut into consecutive parts of `lens` values: ranges of
    /// a buffer lent to the host where one is free (and they are at most
    /// [`MAX_LENT_VALUES`]), else copies.
    pub(super) fn to_host_parts(&self, x: &Tensor, lens: &[usize]) -> Result<Vec<HostValues>> {
        let len = x.rows * x.cols;
        if len < PINNED_DOWNLOAD_MIN {
            return Ok(into_parts(self.download("to_host", &x.data, len)?, lens));
        }
        let mut downloads = self.downloads.lock().unwrap();
        let lent = match len <= MAX_LENT_VALUES {
            true => self.lend(&mut downloads, x, len)?,
            false => None,
        };
        match lent {
            Some(buffer) => Ok(HostValues::lent_parts(buffer, lens)),
            None => Ok(split_parts(self.staged(&mut downloads, x, len)?, lens)),
        }
    }

    /// `x`'s first `len` values in a free lent buffer (one that is large
    /// enough, else a free one replaced, else a new one while there are
    /// fewer than [`MAX_LENT`]); None when every buffer is held.
    fn lend(
        &self,
        downloads: &mut Downloads,
        x: &Tensor,
        len: usize,
    ) -> Result<Option<Arc<dyn AsRef<[f32]> + Send + Sync>>> {
        let op = "to_host";
        let lent = &mut downloads.lent;
        let fits = |b: &mut Arc<LentBuffer>| Arc::get_mut(b).is_some_and(|b| b.pinned.len() >= len);
        let at = match lent.iter_mut().position(fits) {
            Some(at) => at,
            None => {
                let free = lent.iter_mut().position(|b| Arc::get_mut(b).is_some());
                if free.is_none() && lent.len() >= MAX_LENT {
                    return Ok(None);
                }
                // SAFETY: page-locked memory the copy below writes before
                // it is read (cached, not write-combined: the host reads it).
                let pinned = ok(op, unsafe { self.ctx.alloc_pinned_with_flags(len, 0) })?;
                let buffer = Arc::new(LentBuffer {
                    pinned,
                    values: std::ptr::null(),
                    len: 0,
                });
                match free {
                    Some(at) => lent[at] = buffer,
                    None => lent.push(buffer),
                }
                free.unwrap_or(lent.len() - 1)
            }
        };
        let buffer = Arc::get_mut(&mut lent[at]).expect("a free buffer");
        let host = &mut ok(op, buffer.pinned.as_mut_slice())?[..len];
        self.copy_to_host(x, host)?;
        buffer.values = host.as_ptr();
        buffer.len = len;
        Ok(Some(lent[at].clone()))
    }

    /// `x`'s first `len` values in the staging buffer, to be copied out.
    fn staged<'a>(
        &self,
        downloads: &'a mut Downloads,
        x: &Tensor,
        len: usize,
    ) -> Result<&'a [f32]> {
        let op = "to_host";
        let staging = &mut downloads.staging;
        if staging.as_ref().is_none_or(|s| s.len() < len) {
            // SAFETY: as in `lend`.
            *staging = Some(ok(op, unsafe { self.ctx.alloc_pinned_with_flags(len, 0) })?);
        }
        // The buffer may be longer than this download: copy into its first
        // `len` values only.
        let host = &mut ok(
            op,
            staging.as_mut().expect("allocated above").as_mut_slice(),
        )?[..len];
        self.copy_to_host(x, host)?;
        Ok(host)
    }

    /// `x`'s first `host.len()` values into `host`, waited for.
    fn copy_to_host(&self, x: &Tensor, host: &mut [f32]) -> Result<()> {
        let op = "to_host";
        ok(
            op,
            self.stream.memcpy_dtoh(&x.data.slice(..host.len()), host),
        )?;
        ok(op, self.stream.synchronize())?;
        ok(op, self.ctx.check_err())
    }
}
