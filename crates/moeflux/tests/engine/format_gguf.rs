//! GGUF input (llama.cpp's format), against files the `gguf` Python package
//! wrote (tools/make_format_fixtures.py, fixtures/formats/gguf/):
//! every tensor type moeflux reads against gguf.quants.dequantize, the
//! qwen3_5_moe fixture converted the way llama.cpp's convert_hf_to_gguf.py
//! converts Qwen3.5-MoE (split in two files) mapped back tensor by tensor
//! and compared by logits, the bundled model's tokenizer rebuilt from a
//! vocabulary-only GGUF, and a corpus of malformed files.
//!
//! tests/engine/fuzz_headers.rs fuzzes the header parser (`GgufFile::validate`)
//! for a few seconds in every run; `gguf_headers_survive_byte_flips` is a
//! deterministic check beside it.

use std::path::{Path, PathBuf};

use crate::common::{Reference, fixtures_root};
use crate::format_support::*;
use moeflux::convert::gguf::{GgufFile, rebuild_tokenizer};
use moeflux::convert::{ConvertOptions, Input, convert};
use moeflux::quant::DType;
use moeflux::text::{ChatMessage, ChatOptions, ChatTemplate, Tokenizer};
use moeflux::util::NoProgress;

fn gguf_dir() -> PathBuf {
    formats_root().join("gguf")
}

fn fixture_gguf() -> PathBuf {
    gguf_dir().join("qwen3_5_moe-00001-of-00002.gguf")
}

/// Every type moeflux reads decodes as gguf.quants.dequantize decodes it
/// (ggml's reference dequantizers): within 1 ulp of f32.
#[test]
fn gguf_types_dequantize_as_gguf_quants_does() {
    let file = GgufFile::open(&gguf_dir().join("types.gguf")).unwrap();
    let mut seen = 0;
    for t in file.tensors() {
        let Some(ty) = t.name.strip_prefix("t.") else {
            continue;
        };
        assert_eq!(t.ggml_type.name(), ty);
        let got = file.read_tensor(&t.name).unwrap();
        let want = file.read_tensor(&format!("ref.{ty}")).unwrap();
        assert_eq!(got.len(), want.len());
        assert_ulps(ty, &got, &want, 1);
        seen += 1;
    }
    assert_eq!(
        seen, 13,
        "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K"
    );
}

/// The largest error a GGUF type's rounding allows, relative to the
/// largest magnitude of the 32-value block: half a step, but a whole step
/// for the value Q4_0 and Q5_0 clamp (their scale maps the largest
/// magnitude to -8 or -16, so its opposite, +8 or +16, is clamped to
/// 7 or 15), plus the f16 rounding of the block's scale and offset.
fn block_tolerance(bits: f64) -> f32 {
    match bits {
        b if b >= 16.0 => 0.0,
        b if b >= 8.0 => 1.0 / 100.0, // Q8_0: half of amax/127
        b if b >= 5.5 => 1.0 / 15.0,  // Q5_0: amax/16; Q5_1: half of range/31
        _ => 1.0 / 7.0,               // Q4_0: amax/8; Q4_1: half of range/15
    }
}

