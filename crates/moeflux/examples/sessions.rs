//! Sessions on one shared model: prefix reuse through a checkpoint, two
//! conversations on two threads, and saving a session to continue later.
//!
//! ```sh
//! cargo run --release --example sessions              # uses the bundled test fixture
//! cargo run --release --example sessions -- MODEL_DIR  # or any converted model
//! ```

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;

use moeflux::convert::{ConvertOptions, convert};
use moeflux::model::argmax;
use moeflux::util::NoProgress;
use moeflux::{Model, ModelOptions, Session};

fn greedy(session: &mut Session, n: usize) -> moeflux::Result<Vec<u32>> {
    session.generate(
        n,
        |logits, _prompt, _generated| Ok(argmax(logits)),
        |_token| Ok(ControlFlow::Continue(())),
    )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let scratch = tempfile::tempdir()?;
    let dir = match std::env::args().nth(1) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let fixture =
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5_moe/hf");
            let dir = scratch.path().join("model");
            convert(&fixture, &dir, &ConvertOptions::default(), &NoProgress)?;
            dir
        }
    };
    // One model, opened once, shared by every session.
    let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);

    // A shared prefix (think: system prompt) is prefilled once and
    // checkpointed; each question restores it instead of prefilling again.
    let system_prompt = [11, 12, 13, 14, 15, 16, 17, 18];
    let mut session = model.session();
    session.prefill(&system_prompt)?;
    let prefix = session.checkpoint()?;
    for question in [[21u32, 22, 23], [31, 32, 33]] {
        session.restore_to(prefix)?;
        session.prefill(&question)?;
        println!("question {question:?} -> {:?}", greedy(&mut session, 6)?);
    }

    // Two conversations at once, on two threads, sharing weights and the
    // expert cache.
    let answers: Vec<Vec<u32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = [[1u32, 2, 3], [4, 5, 6]]
            .into_iter()
            .map(|prompt| {
                let model = model.clone();
                scope.spawn(move || -> moeflux::Result<Vec<u32>> {
                    let mut s = model.session();
                    s.prefill(&prompt)?;
                    greedy(&mut s, 6)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect::<Result<_, _>>()
    })?;
    println!("two threads -> {answers:?}");

    // Save a session, load it into a new one, and continue.
    let saved = scratch.path().join("session.state");
    session.save_state_file(&saved)?;
    let mut resumed = model.session();
    resumed.load_state_file(&saved)?;
    println!(
        "resumed at position {} of {}, continues with {:?}",
        resumed.position(),
        resumed.capacity(),
        greedy(&mut resumed, 4)?
    );
    Ok(())
}
