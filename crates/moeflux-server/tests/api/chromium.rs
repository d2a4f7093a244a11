//! The chat page at `/` in a real headless Chromium (Debian's `chromium`,
//! installed by tools/chromium.sh): the test types a question into the
//! page and presses Enter, waits for the streamed answer, takes a
//! screenshot and checks it: the answer in the page is the one the API
//! gives for the same request, it is still there when the screenshot is
//! taken, and the PNG (decoded here) has text pixels in the answer's
//! bubble. The screenshot is left in the target directory
//! (`tmp/chat-page.png`).
//!
//! The browser is driven over the Chrome DevTools Protocol on
//! `--remote-debugging-pipe` (JSON messages ended by a NUL byte, on file
//! descriptors 3 and 4, here two FIFOs), so no WebSocket client is needed.
//!
//! Without Chromium the test prints that it is skipped and passes, unless
//! MOEFLUX_REQUIRE_CHROMIUM is set (as .ci/run sets it), when it fails.
//! MOEFLUX_CHROMIUM names another browser binary.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use crate::common::start;
use base64::Engine;
use serde_json::{Value, json};

const QUESTION: &str = "Who is Mr. Darcy?";
const MAX_TOKENS: usize = 40;
const WIDTH: u32 = 1000;
const HEIGHT: u32 = 700;

fn find_chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("MOEFLUX_CHROMIUM") {
        return Some(path.into());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| {
            ["chromium", "chromium-browser", "google-chrome"].map(|name| dir.join(name))
        })
        .find(|p| p.is_file())
}

/// A browser on the DevTools pipe.
struct Browser {
    child: Child,
    to: File,
    from: Receiver<Value>,
    next_id: u64,
    _profile: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Browser {
    fn launch(binary: &Path) -> Browser {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "chromium-{}-{}",
            std::process::id(),
            Instant::now().elapsed().as_nanos()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let profile = TempDir(dir.clone());
        for fifo in ["in", "out"] {
            let made = Command::new("mkfifo").arg(dir.join(fifo)).status().unwrap();
            assert!(made.success(), "mkfifo failed");
        }
        // The shell gives the browser the FIFOs as descriptors 3 and 4.
        let child = Command::new("sh")
            .arg("-c")
            .arg(r#"dir=$1; shift; exec "$@" 3<"$dir/in" 4>"$dir/out""#)
            .arg("sh")
            .arg(&dir)
            .arg(binary)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--hide-scrollbars",
                "--remote-debugging-pipe",
                &format!("--window-size={WIDTH},{HEIGHT}"),
                &format!("--user-data-dir={}", dir.join("profile").display()),
                "about:blank",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(dir.join("stderr.log")).unwrap())
            .spawn()
            .expect("starting chromium");
        // Opening a FIFO waits for its other end: in a thread, bounded.
        let (opened, pipes) = channel();
        let fifos = dir.clone();
        std::thread::spawn(move || {
            let to = File::options().write(true).open(fifos.join("in"));
            let from = to.and_then(|to| Ok((to, File::open(fifos.join("out"))?)));
            let _ = opened.send(from);
        });
        let (to, from) = match pipes.recv_timeout(Duration::from_secs(30)) {
            Ok(pipes) => pipes.unwrap(),
            Err(_) => panic!(
                "chromium did not open its DevTools pipe in 30 s; its stderr:\n{}",
                std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default()
            ),
        };
        let (messages, inbox) = channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(from);
            let mut message = Vec::new();
            while reader.read_until(0, &mut message).is_ok_and(|n| n > 0) {
                if message.last() == Some(&0) {
                    message.pop();
                }
                let Ok(value) = serde_json::from_slice(&message) else {
                    return;
                };
                if messages.send(value).is_err() {
                    return;
                }
                message.clear();
            }
        });
        Browser {
            child,
            to,
            from: inbox,
            next_id: 0,
            _profile: profile,
        }
    }

    /// Calls a DevTools method (on a page when `session` is given) and
    /// returns its result; events on the way are dropped.
    fn call(&mut self, session: Option<&str>, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({"id": id, "method": method, "params": params});
        if let Some(session) = session {
            message["sessionId"] = session.into();
        }
        let mut bytes = serde_json::to_vec(&message).unwrap();
        bytes.push(0);
        self.to.write_all(&bytes).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.from.recv_timeout(left) {
                Ok(reply) if reply["id"] == id => {
                    assert!(reply.get("error").is_none(), "{method}: {reply}");
                    return reply["result"].clone();
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => panic!("{method}: no answer in 30 s"),
                Err(RecvTimeoutError::Disconnected) => panic!("{method}: chromium went away"),
            }
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A page of the browser.
struct Page<'b> {
    browser: &'b mut Browser,
    session: String,
}

impl Page<'_> {
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.browser.call(Some(&self.session), method, params)
    }

    /// Evaluates a JavaScript expression; its value, as JSON.
    fn eval(&mut self, expression: &str) -> Value {
        let result = self.call(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
        );
        assert!(
            result.get("exceptionDetails").is_none(),
            "{expression}: {result}"
        );
        result["result"]["value"].clone()
    }

    /// Waits (up to `limit`) until `expression` is truthy; its value.
    fn wait_for(&mut self, expression: &str, limit: Duration) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let value = self.eval(expression);
            if !(value.is_null() || value == false || value == "") {
                return value;
            }
            assert!(
                Instant::now() < deadline,
                "waited {limit:?} for {expression}"
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn key(&mut self, kind: &str, key: &str, code: u32, text: Option<&str>) {
        let mut params = json!({"type": kind, "key": key, "windowsVirtualKeyCode": code});
        if let Some(text) = text {
            params["text"] = text.into();
        }
        self.call("Input.dispatchKeyEvent", params);
    }
}

