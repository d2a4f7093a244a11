//! The official `openai` Python client against the server:
//! tools/openai_client_check.py, run in the virtual environment that
//! tools/openai-venv.sh makes (under the target directory, reused between
//! runs). Skipped, saying so, only where there is no python3 and
//! MOEFLUX_REQUIRE_PYTHON is unset (.ci/run sets it: there it fails).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::start;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_python_client_reads_every_answer() {
    if Command::new("python3").arg("--version").output().is_err() {
        assert!(
            std::env::var_os("MOEFLUX_REQUIRE_PYTHON").is_none(),
            "MOEFLUX_REQUIRE_PYTHON is set but python3 is not installed"
        );
        eprintln!("SKIPPED: python3 is not installed; install it to run the openai client checks");
        return;
    }
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let made = Command::new("bash")
        .arg(repo().join("tools/openai-venv.sh"))
        .arg(&venv)
        .status()
        .expect("running tools/openai-venv.sh");
    assert!(
        made.success(),
        "tools/openai-venv.sh failed (it needs PyPI)"
    );

    let server = start(|o| o.api_key = Some("sesame".into())).await;
    let base = server.url("/v1");
    let output = tokio::task::spawn_blocking(move || {
        Command::new(venv.join("bin/python"))
            .arg(repo().join("tools/openai_client_check.py"))
            .args(["--base-url", &base, "--api-key", "sesame"])
            .args(["--model", moeflux::bundled::NAME])
            .output()
            .expect("running the client checks")
    })
    .await
    .unwrap();
    let say = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    println!("{}{}", say(&output.stdout), say(&output.stderr));
    assert!(
        output.status.success(),
        "the openai client checks failed:\n{}{}",
        say(&output.stdout),
        say(&output.stderr)
    );
}
