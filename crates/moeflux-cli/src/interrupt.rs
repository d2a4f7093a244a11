//! Ctrl-C. While a command is busy (converting, reading a prompt,
//! writing an answer) the first Ctrl-C asks it to stop at the next safe
//! point: it keeps what is consistent, reports and cleans up. A second
//! Ctrl-C, or one while nothing is under way, ends the process at once
//! (exit status 130); leftovers of a conversion killed that way are
//! removed by the next one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::Result;

pub struct Interrupt {
    requested: Arc<AtomicBool>,
    busy: Arc<AtomicBool>,
}

static INTERRUPT: OnceLock<Interrupt> = OnceLock::new();

/// Installs the handler (once per process) and returns the shared state.
pub fn install() -> Result<&'static Interrupt> {
    if let Some(interrupt) = INTERRUPT.get() {
        return Ok(interrupt);
    }
    let interrupt = Interrupt {
        requested: Arc::new(AtomicBool::new(false)),
        busy: Arc::new(AtomicBool::new(false)),
    };
    let (requested, busy) = (interrupt.requested.clone(), interrupt.busy.clone());
    ctrlc::set_handler(move || {
        if busy.load(Ordering::SeqCst) && !requested.swap(true, Ordering::SeqCst) {
            return;
        }
        eprintln!();
        std::process::exit(130);
    })?;
    Ok(INTERRUPT.get_or_init(|| interrupt))
}

impl Interrupt {
    /// The flag the first Ctrl-C raises.
    pub fn flag(&self) -> &Arc<AtomicBool> {
        &self.requested
    }

    /// Work that Ctrl-C should stop (not end the process) begins.
    pub fn begin(&self) {
        self.requested.store(false, Ordering::SeqCst);
        self.busy.store(true, Ordering::SeqCst);
    }

    /// The work ended; returns whether Ctrl-C asked it to stop.
    pub fn end(&self) -> bool {
        self.busy.store(false, Ordering::SeqCst);
        self.requested.swap(false, Ordering::SeqCst)
    }

    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }
}