/// The state of the last answer's bubble, as the page shows it.
const ANSWER: &str = r#"(() => {
  const box = [...document.querySelectorAll(".msg.assistant")].pop();
  if (!box) return null;
  const r = box.getBoundingClientRect();
  return { text: box.firstChild.textContent, speed: box.querySelector(".speed").textContent,
           error: box.classList.contains("error"), busy: document.getElementById("send").disabled,
           rect: [r.left, r.top, r.width, r.height], scale: window.devicePixelRatio };
})()"#;

/// Pixels in the rectangle (in CSS pixels, scaled) of an RGB(A) image
/// that are dark, as text is on the bubble's light grey.
fn dark_pixels(png: &[u8], rect: [f64; 4], scale: f64) -> (usize, usize, (u32, u32)) {
    let mut decoder = png::Decoder::new(std::io::Cursor::new(png));
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().unwrap();
    let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut pixels).unwrap();
    let channels = info.color_type.samples();
    assert!(channels >= 3, "{:?}", info.color_type);
    let [left, top, width, height] = rect.map(|v| (v * scale).round() as usize);
    let (mut dark, mut all) = (0, 0);
    for y in top..(top + height).min(info.height as usize) {
        for x in left..(left + width).min(info.width as usize) {
            let p = &pixels[y * info.line_size + x * channels..][..3];
            let luma = (299 * p[0] as u32 + 587 * p[1] as u32 + 114 * p[2] as u32) / 1000;
            all += 1;
            dark += (luma < 128) as usize;
        }
    }
    (dark, all, (info.width, info.height))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chat_page_streams_an_answer_in_chromium() {
    let required = std::env::var_os("MOEFLUX_REQUIRE_CHROMIUM").is_some();
    let Some(binary) = find_chromium() else {
        assert!(
            !required,
            "MOEFLUX_REQUIRE_CHROMIUM is set but no chromium was found: run tools/chromium.sh"
        );
        eprintln!(
            "SKIPPED: the chat page test needs Chromium: run tools/chromium.sh (Debian's chromium)"
        );
        return;
    };
    let server = start(|_| {}).await;
    let page_url = server.url("/");

    // The same request through the API, for the answer the page must show.
    let (status, expected) = server
        .post(
            "/v1/chat/completions",
            &json!({
                "messages": [{"role": "user", "content": QUESTION}],
                "temperature": 0, "max_tokens": MAX_TOKENS,
                "chat_template_kwargs": {"enable_thinking": false},
            }),
        )
        .await;
    assert_eq!(status, 200, "{expected}");
    let expected = expected["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!expected.trim().is_empty());

    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("chat-page.png");
    let path = shot.clone();
    let seen = tokio::task::spawn_blocking(move || {
        let mut browser = Browser::launch(&binary);
        let target = browser.call(None, "Target.createTarget", json!({"url": "about:blank"}));
        let attached = browser.call(
            None,
            "Target.attachToTarget",
            json!({"targetId": target["targetId"], "flatten": true}),
        );
        let session = attached["sessionId"].as_str().unwrap().to_string();
        let mut page = Page {
            browser: &mut browser,
            session,
        };
        page.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": false}),
        );
        page.call("Page.navigate", json!({"url": page_url}));
        // Loaded, and the model's name read from /v1/models.
        let name = page.wait_for(
            "document.readyState === 'complete' && document.getElementById('model').textContent === 'qwen35-tiny' && 'ok'",
            Duration::from_secs(20),
        );
        assert_eq!(name, "ok");
        page.eval(&format!(
            "document.getElementById('temperature').value = '0'; \
             document.getElementById('max_tokens').value = '{MAX_TOKENS}'; \
             document.getElementById('input').focus(); true"
        ));
        // Every version of the answer the page shows, as it streams.
        page.eval(
            "window.seen = []; new MutationObserver(() => { \
               const box = [...document.querySelectorAll('.msg.assistant')].pop(); \
               const t = box && box.firstChild ? box.firstChild.textContent : ''; \
               if (t && window.seen[window.seen.length - 1] !== t) window.seen.push(t); \
             }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true}); true",
        );
        for c in QUESTION.chars() {
            let text = c.to_string();
            // Windows key codes are the upper-case letters, digits and
            // space; punctuation goes without one (46 would be Delete).
            let code = if c.is_ascii_alphanumeric() || c == ' ' {
                c.to_ascii_uppercase() as u32
            } else {
                0
            };
            page.key("keyDown", &text, code, Some(&text));
            page.key("keyUp", &text, code, None);
        }
        assert_eq!(
            page.eval("document.getElementById('input').value"),
            QUESTION
        );
        page.key("rawKeyDown", "Enter", 13, None);
        page.key("char", "Enter", 13, Some("\r"));
        page.key("keyUp", "Enter", 13, None);
        // The answer is complete when the speed line is written.
        let done = page.wait_for(
            &format!("(() => {{ const a = {ANSWER}; return a && !a.busy && (a.speed || a.error) && a; }})()"),
            Duration::from_secs(60),
        );
        assert_eq!(done["error"], false, "the page showed an error: {done}");
        let screenshot = page.call("Page.captureScreenshot", json!({"format": "png"}));
        let after = page.eval(ANSWER);
        let seen = page.eval("window.seen");
        let png = base64::engine::general_purpose::STANDARD
            .decode(screenshot["data"].as_str().unwrap())
            .unwrap();
        std::fs::write(&path, &png).unwrap();
        (done, after, seen, png)
    })
    .await
    .unwrap();
    let (done, after, versions, png) = seen;
    // The page's answer is the API's, and so it was at the screenshot.
    assert_eq!(done["text"], expected.as_str(), "{done}");
    assert_eq!(after["text"], done["text"]);
    assert!(
        done["speed"].as_str().unwrap().contains("tokens in"),
        "{done}"
    );
    // Streamed: the page showed the answer growing, not only whole.
    let versions = versions.as_array().unwrap();
    assert_eq!(versions.last().unwrap(), expected.as_str());
    assert!(
        versions.len() > 1,
        "the answer appeared in one piece: {versions:?}"
    );
    // The bubble in the screenshot holds text: dark pixels on light grey.
    let rect: Vec<f64> = done["rect"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let (dark, all, size) = dark_pixels(
        &png,
        rect.clone().try_into().unwrap(),
        done["scale"].as_f64().unwrap(),
    );
    assert!(
        all > 1000,
        "the answer's bubble {rect:?} is off the {size:?} screenshot"
    );
    assert!(
        dark > 100 && dark < all / 2,
        "{dark} dark pixels of {all} in the answer's bubble {rect:?}"
    );
    println!(
        "chat page in {}: answer of {} characters shown in {} streamed versions; screenshot {}x{} \
         with {dark} text pixels of {all} in the answer's bubble: {}",
        find_chromium().unwrap().display(),
        expected.chars().count(),
        versions.len(),
        size.0,
        size.1,
        shot.display()
    );
}