/// Each Hugging Face tensor of `hf` read back from the GGUF input `gguf`
/// equals the original within the rounding of the GGUF type that stores
/// it; returns how many were compared.
fn compare_tensors(gguf: &Path, hf: &Path) -> usize {
    let gguf = Input::open(gguf).unwrap();
    let hf = Input::open(hf).unwrap();
    let mut compared = 0;
    for name in hf.tensor_names() {
        if name.ends_with("in_proj_qkvz.weight") || name.ends_with("in_proj_ba.weight") {
            // Qwen3-Next's fused projections come back split (as Qwen3.5
            // stores them); the logits check them.
            continue;
        }
        if name.starts_with("mtp.") {
            // GGUF files (llama.cpp's converter, and the fixture's writer
            // after it) leave the multi-token-prediction head out.
            continue;
        }
        let gguf_name = name.replace("model.language_model.", "model.");
        let want = hf.read(name).unwrap();
        // transformers 5's fused experts [E, 2I, H] / [E, H, I] come back
        // per expert.
        let fused = ["gate_up_proj", "down_proj"]
            .into_iter()
            .find(|p| gguf_name.ends_with(&format!("mlp.experts.{p}")));
        let (got, bits) = match fused {
            Some(proj) => {
                let base = gguf_name.trim_end_matches(proj);
                let parts: &[&str] = if proj == "down_proj" {
                    &["down_proj"]
                } else {
                    &["gate_proj", "up_proj"]
                };
                let experts = hf.shape(name).unwrap()[0];
                let mut got = Vec::new();
                let mut bits = f64::MAX;
                for e in 0..experts {
                    for p in parts {
                        let n = format!("{base}{e}.{p}.weight");
                        got.extend(gguf.read(&n).unwrap());
                        bits = bits.min(gguf.stored_bits(&n).unwrap());
                    }
                }
                (got, bits)
            }
            None => {
                let shape = gguf
                    .shape(&gguf_name)
                    .unwrap_or_else(|| panic!("{gguf_name} is missing from the GGUF input"));
                assert_eq!(shape, hf.shape(name).unwrap(), "{name}: shape");
                (
                    gguf.read(&gguf_name).unwrap(),
                    gguf.stored_bits(&gguf_name).unwrap(),
                )
            }
        };
        assert_eq!(got.len(), want.len(), "{name}: size");
        let tol = block_tolerance(bits);
        for (b, (g, w)) in got.chunks(32).zip(want.chunks(32)).enumerate() {
            let amax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (g, w) in g.iter().zip(w) {
                // (F16 keeps values below 2^-14 as subnormals, steps of 2^-24.)
                let bound = if name.ends_with("A_log") {
                    1e-6 * w.abs().max(1.0)
                } else {
                    tol * amax + 2f32.powi(-25)
                };
                assert!(
                    (g - w).abs() <= bound,
                    "{name} block {b}: {g} vs {w} (stored at {bits} bits/weight)"
                );
            }
        }
        compared += 1;
    }
    compared
}

/// Each Hugging Face tensor read back from the GGUF (names, stacked
/// experts, value-head order, `1 + w` norms, `-exp(A_log)`, the squeezed
/// convolution all undone) equals the original fixture's within the
/// rounding of the GGUF type that stores it; f32, f16 and bf16 tensors
/// exactly (but for f16's subnormals), `A_log` within 1e-6 of its value
/// (ln of exp).
#[test]
fn gguf_tensors_map_back_to_the_hugging_face_checkpoint() {
    let hf = fixtures_root().join("qwen3_5_moe").join("hf");
    let compared = compare_tensors(&fixture_gguf(), &hf);
    assert!(compared > 100, "{compared} tensors compared");
}

/// The configuration rebuilt from the GGUF metadata is the fixture's.
#[test]
fn gguf_config_matches_the_fixture() {
    let gguf = Input::open(&fixture_gguf()).unwrap();
    let path = fixtures_root()
        .join("qwen3_5_moe")
        .join("hf")
        .join("config.json");
    let original: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let a = moeflux::ModelConfig::from_hf_json(gguf.config_json(), Path::new("gguf")).unwrap();
    let b = moeflux::ModelConfig::from_hf_json(&original, &path).unwrap();
    // The GGUF has no multi-token-prediction head, the fixture one.
    assert!(a.mtp.is_none() && b.mtp.is_some());
    let b = moeflux::ModelConfig { mtp: None, ..b };
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
}

/// Logits of the GGUF converted to bf16 against the bf16 conversion of the
/// fixture. The GGUF's experts are Q4_0/Q4_1/Q5_x, its projections Q8_0 and
/// Q5_x: 4-bit expert weights dominate, of the order of moeflux's own q4
/// (the transformers tests measure 1.6e-1 to 2.1e-1 for q4 against the
/// unquantized models, near a routing flip): bound 3e-1 (measured 9.0e-2),
/// top-1 agreement at least 70% (measured 92%). keep-nearest stores the
/// 4- and 5-bit matrices as q4 and Q8_0 as q8, re-quantizing on top:
/// bound 4e-1 (measured 1.8e-1, top-1 85%).
#[test]
fn gguf_logits_are_close_to_the_bf16_fixture() {
    let name = "qwen3_5_moe";
    let reference = Reference::load(name);
    let tokens = reference.tokens("tokens_long");
    let (_, vocab, _) = reference.logits("logits_long");
    let original = convert_as(&fixtures_root().join(name).join("hf"), DType::Bf16, false);
    let want = logits(&original.dir, &tokens);
    for (keep_nearest, quant, bound) in [(false, DType::Bf16, 3e-1), (true, DType::Bf16, 4e-1)] {
        let converted = convert_as(&fixture_gguf(), quant, keep_nearest);
        if keep_nearest {
            let m = manifest(&converted.dir);
            assert_eq!(m.tensors["layers.0.linear_attn.in_proj"].dtype, DType::Q8);
            assert_eq!(m.tensors["layers.0.linear_attn.out_proj"].dtype, DType::Q4);
        }
        assert!(
            converted.summary.unknown.is_empty(),
            "{:?}",
            converted.summary.unknown
        );
        let got = logits(&converted.dir, &tokens);
        let err = max_row_error(&got, &want, vocab);
        let top1 = crate::common::top1_agreement(&got, &want, vocab);
        println!(
            "gguf (keep-nearest {keep_nearest}) vs bf16 fixture: max rel err {err:.3e}, top-1 {:.0}%",
            top1 * 100.0
        );
        assert!(
            err <= bound,
            "GGUF logits: relative error {err:.3e} > {bound:.0e}"
        );
        assert!(top1 >= 0.7, "GGUF logits: top-1 agreement {top1}");
    }
}

