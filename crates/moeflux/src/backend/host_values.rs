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
#[derive(Clone, Default)]
pub struct HostValues {
    owner: Owner,
    range: Range<usize>,
}

#[derive(Clone)]
enum Owner {
    Own(Arc<Vec<f32>>),
    Lent(Arc<dyn AsRef<[f32]> + Send + Sync>),
}

impl Default for Owner {
    fn default() -> Owner {
        Owner::Own(Arc::default())
    }
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
            .map(|range| HostValues {
                owner: Owner::Lent(buffer.clone()),
                range,
            })
            .collect()
    }

    /// The values `range` (relative to these), sharing their owner.
    pub fn slice(&self, range: Range<usize>) -> HostValues {
        assert!(
            range.start <= range.end && range.end <= self.len(),
            "slice {range:?} of {} values",
            self.len()
        );
        HostValues {
            owner: self.owner.clone(),
            range: self.range.start + range.start..self.range.start + range.end,
        }
    }

    /// Whether these values are part of a buffer a backend lent.
    pub fn is_lent(&self) -> bool {
        matches!(self.owner, Owner::Lent(_))
    }

    /// The values in a vector of their own (lent ones copied), so that
    /// holding them keeps no backend's buffer from its next download.
    pub fn detach(&mut self) {
        if self.is_lent() {
            *self = HostValues::from(self.to_vec());
        }
    }

    /// The values as a vector: moved out where they are a whole vector
    /// held once, else copied.
    pub fn into_vec(self) -> Vec<f32> {
        match self.owner {
            Owner::Own(values) if self.range == (0..values.len()) => Arc::unwrap_or_clone(values),
            Owner::Own(values) => values[self.range].to_vec(),
            Owner::Lent(buffer) => (*buffer).as_ref()[self.range].to_vec(),
        }
    }
}

impl From<Vec<f32>> for HostValues {
    fn from(values: Vec<f32>) -> HostValues {
        HostValues {
            range: 0..values.len(),
            owner: Owner::Own(Arc::new(values)),
        }
    }
}

impl Deref for HostValues {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match &self.owner {
            Owner::Own(values) => &values[self.range.clone()],
            Owner::Lent(buffer) => &(**buffer).as_ref()[self.range.clone()],
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
        // A part of a part shares the buffer too.
        let last = parts[2].slice(4..6);
        assert_eq!(&*last, &[8.0, 9.0]);
        assert!(Arc::get_mut(&mut buffer).is_none());
        drop(parts);
        assert!(
            Arc::get_mut(&mut buffer).is_none(),
            "the slice still holds it"
        );
        // Detached values hold nothing of the buffer and keep their values.
        let mut kept = last.clone();
        kept.detach();
        assert!(!kept.is_lent());
        drop(last);
        assert!(Arc::get_mut(&mut buffer).is_some());
        assert_eq!(kept.into_vec(), [8.0, 9.0]);
    }

    #[test]
    fn slices_and_vectors_of_own_values() {
        let values = HostValues::from(vec![1.0, 2.0, 3.0]);
        let tail = values.slice(1..3);
        assert_eq!(&*tail, &[2.0, 3.0]);
        assert_eq!(tail.slice(1..2).into_vec(), [3.0]);
        // Shared: copied out, the original intact.
        assert_eq!(values.clone().into_vec(), [1.0, 2.0, 3.0]);
        assert_eq!(format!("{tail:?}"), "[2.0, 3.0]");
        assert!(HostValues::default().is_empty());
    }

    #[test]
    #[should_panic(expected = "slice 2..4 of 3 values")]
    fn a_slice_past_the_end_panics() {
        let _ = HostValues::from(vec![1.0, 2.0, 3.0]).slice(2..4);
    }
}
