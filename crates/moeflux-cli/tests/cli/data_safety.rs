//! Nothing is deleted that moeflux did not write, and processes running
//! at the same time do not spoil each other's work: `--force` refuses
//! folders that are not moeflux models, input and output may not be
//! nested, concurrent conversions and first uses of the bundled model all
//! succeed with one valid model, and what killed runs left behind is
//! cleaned by the next run.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command as Process, Stdio};
use std::time::{Duration, Instant};

use super::moeflux;
use assert_cmd::Command;
use assert_cmd::cargo::CommandCargoExt;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_moe/hf")
}

/// Asserts that the model at `model` loads and generates.
fn generates(model: &Path) {
    moeflux()
        .args([
            "generate",
            "--prompt-tokens",
            "1,2,3",
            "-n",
            "2",
            "-q",
            "-m",
        ])
        .arg(model)
        .assert()
        .success();
}

/// A copy of the fixture checkpoint at `to`.
fn checkpoint_at(to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(fixture()).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// Every file under `dir` with its contents, to compare before and after.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let bytes = fs::read(&path).unwrap();
                files.push((path, bytes));
            }
        }
    }
    files.sort();
    files
}

/// Runs a command that must fail cleanly (status 1, an `error:` line, no
/// panic); returns its stderr.
fn refused(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "stderr:\n{stderr}");
    assert!(stderr.contains("error: "), "stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "stderr:\n{stderr}");
    stderr
}

fn convert(input: &Path, output: &Path, extra: &[&str]) -> Command {
    let mut cmd = moeflux();
    cmd.arg("convert")
        .arg(input)
        .arg("-o")
        .arg(output)
        .args(extra);
    cmd
}

/// Entries a conversion keeps beside its output while it runs.
fn leftovers(parent: &Path) -> Vec<String> {
    fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".moeflux-"))
        .collect()
}

#[test]
fn force_into_the_folder_holding_the_checkpoint_deletes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let parent = tmp.path().join("models");
    checkpoint_at(&parent.join("ckpt"));
    fs::write(parent.join("notes.txt"), "mine").unwrap();
    let before = snapshot(&parent);
    let stderr = refused(&mut convert(&parent.join("ckpt"), &parent, &["--force"]));
    assert!(stderr.contains("contains the input checkpoint"), "{stderr}");
    assert_eq!(snapshot(&parent), before);
}

#[test]
fn output_equal_to_or_inside_the_input_is_refused_before_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    checkpoint_at(&ckpt);
    let before = snapshot(&ckpt);
    for (output, force) in [
        (ckpt.clone(), true),
        (ckpt.clone(), false),
        (ckpt.join("."), true),
        (ckpt.join("../ckpt"), true),
        (ckpt.join("converted"), false),
    ] {
        let extra: &[&str] = if force { &["--force"] } else { &[] };
        refused(&mut convert(&ckpt, &output, extra));
        assert_eq!(snapshot(&ckpt), before, "-o {}", output.display());
    }
    assert_eq!(leftovers(tmp.path()), Vec::<String>::new());
}

#[test]
fn output_naming_a_file_is_refused_and_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("model.bin");
    fs::write(&file, "not a model").unwrap();
    for output in [file.clone(), file.join("inside")] {
        for extra in [&[][..], &["--force"][..]] {
            let stderr = refused(&mut convert(&fixture(), &output, extra));
            assert!(stderr.contains("is a file"), "{stderr}");
        }
    }
    assert_eq!(fs::read(&file).unwrap(), b"not a model");
    assert_eq!(
        fs::read_dir(tmp.path()).unwrap().count(),
        1,
        "something was left beside the file"
    );
}