/// The tokenizer rebuilt from a vocabulary-only GGUF of the bundled model
/// (written as convert_hf_to_gguf.py writes vocabularies) tokenizes,
/// detokenizes and renders chats as the bundled tokenizer does.
#[test]
fn gguf_tokenizer_rebuilds_the_bundled_tokenizer() {
    let file = GgufFile::open(&gguf_dir().join("vocab.gguf")).unwrap();
    assert!(file.tensors().is_empty());
    let rebuilt = rebuild_tokenizer(&file).unwrap();
    assert!(rebuilt.notes.is_empty(), "{:?}", rebuilt.notes);
    let tmp = tempfile::tempdir().unwrap();
    for (name, bytes) in &rebuilt.files {
        std::fs::write(tmp.path().join(name), bytes).unwrap();
    }
    let bundled_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bundled/qwen35-tiny");
    let rebuilt = Tokenizer::from_dir(tmp.path()).unwrap();
    let bundled = Tokenizer::from_dir(&bundled_dir).unwrap();
    let text = std::fs::read_to_string(bundled_dir.join("heldout.txt")).unwrap();
    let text =
        format!("{text}\n<|im_start|>user\nWhat of Mr. Darcy?<|im_end|>\n<think>\n\n</think>");
    let ids = bundled.encode(&text, true).unwrap();
    assert_eq!(rebuilt.encode(&text, true).unwrap(), ids);
    assert_eq!(
        rebuilt.decode(&ids, false).unwrap(),
        bundled.decode(&ids, false).unwrap()
    );
    assert_eq!(
        rebuilt.decode(&ids, true).unwrap(),
        bundled.decode(&ids, true).unwrap()
    );
    let (a, b) = (rebuilt.special_tokens(), bundled.special_tokens());
    assert_eq!(a.eos, b.eos);
    assert_eq!(a.pad, b.pad);
    assert_eq!(a.stop_ids, b.stop_ids);
    let messages = [
        ChatMessage::system("You are Jane."),
        ChatMessage::user("Who is Emma?"),
        ChatMessage::assistant("<think>\nShe is a heroine.\n</think>\n\nA heroine."),
        ChatMessage::user("And Harriet?"),
    ];
    let options = ChatOptions {
        add_generation_prompt: true,
        ..ChatOptions::default()
    };
    let render = |dir: &Path, t: &Tokenizer| {
        ChatTemplate::from_dir(dir, t.special_tokens(), None)
            .unwrap()
            .render(&messages, &options)
            .unwrap()
    };
    assert_eq!(render(tmp.path(), &rebuilt), render(&bundled_dir, &bundled));
}

