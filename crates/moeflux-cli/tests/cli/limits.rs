//! Limits end work gracefully: no number given to an option makes moeflux
//! panic; at the context's end generation stops with a notice, its speeds
//! and its saved state; chat drops the oldest exchanges instead of dying;
//! Ctrl-C stops generation (speeds printed, state saved) and, in chat, the
//! answer but not the conversation; options are checked before the
//! weights are read.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command as Process, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use assert_cmd::Command;
use assert_cmd::cargo::CommandCargoExt;

const HUGE: &str = "18446744073709551615";

/// The model cache shared by this file's tests (the bundled model is
/// converted into it once; concurrent first uses are safe).
fn cache() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("limits-cache")
}

fn moeflux() -> Command {
    let mut cmd = Command::cargo_bin("moeflux").unwrap();
    cmd.env("MOEFLUX_CACHE", cache());
    cmd
}

fn process() -> Process {
    let mut p = Process::cargo_bin("moeflux").unwrap();
    p.env("MOEFLUX_CACHE", cache());
    p
}

/// A state file's token count, as `generate --load-state` reports it when
/// saving it again.
fn saved_tokens(state: &Path) -> usize {
    let copy = state.with_extension("copy");
    let out = moeflux()
        .args(["generate", "-n", "0", "--print-token-ids", "--load-state"])
        .arg(state)
        .arg("--save-state")
        .arg(&copy)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    stderr
        .lines()
        .find_map(|l| {
            l.strip_prefix("moeflux: saved the session (")
                .and_then(|r| r.split(' ').next())
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or_else(|| panic!("no token count in:\n{stderr}"))
}

#[test]
fn no_number_makes_moeflux_panic() {
    let cases: &[&[&str]] = &[
        &[
            "generate", "-p", "It is", "--temp", "0", "--ctx", "64", "-n", HUGE,
        ],
        &["generate", "-p", "It is", "--ctx", HUGE],
        &["generate", "-p", "It is", "-n", "1", "--top-k", HUGE],
        &[
            "generate",
            "-p",
            "It is",
            "-n",
            "1",
            "--expert-cache-mb",
            HUGE,
        ],
        &[
            "generate",
            "-p",
            "It is",
            "-n",
            "1",
            "--pinned-cache-mb",
            HUGE,
        ],
        &[
            "generate",
            "-p",
            "It is",
            "-n",
            "1",
            "--gpu-expert-cache-mb",
            HUGE,
        ],
        &[
            "generate",
            "-p",
            "It is",
            "-n",
            "1",
            "--prefill-chunk",
            HUGE,
        ],
        &["generate", "-p", "It is", "-n", "1", "--seed", HUGE],
        &[
            "generate",
            "-p",
            "It is",
            "-n",
            "1",
            "--json",
            "--logprobs",
            HUGE,
        ],
        &["generate", "--prompt-tokens", HUGE, "-n", "1"],
        &["--threads", HUGE, "generate", "-p", "It is", "-n", "1"],
        &["perplexity", "-f", "-", "--ctx", HUGE],
        &["bench", "-n", HUGE, "--no-ceilings"],
        &["bench", "--warmup", HUGE, "--no-ceilings"],
        &["bench", "--prefill", HUGE, "--no-ceilings"],
        &["bench", "--prompt-len", HUGE, "--no-ceilings"],
        &[
            "synth",
            "--preset",
            "qwen3-30b-a3b",
            "--layers",
            HUGE,
            "-o",
            "/nonexistent/x",
        ],
        &["detokenize", "--tokens", HUGE],
        &["logits", "--tokens", HUGE, "-o", "/nonexistent/x.npy"],
    ];
    for args in cases {
        let out = moeflux()
            .args(*args)
            .write_stdin("Some text to score.")
            .timeout(Duration::from_secs(120))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            matches!(out.status.code(), Some(0) | Some(1) | Some(2)),
            "{args:?}: status {:?}\n{stderr}",
            out.status.code()
        );
        assert!(!stderr.contains("panicked"), "{args:?}:\n{stderr}");
        if out.status.code() != Some(0) {
            assert!(
                stderr.contains("error"),
                "{args:?}: no error message:\n{stderr}"
            );
        }
    }
}

#[test]
fn context_end_stops_with_a_notice_speeds_and_the_state_saved() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("session.state");
    let out = moeflux()
        .args([
            "generate",
            "-p",
            "It is a truth",
            "--temp",
            "0",
            "--ctx",
            "48",
            "-n",
            HUGE,
        ])
        .arg("--save-state")
        .arg(&state)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("the context is full (48 tokens)"),
        "{stderr}"
    );
    assert!(stderr.contains("tok/s"), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty());
    assert_eq!(saved_tokens(&state), 48);
}