#[test]
fn force_replaces_only_an_empty_folder_or_a_model_moeflux_wrote() {
    let tmp = tempfile::tempdir().unwrap();
    // A folder of the user's, not a model.
    let theirs = tmp.path().join("theirs");
    fs::create_dir(&theirs).unwrap();
    fs::write(theirs.join("thesis.tex"), "years of work").unwrap();
    let before = snapshot(&theirs);
    let stderr = refused(&mut convert(&fixture(), &theirs, &["--force"]));
    assert!(stderr.contains("not a moeflux model"), "{stderr}");
    assert_eq!(snapshot(&theirs), before);

    // A model with a file of the user's in it.
    let model = tmp.path().join("model");
    convert(&fixture(), &model, &[]).assert().success();
    fs::write(model.join("notes.txt"), "keep me").unwrap();
    let stderr = refused(&mut convert(
        &fixture(),
        &model,
        &["--force", "--quant", "q8"],
    ));
    assert!(stderr.contains("notes.txt"), "{stderr}");
    assert_eq!(fs::read(model.join("notes.txt")).unwrap(), b"keep me");

    // Without it, the model is replaced.
    fs::remove_file(model.join("notes.txt")).unwrap();
    convert(&fixture(), &model, &["--force", "--quant", "q8"])
        .assert()
        .success();
    let manifest = fs::read_to_string(model.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"quantization\": \"q8\""));

    // An empty folder is fine.
    let empty = tmp.path().join("empty");
    fs::create_dir(&empty).unwrap();
    convert(&fixture(), &empty, &["--force"]).assert().success();
    assert_eq!(leftovers(tmp.path()), Vec::<String>::new());
}

#[test]
fn synth_force_deletes_nothing_that_is_not_a_model() {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(tmp.path().join("notes.txt"), "mine").unwrap();
    let before = snapshot(tmp.path());
    refused(
        moeflux()
            .args(["synth", "--preset", "qwen3-30b-a3b", "--layers", "1", "-o"])
            .arg(tmp.path())
            .arg("--force"),
    );
    assert_eq!(snapshot(tmp.path()), before);
}

#[test]
fn leftovers_of_killed_conversions_are_cleaned_and_a_moved_model_restored() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    // A staging folder and a lock file of runs that were killed.
    fs::create_dir_all(tmp.path().join(".model.moeflux-partial-4242-1/experts")).unwrap();
    fs::write(tmp.path().join(".model.moeflux-lock"), "").unwrap();
    fs::create_dir(tmp.path().join(".model.moeflux-partial")).unwrap();
    convert(&fixture(), &model, &[]).assert().success();
    assert_eq!(leftovers(tmp.path()), Vec::<String>::new());

    // A run killed while replacing the model had moved it aside.
    let aside = tmp.path().join(".model.moeflux-old-4242-2");
    fs::rename(&model, &aside).unwrap();
    let stderr = refused(&mut convert(&fixture(), &model, &["--quant", "q8"]));
    assert!(stderr.contains("already exists"), "{stderr}");
    assert!(
        model.join("manifest.json").is_file(),
        "the model was not put back"
    );
    assert_eq!(leftovers(tmp.path()), Vec::<String>::new());
    generates(&model);
}

/// Holds `output`'s conversion lock, as a process converting into it
/// would, while `n` copies of a command start; releases it once every
/// copy says it is waiting, so that all of them run at the same time.
/// Returns each copy's status, stdout and stderr.
fn together(
    output: &Path,
    n: usize,
    make: impl Fn() -> Process,
) -> Vec<(Option<i32>, String, String)> {
    let parent = output.parent().unwrap();
    fs::create_dir_all(parent).unwrap();
    let name = output.file_name().unwrap().to_string_lossy();
    let lock_path = parent.join(format!(".{name}.moeflux-lock"));
    let lock = fs::File::create(&lock_path).unwrap();
    lock.lock().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let children: Vec<_> = (0..n)
        .map(|i| {
            let err = fs::File::create(logs.path().join(format!("{i}.err"))).unwrap();
            make()
                .stdout(Stdio::piped())
                .stderr(Stdio::from(err))
                .spawn()
                .unwrap()
        })
        .collect();
    let start = Instant::now();
    let waiting = || {
        (0..n)
            .filter(|i| {
                fs::read_to_string(logs.path().join(format!("{i}.err")))
                    .unwrap_or_default()
                    .contains("waiting")
            })
            .count()
    };
    while waiting() < n {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "only {} of {n} processes waited for the lock",
            waiting()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Let go as a converting process does: remove the file, then unlock.
    fs::remove_file(&lock_path).unwrap();
    lock.unlock().unwrap();
    children
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let out = c.wait_with_output().unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                fs::read_to_string(logs.path().join(format!("{i}.err"))).unwrap(),
            )
        })
        .collect()
}

