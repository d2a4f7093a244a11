//! A byte-budgeted cache of expert blobs with two replacement policies:
//!
//! - [`CachePolicy::Lru`]: evict the least recently used expert;
//! - [`CachePolicy::Lfu`]: count how often every expert of the model is
//!   requested (resident or not), halve all counts periodically so the
//!   counts follow the recent past, evict the resident expert with the
//!   lowest count, and keep a newly read expert only if it is requested at
//!   least as often as the one it would displace (TinyLFU's admission), so
//!   one-off experts do not flush the frequently routed ones.
//!
//! Entries are reference-counted: an expert evicted while a layer still
//! computes with it stays alive until that computation drops it, so the
//! budget bounds what the cache retains and callers bound what is in
//! flight.

use std::collections::{BTreeSet, HashMap};

/// (layer, expert index)
pub type ExpertKey = (u32, u32);

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum CachePolicy {
    Lru,
    #[default]
    Lfu,
}

/// What the cache needs to know about a value: its size.
pub trait Weighted {
    fn weight(&self) -> u64;
}

struct Entry<V> {
    value: V,
    rank: (u64, u64),
}

pub struct ExpertCache<V> {
    policy: CachePolicy,
    budget: u64,
    used: u64,
    tick: u64,
    entries: HashMap<ExpertKey, Entry<V>>,
    /// Resident keys ordered by eviction priority, lowest first:
    /// `(frequency or 0, last use)`.
    order: BTreeSet<((u64, u64), ExpertKey)>,
    frequency: HashMap<ExpertKey, u64>,
    requests_since_ageing: u64,
}

impl<V: Weighted + Clone> ExpertCache<V> {
    pub fn new(budget_bytes: u64, policy: CachePolicy) -> Self {
        ExpertCache {
            policy,
            budget: budget_bytes,
            used: 0,
            tick: 0,
            entries: HashMap::new(),
            order: BTreeSet::new(),
            frequency: HashMap::new(),
            requests_since_ageing: 0,
        }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn policy(&self) -> CachePolicy {
        self.policy
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

    pub fn contains(&self, key: ExpertKey) -> bool {
        self.entries.contains_key(&key)
    }

    /// The value if resident, without counting a request.
    pub fn peek(&self, key: ExpertKey) -> Option<V> {
        self.entries.get(&key).map(|e| e.value.clone())
    }

    fn rank(&self, key: ExpertKey) -> (u64, u64) {
        match self.policy {
            CachePolicy::Lru => (0, self.tick),
            CachePolicy::Lfu => (self.frequency.get(&key).copied().unwrap_or(0), self.tick),
        }
    }

    /// A request for `key`: counts it and, if resident, returns it as most
    /// recently used.
    pub fn get(&mut self, key: ExpertKey) -> Option<V> {
        self.tick += 1;
        *self.frequency.entry(key).or_default() += 1;
        self.requests_since_ageing += 1;
        if self.requests_since_ageing > 8 * self.frequency.len() as u64 {
            self.age();
        }
        let rank = self.rank(key);
        let entry = self.entries.get_mut(&key)?;
        self.order.remove(&(entry.rank, key));
        entry.rank = rank;
        self.order.insert((rank, key));
        Some(entry.value.clone())
    }

    /// Halves every count, so the frequencies describe recent routing.
    fn age(&mut self) {
        self.requests_since_ageing = 0;
        self.frequency.retain(|_, f| {
            *f /= 2;
            *f > 0
        });
        if self.policy == CachePolicy::Lfu {
            self.order.clear();
            for (key, entry) in self.entries.iter_mut() {
                entry.rank.0 = self.frequency.get(key).copied().unwrap_or(0);
                self.order.insert((entry.rank, *key));
            }
        }
    }

    /// Offers a value just read from disk; returns whether it was kept.
    pub fn insert(&mut self, key: ExpertKey, value: V) -> bool {
        let size = value.weight();
        if size > self.budget || self.entries.contains_key(&key) {
            return false;
        }
        let rank = self.rank(key);
        while self.used + size > self.budget {
            let Some(&(victim_rank, victim)) = self.order.first() else {
                break;
            };
            if self.policy == CachePolicy::Lfu && rank.0 < victim_rank.0 {
                return false; // requested less often than anything resident
            }
            self.order.remove(&(victim_rank, victim));
            let evicted = self
                .entries
                .remove(&victim)
                .expect("ordered keys are resident");
            self.used -= evicted.value.weight();
        }
        self.order.insert((rank, key));
        self.entries.insert(key, Entry { value, rank });
        self.used += size;
        true
    }
}

/// Hit rate of a policy replaying a recorded sequence of expert requests
/// with a cache holding `capacity` experts.
pub fn simulate(trace: &[ExpertKey], policy: CachePolicy, capacity: usize) -> f64 {
    #[derive(Clone)]
    struct Unit;
    impl Weighted for Unit {
        fn weight(&self) -> u64 {
            1
        }
    }
    let mut cache = ExpertCache::new(capacity as u64, policy);
    let mut hits = 0usize;
    for &key in trace {
        if cache.get(key).is_some() {
            hits += 1;
        } else {
            cache.insert(key, Unit);
        }
    }
    hits as f64 / trace.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_the_least_recently_used() {
        let trace = [(0, 1), (0, 2), (0, 1), (0, 3), (0, 1), (0, 2)];
        // capacity 2: 1 miss, 2 miss, 1 hit, 3 miss (evicts 2), 1 hit, 2 miss
        assert_eq!(simulate(&trace, CachePolicy::Lru, 2), 2.0 / 6.0);
    }

    #[test]
    fn lfu_keeps_frequent_experts_through_a_scan() {
        // Experts 0 and 1 are hot; a scan of one-off experts passes through.
        let mut trace = Vec::new();
        for round in 0..50u32 {
            trace.push((0, 0));
            trace.push((0, 1));
            trace.push((0, 100 + round));
            trace.push((0, 200 + round));
        }
        let lru = simulate(&trace, CachePolicy::Lru, 2);
        let lfu = simulate(&trace, CachePolicy::Lfu, 2);
        assert!(lfu > 0.45 && lru < 0.05, "lfu {lfu}, lru {lru}");
    }

    #[test]
    fn budget_is_never_exceeded() {
        #[derive(Clone)]
        struct Sized(u64);
        impl Weighted for Sized {
            fn weight(&self) -> u64 {
                self.0
            }
        }
        for policy in [CachePolicy::Lru, CachePolicy::Lfu] {
            let mut cache = ExpertCache::new(10, policy);
            for i in 0..100u32 {
                cache.get((i % 3, i % 7));
                cache.insert((i % 3, i % 7), Sized(1 + (i % 4) as u64));
                assert!(cache.used() <= 10);
            }
            assert!(!cache.insert((9, 9), Sized(11)), "larger than the budget");
        }
    }
}