/// Each malformed file of fixtures/formats/gguf/malformed is refused with
/// an error naming the file and what is wrong; conversion writes nothing.
#[test]
fn malformed_gguf_files_are_refused_clearly() {
    let expected: &[(&str, &str)] = &[
        ("bad_magic", "not a GGUF file"),
        ("bad_version", "version 7 is not supported"),
        ("truncated_header", "truncated"),
        ("truncated_metadata", "metadata"),
        ("truncated_tensor_info", "tensor `a`"),
        ("truncated_data", "run past the end of the data section"),
        ("huge_tensor_count", "tensor_count"),
        ("huge_kv_count", "metadata_kv_count"),
        ("huge_key_length", "metadata key 0"),
        ("huge_string_length", "general.name"),
        ("huge_array_count", "tokenizer.ggml.tokens"),
        ("huge_dimensions", "overflow"),
        ("bad_value_type", "unknown value type 99"),
        ("bad_array_type", "unknown value type 77"),
        ("nested_array", "arrays of arrays"),
        ("bad_bool", "bool value 2"),
        ("bad_ggml_type", "ggml type 99"),
        ("unsupported_ggml_type", "MXFP4"),
        ("non_utf8_key", "not valid UTF-8"),
        ("overlapping_tensors", "overlap"),
        ("overlapping_offsets", "overlap"),
        ("offset_past_end", "run past the end"),
        ("misaligned_offset", "alignment"),
        ("too_many_dims", "5 dimensions"),
        ("zero_dims", "0 dimensions"),
        ("zero_size", "not a usable size"),
        ("partial_block", "blocks of 32"),
        ("duplicate_tensor", "appears twice"),
        ("duplicate_key", "appears twice"),
        ("bad_alignment", "general.alignment"),
    ];
    let dir = gguf_dir().join("malformed");
    let count = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(
        count,
        expected.len(),
        "every file of {} has its case",
        dir.display()
    );
    let out = tempfile::tempdir().unwrap();
    for (name, what) in expected {
        let path = dir.join(format!("{name}.gguf"));
        let err = match GgufFile::open(&path) {
            Ok(_) => panic!("{name}: opened"),
            Err(e) => e.to_string(),
        };
        println!("{name}: {err}");
        assert!(
            err.contains(&format!("{name}.gguf")),
            "{name}: the error does not name the file: {err}"
        );
        assert!(err.contains(what), "{name}: expected {what:?} in: {err}");
        let output = out.path().join(name);
        let converted = convert(&path, &output, &ConvertOptions::default(), &NoProgress);
        assert!(converted.is_err(), "{name}: converted");
        assert!(
            !output.exists(),
            "{name}: conversion left {}",
            output.display()
        );
    }
}

/// Every truncation of a GGUF file is refused (a file cut inside its
/// final padding is still whole) and never panics.
#[test]
fn truncated_gguf_files_are_refused() {
    for source in [
        "types.gguf",
        "qwen3_5_moe-00001-of-00002.gguf",
        "vocab.gguf",
    ] {
        let path = gguf_dir().join(source);
        let bytes = std::fs::read(&path).unwrap();
        let whole = GgufFile::open(&path).unwrap();
        let data_end = whole
            .tensors()
            .iter()
            .map(|t| t.start + t.nbytes)
            .max()
            .unwrap_or(0);
        let lengths = (0..bytes.len().min(4096)).chain((4096..bytes.len()).step_by(97));
        for len in lengths {
            match GgufFile::validate(&bytes[..len], &path) {
                Ok(()) => assert!(
                    len >= data_end && data_end > 0,
                    "{source} cut at {len} of {} bytes opened",
                    bytes.len()
                ),
                Err(e) => assert!(e.to_string().contains(source), "{e}"),
            }
        }
        // The same through a file and the conversion.
        let tmp = tempfile::tempdir().unwrap();
        let cut = tmp.path().join(source);
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        assert!(GgufFile::open(&cut).is_err());
        let output = tmp.path().join("model");
        assert!(convert(&cut, &output, &ConvertOptions::default(), &NoProgress).is_err());
        assert!(!output.exists());
    }
}

/// Random byte changes in a header give an error or a file that opens;
/// never a panic.
#[test]
fn gguf_headers_survive_byte_flips() {
    let path = gguf_dir().join("types.gguf");
    let bytes = std::fs::read(&path).unwrap();
    let header = GgufFile::open(&path)
        .unwrap()
        .tensors()
        .iter()
        .map(|t| t.start)
        .min()
        .unwrap();
    let mut rng = moeflux::util::SplitMix64(19);
    let mut refused = 0;
    for _ in 0..5000 {
        let mut b = bytes.clone();
        for _ in 0..1 + (rng.next_unit() * 3.0) as usize {
            let at = (rng.next_unit() * header as f32) as usize % header;
            b[at] = (rng.next_unit() * 256.0) as u8;
        }
        if GgufFile::validate(&b, &path).is_err() {
            refused += 1;
        }
    }
    assert!(refused > 0);
}

/// Split parts must all be there and be passed by their first part.
#[test]
fn gguf_split_parts_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let first = tmp.path().join("m-00001-of-00002.gguf");
    std::fs::copy(fixture_gguf(), &first).unwrap();
    let err = Input::open(&first).err().unwrap().to_string();
    assert!(
        err.contains("m-00002-of-00002.gguf") && err.contains("missing"),
        "{err}"
    );
    let second = tmp.path().join("m-00002-of-00002.gguf");
    std::fs::copy(gguf_dir().join("qwen3_5_moe-00002-of-00002.gguf"), &second).unwrap();
    let err = Input::open(&second).err().unwrap().to_string();
    assert!(err.contains("pass the first part"), "{err}");
    assert!(Input::open(&first).is_ok());
}

