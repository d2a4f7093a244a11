//! Values a backend hands to the host. A decode step of many sequences
//! brings tens of megabytes of logits down from a GPU; each sequence's
//! part is a range of the page-locked buffer the device wrote, lent to
//! whoever holds it (the caller, the session's last row) and taken back
//! for a later download once nothing holds any part of it. Copying the
//! parts out into vectors of their own made a 64-sequence decode step on
//! an H100 machine 17.5 ms instead of 14.9.

use std::fmt;
use std::ops::{Deref, Range};
use std::sync::Arc;

/// A run of `f32` values on the host, shared without copying: a vector of
/// their own, or a range of a buffer a backend lent (see the module
/// documentation). [`HostValues::detach`] gives lent values a vector of
/// their own, for holders that keep them long.
#[derive(Clone)]
pub struct HostValues(Values);

#[derive(Clone)]
enum Values {
    Own(Arc<Vec<f32>>),
    Lent {
        buffer: Arc<dyn AsRef<[f32]> + Send + Sync>,
        range: Range<usize>,
    },
}

impl HostValues {
    /// `lens` consecutive parts of `buffer`'s values, which they cover;
    /// the buffer is free again once every part (and clone) is dropped.
    pub(crate) fn lent_parts(
        buffer: Arc<dyn AsRef<[f32]> + Send + Sync>,
        lens: &[usize],
    ) -> Vec<HostValues> {
        debug_assert_eq!(
            lens.iter().sum::<usize>(),
            (*buffer).as_ref().len(),
            "parts cover the buffer"
        );
        ranges(lens)
            .map(|range| {
                HostValues(Values::Lent {
                    buffer: buffer.clone(),
                    range,
                })
            })
            .collect()
    }

    /// Whether these values are part of a buffer a backend lent.
    pub fn is_lent(&self) -> bool {
        matches!(self.0, Values::Lent { .. })
    }

    /// The values in a vector of their own (lent ones copied), so that
    /// holding them keeps no backend's buffer from its next download.
    pub fn detach(&mut self) {
        if self.is_lent() {
            *self = HostValues::from(self.to_vec());
        }
    }

    /// The values as a vector: moved out where they are a vector held
    /// once, else copied.
    pub fn into_vec(self) -> Vec<f32> {
        match self.0 {
            Values::Own(values) => Arc::unwrap_or_clone(values),
            Values::Lent { .. } => self.to_vec(),
        }
    }
}

impl Default for HostValues {
    fn default() -> HostValues {
        HostValues::from(Vec::new())
    }
}

impl From<Vec<f32>> for HostValues {
    fn from(values: Vec<f32>) -> HostValues {
        HostValues(Values::Own(Arc::new(values)))
    }
}

impl Deref for HostValues {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match &self.0 {
            Values::Own(values) => values,
            Values::Lent { buffer, range } => &(**buffer).as_ref()[range.clone()],
        }
    }
}

impl PartialEq for HostValues {
    fn eq(&self, other: &HostValues) -> bool {
        **self == **other
    }
}

impl fmt::Debug for HostValues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

/// Consecutive ranges of `lens` values, from 0.
fn ranges(lens: &[usize]) -> impl Iterator<Item = Range<usize>> + '_ {
    lens.iter().scan(0, |at, &len| {
        *at += len;
        Some(*at - len..*at)
    })
}

/// [`split_parts`] of values the caller owns: one part is the values
/// themselves, moved.
pub(crate) fn into_parts(values: Vec<f32>, lens: &[usize]) -> Vec<HostValues> {
    match lens {
        [_] => vec![HostValues::from(values)],
        _ => split_parts(&values, lens),
    }
}

/// `values` cut into consecutive parts of `lens` values, each copied into
/// a vector of its own; large ones (a batch's logits, when no buffer can
/// be lent) by the thread pool, a part a task.
pub(crate) fn split_parts(values: &[f32], lens: &[usize]) -> Vec<HostValues> {
    use rayon::prelude::*;
    /// Values from which the parts are copied in parallel (4 MiB).
    const PARALLEL_MIN: usize = 1 << 20;
    debug_assert_eq!(
        lens.iter().sum::<usize>(),
        values.len(),
        "parts cover the values"
    );
    let ranges: Vec<Range<usize>> = ranges(lens).collect();
    let part = |r: Range<usize>| HostValues::from(values[r].to_vec());
    match values.len() >= PARALLEL_MIN && lens.len() > 1 {
        true => ranges.into_par_iter().map(part).collect(),
        false => ranges.into_iter().map(part).collect(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{HostValues, into_parts, split_parts};

    #[test]
    fn owned_parts_move_one_and_split_several() {
        let values: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let at = values.as_ptr();
        let one = into_parts(values.clone(), &[6]);
        assert_eq!(&*one[0], &values[..]);
        assert!(!one[0].is_lent());
        let moved = into_parts(values, &[6]).pop().unwrap().into_vec();
        assert_eq!(moved.as_ptr(), at, "one part is moved, and moved out again");
        let values: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let parts = into_parts(values, &[2, 4]);
        assert_eq!(&*parts[0], &[0.0, 1.0]);
        assert_eq!(&*parts[1], &[2.0, 3.0, 4.0, 5.0]);
    }

    #[test]
    fn parts_cover_the_values_in_order_small_and_large() {
        for total in [10, (1 << 20) + 7] {
            let values: Vec<f32> = (0..total).map(|i| i as f32).collect();
            let lens = [3, 0, total - 5, 2];
            let parts = split_parts(&values, &lens);
            assert_eq!(parts.iter().map(|p| p.len()).collect::<Vec<_>>(), lens);
            assert_eq!(
                parts
                    .iter()
                    .flat_map(|p| p.iter().copied())
                    .collect::<Vec<_>>(),
                values
            );
        }
    }

    #[test]
    fn lent_parts_hold_the_buffer_until_the_last_is_dropped() {
        let mut buffer: Arc<Vec<f32>> = Arc::new((0..10).map(|i| i as f32).collect());
        let parts = HostValues::lent_parts(buffer.clone(), &[4, 0, 6]);
        assert!(parts.iter().all(HostValues::is_lent));
        assert_eq!(&*parts[0], &[0.0, 1.0, 2.0, 3.0]);
        assert!(parts[1].is_empty());
        assert_eq!(&*parts[2], &[4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
        // A clone of a part shares the buffer too.
        let last = parts[2].clone();
        assert!(Arc::get_mut(&mut buffer).is_none());
        drop(parts);
        assert!(
            Arc::get_mut(&mut buffer).is_none(),
            "the clone still holds it"
        );
        // Detached values hold nothing of the buffer and keep their values.
        let mut kept = last.clone();
        kept.detach();
        assert!(!kept.is_lent());
        drop(last);
        assert!(Arc::get_mut(&mut buffer).is_some());
        assert_eq!(kept.into_vec(), [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    }

    #[test]
    fn shared_own_values_are_copied_out() {
        let values = HostValues::from(vec![1.0, 2.0, 3.0]);
        // Shared: copied out, the original intact.
        assert_eq!(values.clone().into_vec(), [1.0, 2.0, 3.0]);
        assert_eq!(&*values, &[1.0, 2.0, 3.0]);
        assert_eq!(format!("{values:?}"), "[1.0, 2.0, 3.0]");
        assert!(HostValues::default().is_empty());
    }
}