/// The bundled model's folder name in a model cache.
fn bundled_name() -> String {
    let cache = tempfile::tempdir().unwrap();
    let out = moeflux()
        .env("MOEFLUX_CACHE", cache.path())
        .arg("inspect")
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let dir = PathBuf::from(stdout.lines().next().unwrap()["model".len()..].trim());
    dir.file_name().unwrap().to_string_lossy().into_owned()
}

#[test]
fn concurrent_first_uses_of_the_bundled_model_all_succeed() {
    let cache = tempfile::tempdir().unwrap();
    let runs = together(&cache.path().join(bundled_name()), 6, || {
        let mut p = Process::cargo_bin("moeflux").unwrap();
        p.env("MOEFLUX_CACHE", cache.path()).args([
            "generate",
            "-p",
            "It is a truth",
            "-n",
            "8",
            "--temp",
            "0",
        ]);
        p
    });
    for (status, _, stderr) in &runs {
        assert_eq!(*status, Some(0), "stderr:\n{stderr}");
    }
    assert!(runs.iter().all(|r| r.1 == runs[0].1), "texts differ");
    let converted = runs
        .iter()
        .filter(|r| r.2.contains("(first use only)"))
        .count();
    assert_eq!(
        converted, 1,
        "one process converts, the others use its result"
    );
    let entries: Vec<_> = fs::read_dir(cache.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(entries.len(), 1, "cache holds {entries:?}");
    assert!(entries[0].starts_with("qwen35-tiny-bf16-"), "{entries:?}");
}

#[test]
fn leftovers_of_a_killed_first_use_are_cleaned() {
    let cache = tempfile::tempdir().unwrap();
    let name = bundled_name();
    // As a first use killed while unpacking and converting would leave.
    for side in ["source-77-1", "partial-77-2"] {
        fs::create_dir(cache.path().join(format!(".{name}.moeflux-{side}"))).unwrap();
    }
    moeflux()
        .env("MOEFLUX_CACHE", cache.path())
        .args(["generate", "-p", "It is", "-n", "2", "-q"])
        .assert()
        .success();
    assert_eq!(leftovers(cache.path()), Vec::<String>::new());
    assert!(cache.path().join(&name).join("manifest.json").is_file());
}

#[test]
fn concurrent_conversions_to_one_output_all_succeed() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("out/model");
    let runs = together(&model, 6, || {
        let mut p = Process::cargo_bin("moeflux").unwrap();
        p.arg("convert").arg(fixture()).arg("-o").arg(&model);
        p
    });
    for (status, _, stderr) in &runs {
        assert_eq!(*status, Some(0), "stderr:\n{stderr}");
    }
    assert_eq!(leftovers(&tmp.path().join("out")), Vec::<String>::new());
    generates(&model);
}

#[test]
fn ctrl_c_stops_a_conversion_and_removes_what_it_staged() {
    let tmp = tempfile::tempdir().unwrap();
    let output = tmp.path().join("synthetic");
    let mut child = Process::cargo_bin("moeflux")
        .unwrap()
        .args(["synth", "--preset", "qwen3-30b-a3b", "--layers", "2", "-o"])
        .arg(&output)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until it is writing into its staging folder.
    let start = Instant::now();
    while !leftovers(tmp.path()).iter().any(|n| n.contains("partial")) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no staging folder appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: sends a signal to our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(130), "stderr:\n{stderr}");
    assert!(stderr.contains("interrupted"), "stderr:\n{stderr}");
    assert!(!output.exists());
    assert_eq!(leftovers(tmp.path()), Vec::<String>::new());
}