/// The bundled model written as a BF16 GGUF by the `gguf` package (with
/// its tokenizer and chat template) converts back to a model that
/// generates the bundled model's text. The file is 16 MB, so not committed:
/// `python tools/make_format_fixtures.py bundled-gguf --out
/// target/format-fixtures/qwen35-tiny.gguf` writes it (or set
/// MOEFLUX_BUNDLED_GGUF to its path).
#[test]
#[ignore = "needs the GGUF written by tools/make_format_fixtures.py bundled-gguf"]
fn bundled_model_round_trips_through_gguf() {
    use moeflux::text::{Completion, complete};
    let path = std::env::var_os("MOEFLUX_BUNDLED_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/format-fixtures/qwen35-tiny.gguf")
        });
    assert!(path.is_file(), "{} is missing", path.display());
    let converted = convert_as(&path, DType::Bf16, false);
    let bundled = moeflux::bundled::model_dir(&NoProgress).unwrap();
    let open = |dir: &Path| {
        std::sync::Arc::new(moeflux::Model::open(dir, &moeflux::ModelOptions::default()).unwrap())
    };
    let (a, b) = (open(&converted.dir), open(&bundled));
    for (prompt, chat) in [
        ("It is a truth universally acknowledged, that", false),
        ("Emma Woodhouse, handsome, clever, and rich,", false),
        ("Who is Mr. Knightley?", true),
    ] {
        let mut request = Completion::new(prompt, 48);
        request.chat = chat;
        let got = complete(&a, &request).unwrap();
        let want = complete(&b, &request).unwrap();
        println!("{prompt}{}", got.text);
        assert_eq!(got.text, want.text, "{prompt}");
    }
}

/// The qwen3_moe, qwen3_next and qwen3_5_moe fixtures written as Q8_0 GGUFs
/// (routers F32) the way convert_hf_to_gguf.py writes qwen3moe, qwen3next
/// and qwen35moe map back tensor by tensor, and their logits stay within
/// Q8_0's error of the bf16 conversions: 95th percentile of the positions'
/// relative errors ≤ 3e-2 (q8's bound in the transformers tests; measured
/// up to 9.6e-3), max ≤ 2e-1 (the one position where an expert choice
/// flips: measured up to 1.2e-1), the same top-1 token at ≥ 85% of the
/// positions (measured 96 to 98%). 1.7 MB of files, so not committed:
/// `python tools/make_format_fixtures.py families-gguf --out
/// target/format-fixtures` writes them (or set MOEFLUX_FORMAT_FIXTURES to
/// their folder).
#[test]
#[ignore = "needs the GGUFs written by tools/make_format_fixtures.py families-gguf"]
fn every_family_round_trips_through_gguf() {
    let dir = std::env::var_os("MOEFLUX_FORMAT_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/format-fixtures")
        });
    for name in ["qwen3_moe", "qwen3_next", "qwen3_5_moe"] {
        let path = dir.join(format!("{name}.gguf"));
        assert!(path.is_file(), "{} is missing", path.display());
        let hf = fixtures_root().join(name).join("hf");
        compare_tensors(&path, &hf);
        let reference = Reference::load(name);
        let tokens = reference.tokens("tokens_long");
        let (_, vocab, _) = reference.logits("logits_long");
        let want = logits(&convert_as(&hf, DType::Bf16, false).dir, &tokens);
        let got = logits(&convert_as(&path, DType::Bf16, false).dir, &tokens);
        let mut errors = crate::common::row_errors(&got, &want, vocab);
        errors.sort_by(f64::total_cmp);
        let (p95, max) = (
            errors[(errors.len() - 1) * 95 / 100],
            errors[errors.len() - 1],
        );
        let top1 = crate::common::top1_agreement(&got, &want, vocab);
        println!(
            "{name} Q8_0 GGUF vs bf16 fixture: rel err p95 {p95:.3e}, max {max:.3e}, top-1 {:.0}%",
            top1 * 100.0
        );
        assert!(
            p95 <= 3e-2 && max <= 2e-1 && top1 >= 0.85,
            "{name}: p95 {p95:.3e}, max {max:.3e}, top-1 {top1}"
        );
    }
}
