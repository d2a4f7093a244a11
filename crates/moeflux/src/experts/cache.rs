//! A byte-budgeted least-recently-used cache of expert blobs.
//!
//! Entries are reference-counted: an expert evicted while a layer still
//! computes with it stays alive until that computation drops it, so the
//! budget bounds what the cache retains, and callers bound what is in
//! flight.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::Expert;

/// (layer, expert index)
pub type ExpertKey = (u32, u32);

pub struct ExpertCache {
    budget: u64,
    used: u64,
    tick: u64,
    entries: HashMap<ExpertKey, (Arc<Expert>, u64)>,
    by_age: BTreeMap<u64, ExpertKey>,
}

impl ExpertCache {
    pub fn new(budget_bytes: u64) -> Self {
        ExpertCache {
            budget: budget_bytes,
            used: 0,
            tick: 0,
            entries: HashMap::new(),
            by_age: BTreeMap::new(),
        }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Looks an expert up, marking it most recently used.
    pub fn get(&mut self, key: ExpertKey) -> Option<Arc<Expert>> {
        self.tick += 1;
        let tick = self.tick;
        let (expert, age) = self.entries.get_mut(&key)?;
        self.by_age.remove(age);
        *age = tick;
        self.by_age.insert(tick, key);
        Some(expert.clone())
    }

    /// Inserts an expert, evicting the least recently used ones to stay
    /// within budget. An expert larger than the whole budget is not kept.
    pub fn insert(&mut self, key: ExpertKey, expert: Arc<Expert>) {
        let size = expert.size_bytes();
        if size > self.budget {
            return;
        }
        if let Some((_, age)) = self.entries.remove(&key) {
            self.by_age.remove(&age);
            self.used -= size;
        }
        while self.used + size > self.budget {
            let Some((_, oldest)) = self.by_age.pop_first() else {
                break;
            };
            if let Some((evicted, _)) = self.entries.remove(&oldest) {
                self.used -= evicted.size_bytes();
            }
        }
        self.tick += 1;
        self.by_age.insert(self.tick, key);
        self.entries.insert(key, (expert, self.tick));
        self.used += size;
    }
}
