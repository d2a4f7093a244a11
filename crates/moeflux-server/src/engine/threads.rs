//! The engine threads of this process, so that it can wait for them to
//! drop their models (and free the GPUs) before it exits.

use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The engine threads started in this process (see [`wait_for_engines`]).
static ENGINES: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());

/// Waits, up to `limit`, until every engine thread started in this process
/// has ended (each ends once its router and the requests it serves are
/// dropped, dropping its model); returns whether they all did.
pub fn wait_for_engines(limit: Duration) -> bool {
    let start = Instant::now();
    let mut engines = ENGINES.lock().unwrap();
    while engines.iter().any(|e| !e.is_finished()) {
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for engine in engines.drain(..) {
        let _ = engine.join();
    }
    true
}

/// Records a started engine thread.
pub(super) fn started(thread: JoinHandle<()>) {
    ENGINES.lock().unwrap().push(thread);
}