#[test]
fn chat_drops_the_oldest_exchanges_when_the_context_is_full() {
    let questions = [
        "Who is Mr. Darcy?",
        "Tell me about Bath.",
        "What does Emma think of Mr. Knightley?",
        "Describe Pemberley.",
        "Who is Elinor?",
    ];
    let out = moeflux()
        .args(["chat", "--temp", "0", "--ctx", "96", "-n", "24"])
        .write_stdin(questions.join("\n"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("dropped the oldest"), "{stderr}");
    let answers = String::from_utf8_lossy(&out.stdout)
        .matches("</think>")
        .count();
    assert_eq!(answers, questions.len(), "every question is answered");
}

#[test]
fn a_message_longer_than_the_context_is_refused_and_the_chat_goes_on() {
    let long = "It is a truth universally acknowledged. ".repeat(20);
    let out = moeflux()
        .args(["chat", "--temp", "0", "--ctx", "64", "-n", "8"])
        .write_stdin(format!("{long}\nWho is Emma?\n"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("the context"), "{stderr}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .matches("</think>")
            .count(),
        1
    );
}

/// Reads a child's stdout on a thread, sending each chunk as it arrives.
fn stream(mut out: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        while let Ok(n) = out.read(&mut buf) {
            if n == 0
                || tx
                    .send(String::from_utf8_lossy(&buf[..n]).into_owned())
                    .is_err()
            {
                break;
            }
        }
    });
    rx
}

fn interrupt(child: &std::process::Child) {
    // SAFETY: sends a signal to our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
}

#[test]
fn ctrl_c_stops_generate_with_speeds_and_the_state_saved() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("stopped.state");
    let mut child = process()
        .args(["generate", "-p", "It is a truth", "--temp", "0", "-n", HUGE])
        .args(["--ctx", "2048", "--ignore-eos", "--save-state"])
        .arg(&state)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let text = stream(child.stdout.take().unwrap());
    text.recv_timeout(Duration::from_secs(120))
        .expect("generation started");
    interrupt(&child);
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("moeflux: stopped"), "{stderr}");
    assert!(stderr.contains("tok/s"), "{stderr}");
    let held = saved_tokens(&state);
    assert!(held > 4 && held < 2048, "the state holds {held} tokens");
}

#[test]
fn ctrl_c_in_chat_stops_the_answer_and_keeps_the_conversation() {
    let mut child = process()
        .args([
            "chat",
            "--temp",
            "0",
            "--ignore-eos",
            "-n",
            "1500",
            "--ctx",
            "2048",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let text = stream(child.stdout.take().unwrap());
    let (err_tx, err_rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if err_tx.send(line).is_err() {
                break;
            }
        }
    });
    writeln!(stdin, "Tell me a story.").unwrap();
    text.recv_timeout(Duration::from_secs(120))
        .expect("the answer started");
    interrupt(&child);
    let stopped = err_rx
        .iter()
        .take_while(|l| !l.contains("(stopped)"))
        .count();
    assert!(stopped < 100, "no '(stopped)' notice");
    // The conversation goes on: a second message is answered.
    writeln!(stdin, "Who is Emma?\n/exit").unwrap();
    drop(stdin);
    let status = child.wait().unwrap();
    let rest: String = text.try_iter().collect();
    assert_eq!(status.code(), Some(0));
    assert!(
        rest.contains("</think>"),
        "the second message got no answer"
    );
}

#[test]
fn options_are_checked_before_the_weights_are_read() {
    // Each of these fails before the model is loaded, so the load's
    // message (the expert cache line) never appears.
    let tmp = tempfile::tempdir().unwrap();
    // A model without a tokenizer: text prompts are refused before loading.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_moe/hf");
    let untokenized = tmp.path().join("no-tokenizer");
    moeflux()
        .arg("convert")
        .arg(&fixture)
        .arg("-o")
        .arg(&untokenized)
        .assert()
        .success();
    let model = untokenized.display().to_string();
    let cases: Vec<Vec<String>> = vec![
        vec![
            "generate".into(),
            "-m".into(),
            model.clone(),
            "-p".into(),
            "x".into(),
        ],
        vec!["chat".into(), "-m".into(), model.clone()],
        vec![
            "perplexity".into(),
            "-m".into(),
            model,
            "-f".into(),
            "-".into(),
        ],
        vec![
            "generate".into(),
            "-p".into(),
            "x".into(),
            "--temp=-1".into(),
        ],
        vec![
            "generate".into(),
            "-p".into(),
            "x".into(),
            "--top-p".into(),
            "7".into(),
        ],
        vec![
            "generate".into(),
            "-p".into(),
            "x".into(),
            "--ctx".into(),
            "999999".into(),
        ],
        vec![
            "generate".into(),
            "-p".into(),
            "x".into(),
            "--save-state".into(),
            tmp.path().join("missing/dir/s.state").display().to_string(),
        ],
        vec![
            "generate".into(),
            "-f".into(),
            tmp.path().join("none.txt").display().to_string(),
        ],
        vec![
            "perplexity".into(),
            "-f".into(),
            "-".into(),
            "--ctx".into(),
            "1".into(),
        ],
        vec!["chat".into(), "--min-p".into(), "2".into()],
    ];
    for args in cases {
        let out = moeflux().args(&args).write_stdin("text").output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}:\n{stderr}");
        assert!(
            !stderr.contains("expert cache"),
            "{args:?} loaded the model:\n{stderr}"
        );
    }
}
