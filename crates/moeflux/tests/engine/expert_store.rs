//! The expert store's cache filled before decoding.

use crate::common::*;
use moeflux::experts::{CachePolicy, ExpertStore, IoMode, StoreOptions};
use moeflux::format::{ModelDir, OpenOptions};
use moeflux::quant::DType;
use moeflux::util::NoProgress;

/// With a cache budget that holds every expert, `load_all` reads each
/// expert once: afterwards every fetch is a hit and nothing more is read.
/// With a budget that cannot hold them all it reads nothing.
#[test]
fn load_all_fills_a_cache_that_holds_every_expert() {
    let converted = convert_fixture("qwen3_moe", DType::Bf16);
    let dir = ModelDir::open(&converted.dir, OpenOptions::default()).unwrap();
    let open = |cache_bytes| {
        let options = StoreOptions {
            cache_bytes,
            policy: CachePolicy::Lfu,
            io: IoMode::Buffered,
        };
        ExpertStore::open(&dir, options).unwrap()
    };
    let total = open(0).total_expert_bytes();

    let small = open(total / 2);
    assert!(!small.load_all(&NoProgress).unwrap());
    assert_eq!(
        small.stats().bytes_read,
        0,
        "nothing read when they do not fit"
    );

    let store = open(total);
    assert!(store.load_all(&NoProgress).unwrap());
    let loaded = store.stats();
    assert_eq!(loaded.bytes_read, total, "every expert read once");
    assert_eq!(
        (loaded.hits, loaded.misses),
        (0, 0),
        "loading is not a request"
    );
    let mut experts = 0;
    for layer in store.moe_layers() {
        let all: Vec<usize> = (0..store.expert_count(layer)).collect();
        store.fetch(layer, &all).unwrap();
        experts += all.len() as u64;
    }
    let after = store.stats().since(&loaded);
    assert_eq!(
        (after.hits, after.misses, after.bytes_read),
        (experts, 0, 0)
    );
}
