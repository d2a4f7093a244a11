//! Text in, text out on the bundled model: generation and chat against the
//! greedy samples its training script recorded with transformers, chat
//! driven through stdin, and the default model (no `-m`) converted into
//! the cache on first use.

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use serde_json::Value;

fn bundled() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bundled/qwen35-tiny")
}

fn samples(chat: bool) -> Vec<Value> {
    let text = std::fs::read_to_string(bundled().join("reference.json")).unwrap();
    let reference: Value = serde_json::from_str(&text).unwrap();
    reference["samples"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["kind"] == "greedy" && s["chat"] == chat)
        .cloned()
        .collect()
}

/// A `moeflux` command whose cache (for the default model) is `cache`.
fn moeflux(cache: &Path) -> Command {
    let mut cmd = Command::cargo_bin("moeflux").unwrap();
    cmd.env("MOEFLUX_CACHE", cache);
    cmd
}

fn stdout(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

const GREEDY: [&str; 4] = ["--temp", "0", "--repetition-penalty", "1"];

#[test]
fn generated_text_matches_transformers_greedy_samples() {
    let cache = tempfile::tempdir().unwrap();
    let samples = samples(false);
    assert!(samples.len() >= 3);
    for sample in samples {
        let n = sample["ids"].as_array().unwrap().len().to_string();
        let got = stdout(
            moeflux(cache.path())
                .args([
                    "generate",
                    "--quiet",
                    "-p",
                    sample["prompt"].as_str().unwrap(),
                    "-n",
                    &n,
                ])
                .args(GREEDY),
        );
        assert_eq!(got, format!("{}\n", sample["text"].as_str().unwrap()));
    }
}

#[test]
fn drafted_generation_gives_the_same_text_and_reports_its_drafts() {
    let cache = tempfile::tempdir().unwrap();
    for sample in samples(false) {
        let n = sample["ids"].as_array().unwrap().len().to_string();
        let prompt = sample["prompt"].as_str().unwrap();
        for draft in [
            &["--draft", "lookup"][..],
            &["--draft", "lookup", "--draft-tokens", "2"],
        ] {
            let got = stdout(
                moeflux(cache.path())
                    .args(["generate", "--quiet", "-p", prompt, "-n", &n])
                    .args(GREEDY)
                    .args(draft),
            );
            assert_eq!(
                got,
                format!("{}\n", sample["text"].as_str().unwrap()),
                "{draft:?}"
            );
        }
        let ids = stdout(
            moeflux(cache.path())
                .args([
                    "generate",
                    "--quiet",
                    "--print-token-ids",
                    "-p",
                    prompt,
                    "-n",
                    &n,
                ])
                .args(GREEDY)
                .args(["--draft", "lookup"]),
        );
        let want: Vec<String> = sample["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|id| id.to_string())
            .collect();
        assert_eq!(ids.trim(), want.join(" "));
    }
    // A prompt that repeats itself: its continuation is drafted and kept.
    let json: Value = serde_json::from_str(&stdout(moeflux(cache.path()).args([
        "generate",
        "--json",
        "-n",
        "32",
        "--temp",
        "0",
        "--draft",
        "lookup",
        "-p",
        "one two three four. one two three four. one two three four. one two three four. one two",
    ])))
    .unwrap();
    let drafts = &json["drafts"];
    assert!(drafts["checks"].as_u64().unwrap() > 0, "{json}");
    assert!(drafts["accepted"].as_u64().unwrap() > 0, "{json}");
    assert!(
        drafts["accepted"].as_u64() <= drafts["drafted"].as_u64(),
        "{json}"
    );
}

#[test]
fn chat_through_stdin_keeps_and_resets_history() {
    let cache = tempfile::tempdir().unwrap();
    let samples = samples(true);
    let (first, second) = (&samples[0], &samples[1]);
    let input = format!(
        "{}\n{}\n/reset\n{}\n/exit\nnever read\n",
        first["prompt"].as_str().unwrap(),
        second["prompt"].as_str().unwrap(),
        second["prompt"].as_str().unwrap()
    );
    let out = stdout(
        moeflux(cache.path())
            .args(["chat", "--quiet", "--no-think", "-n", "64"])
            .args(GREEDY)
            .write_stdin(input),
    );
    let answers: Vec<&str> = out.lines().collect();
    assert_eq!(answers.len(), 3, "{out}");
    // A fresh conversation answers as transformers did.
    assert_eq!(answers[0], first["text"].as_str().unwrap());
    assert_eq!(answers[2], second["text"].as_str().unwrap());
    // With the first exchange in its history the model answers otherwise;
    // after /reset it answers as in a fresh conversation.
    assert_ne!(
        answers[1], answers[2],
        "the second turn should see the history"
    );
}

#[test]
fn default_model_is_converted_once_into_the_cache() {
    let cache = tempfile::tempdir().unwrap();
    let run = || {
        moeflux(cache.path())
            .args(["generate", "-p", "The weather was", "-n", "4"])
            .args(GREEDY)
            .output()
            .unwrap()
    };
    let first = run();
    assert!(first.status.success());
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert!(stderr.contains("converting the bundled model"), "{stderr}");
    assert!(stderr.contains("tok/s"), "speeds are reported: {stderr}");
    let second = run();
    assert!(!String::from_utf8_lossy(&second.stderr).contains("converting"));
    assert_eq!(first.stdout, second.stdout);
    let converted: Vec<_> = std::fs::read_dir(cache.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(converted.len(), 1, "{converted:?}");
    assert!(converted[0].starts_with("qwen35-tiny-bf16-"));
}

#[test]
fn stop_strings_end_generation_before_the_stop_text() {
    let cache = tempfile::tempdir().unwrap();
    let sample = &samples(false)[0];
    let text = sample["text"].as_str().unwrap();
    // Stop at the first "she": output is everything before it.
    let cut = text.find("she").expect("sample mentions she");
    let got = stdout(
        moeflux(cache.path())
            .args([
                "generate",
                "--quiet",
                "-p",
                sample["prompt"].as_str().unwrap(),
                "-n",
                "64",
                "--stop",
                "she",
            ])
            .args(GREEDY),
    );
    assert_eq!(got, format!("{}\n", &text[..cut]));
}

#[test]
fn seeded_sampling_is_reproducible() {
    let cache = tempfile::tempdir().unwrap();
    let run = |seed: &str| {
        stdout(moeflux(cache.path()).args([
            "generate",
            "--quiet",
            "-p",
            "Elizabeth",
            "-n",
            "24",
            "--seed",
            seed,
        ]))
    };
    assert_eq!(run("7"), run("7"));
    assert_ne!(run("7"), run("8"));
}
