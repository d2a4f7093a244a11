//! `moeflux serve` as a user starts it: bad options refused with a
//! message naming them, an answer on the address it prints, and a stop on
//! SIGINT once the requests in flight are answered.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn moeflux() -> Command {
    Command::new(env!("CARGO_BIN_EXE_moeflux"))
}

#[test]
fn bad_options_are_refused_naming_the_option() {
    for (args, names) in [
        (&["--kv-cache-mb", "1"][..], "--kv-cache-mb"),
        (&["--max-sequences", "0"][..], "--max-sequences"),
        (&["--api-key", ""][..], "--api-key"),
        (&["--ctx", "0"][..], "--ctx"),
        (&["--prefix-cache-mb", "99999999"][..], "--prefix-cache-mb"),
        (&["--request-timeout", "0"][..], "--request-timeout"),
    ] {
        let out = moeflux().arg("serve").args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains(names) && !stderr.contains("panicked"),
            "{stderr}"
        );
    }
}

#[test]
fn serves_on_the_address_it_prints_and_stops_on_sigint() {
    let mut child = moeflux()
        .args([
            "serve",
            "--port",
            "0",
            "--api-key",
            "sesame",
            "--device",
            "cpu",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let url = loop {
        let line = lines.next().expect("the server exited").unwrap();
        if let Some(rest) = line.split_once("serving qwen35-tiny at ") {
            break rest.1.split(' ').next().unwrap().to_string();
        }
    };
    assert!(
        url.starts_with("http://127.0.0.1:") && url.ends_with("/v1"),
        "{url}"
    );
    let client = reqwest::blocking::Client::new();
    let health = client.get(url.replace("/v1", "/health")).send().unwrap();
    assert_eq!(health.status(), 200);
    let body = serde_json::json!({"model": "qwen35-tiny", "prompt": "Emma", "max_tokens": 3});
    let denied = client
        .post(format!("{url}/completions"))
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(denied.status(), 401);
    let answer: serde_json::Value = client
        .post(format!("{url}/completions"))
        .bearer_auth("sesame")
        .json(&body)
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert!(
        answer["usage"]["completion_tokens"].as_u64().unwrap() >= 1,
        "{answer}"
    );

    // SIGINT: a graceful stop.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(status.success(), "{status}: {rest:?}");
    assert!(rest.iter().any(|l| l.contains("stopping")), "{rest:?}");
}
