//! The samplers against hand-computed distributions and the bundled
//! model's generation settings.

use super::*;
use crate::text::tests::bundled_tokenizer;

fn sampler(config: SamplerConfig) -> Sampler {
    Sampler::new(config).unwrap()
}

fn sampling(temperature: f32) -> SamplerConfig {
    SamplerConfig {
        temperature,
        top_k: 0,
        seed: Some(7),
        ..SamplerConfig::default()
    }
}

/// Logits whose softmax is `probs`.
fn logits_of(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

fn ids(dist: &[(u32, f64)]) -> Vec<u32> {
    dist.iter().map(|&(id, _)| id).collect()
}

#[test]
fn the_same_seed_repeats_the_same_draws() {
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
    let draw = |seed| {
        let mut s = sampler(SamplerConfig {
            seed: Some(seed),
            ..sampling(1.0)
        });
        (0..64)
            .map(|_| s.sample(&logits, &[], &[]).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(draw(42), draw(42));
    assert_ne!(draw(42), draw(43));
    // No seed: one is drawn and reported, and replays the run.
    let mut s = sampler(SamplerConfig {
        seed: None,
        ..sampling(1.0)
    });
    let run: Vec<u32> = (0..64)
        .map(|_| s.sample(&logits, &[], &[]).unwrap())
        .collect();
    assert_eq!(run, draw(s.seed()));
}

#[test]
fn greedy_takes_the_first_largest_logit() {
    let mut s = sampler(SamplerConfig::default());
    assert!(s.config().is_greedy());
    assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0], &[], &[]).unwrap(), 1);
    assert_eq!(s.sample(&[f32::NAN, -5.0, f32::NAN], &[], &[]).unwrap(), 1);
    assert!(s.sample(&[f32::NAN], &[], &[]).is_err());
    assert!(s.sample(&[], &[], &[]).is_err());
}

#[test]
fn temperature_scales_the_logits() {
    let logits = [2.0f32, 1.0, 0.0];
    let dist = sampler(sampling(0.5)).distribution(&logits).unwrap();
    let z: f64 = [4.0f64, 2.0, 0.0].iter().map(|x| x.exp()).sum();
    for (&(id, p), want) in dist.iter().zip([4.0f64, 2.0, 0.0]) {
        assert!((p - want.exp() / z).abs() < 1e-6, "{id}: {p}");
    }
}

#[test]
fn a_tiny_temperature_is_nearly_greedy_not_nan() {
    let mut s = sampler(sampling(1e-30));
    for _ in 0..20 {
        assert_eq!(
            s.sample(&[1.0, 3.0e38, -3.0e38, 2.9e38], &[], &[]).unwrap(),
            1
        );
    }
}

#[test]
fn top_k_keeps_the_k_most_likely_and_ties() {
    let logits = [0.5f32, 3.0, 1.0, 2.0, -1.0, 2.0];
    let top = |k| {
        let s = sampler(SamplerConfig {
            top_k: k,
            ..sampling(1.0)
        });
        ids(&s.distribution(&logits).unwrap())
    };
    assert_eq!(top(1), [1]);
    assert_eq!(top(2), [1, 3, 5]); // the 2nd and 3rd tie
    assert_eq!(top(4), [1, 3, 5, 2]);
    assert_eq!(top(0).len(), 6);
    assert_eq!(top(99).len(), 6);
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_p() {
    let logits = logits_of(&[0.05, 0.5, 0.15, 0.3]);
    let top = |p| {
        let s = sampler(SamplerConfig {
            top_p: p,
            ..sampling(1.0)
        });
        s.distribution(&logits).unwrap()
    };
    assert_eq!(ids(&top(0.75)), [1, 3]); // 0.8 ≥ 0.75; 0.5 alone is not
    assert_eq!(ids(&top(0.85)), [1, 3, 2]);
    assert_eq!(ids(&top(0.96)), [1, 3, 2, 0]);
    assert_eq!(ids(&top(0.01)), [1]);
    let kept = top(0.75);
    assert!(
        (kept[0].1 - 0.5 / 0.8).abs() < 1e-6,
        "renormalized: {kept:?}"
    );
}

#[test]
fn min_p_is_relative_to_the_most_likely_token() {
    let logits = logits_of(&[0.05, 0.5, 0.15, 0.3]);
    let min = |m| {
        let s = sampler(SamplerConfig {
            min_p: m,
            ..sampling(1.0)
        });
        ids(&s.distribution(&logits).unwrap())
    };
    assert_eq!(min(0.2), [1, 3, 2]); // threshold 0.1
    assert_eq!(min(0.5), [1, 3]); // threshold 0.25
    assert_eq!(min(1.0), [1]);
}

#[test]
fn filters_apply_in_transformers_order() {
    // top-k 3 leaves {0.4, 0.3, 0.2} (renormalized 4/9, 3/9, 2/9); top-p
    // 0.7 then keeps the first two (7/9 ≥ 0.7), where top-p on the full
    // distribution would have kept the same two out of four.  min-p 0.8
    // then drops 3/7 < 0.8 * 4/7.
    let logits = logits_of(&[0.4, 0.3, 0.2, 0.1]);
    let s = sampler(SamplerConfig {
        top_k: 3,
        top_p: 0.7,
        min_p: 0.8,
        ..sampling(1.0)
    });
    assert_eq!(ids(&s.distribution(&logits).unwrap()), [0]);
    let s = sampler(SamplerConfig {
        top_k: 3,
        top_p: 0.7,
        ..sampling(1.0)
    });
    assert_eq!(ids(&s.distribution(&logits).unwrap()), [0, 1]);
}

#[test]
fn draws_follow_the_distribution() {
    let probs = [0.6, 0.3, 0.1];
    let logits = logits_of(&probs);
    let mut s = sampler(sampling(1.0));
    let mut counts = [0usize; 3];
    let n = 20_000;
    for _ in 0..n {
        counts[s.sample(&logits, &[], &[]).unwrap() as usize] += 1;
    }
    for (c, p) in counts.iter().zip(probs) {
        let f = *c as f64 / n as f64;
        assert!((f - p).abs() < 0.015, "{counts:?}");
    }
}

/// Pearson's chi-square statistic of `counts` against `dist`.
fn chi_square(counts: &HashMap<u32, usize>, dist: &[(u32, f64)], n: usize) -> f64 {
    assert!(
        counts.keys().all(|id| dist.iter().any(|d| d.0 == *id)),
        "drew a token outside the distribution: {counts:?}"
    );
    dist.iter()
        .map(|&(id, p)| {
            let expected = p * n as f64;
            let seen = counts.get(&id).copied().unwrap_or(0) as f64;
            (seen - expected).powi(2) / expected
        })
        .sum()
}

#[test]
fn drafted_tokens_are_kept_or_replaced_as_the_distribution_says() {
    let logits = logits_of(&[0.35, 0.25, 0.2, 0.12, 0.08]);
    // Critical values of chi-square at p = 0.001 by degrees of freedom.
    let critical = [0.0, 10.83, 13.82, 16.27, 18.47];
    for config in [
        sampling(1.0),
        SamplerConfig {
            top_k: 4,
            top_p: 0.9,
            ..sampling(0.8)
        },
    ] {
        let dist = sampler(config.clone()).distribution(&logits).unwrap();
        // Every token of the vocabulary as the draft, those the filters
        // drop included.
        for draft in 0..logits.len() as u32 {
            let n = 20_000;
            let mut counts = HashMap::new();
            for seed in 0..n as u64 {
                let mut s = sampler(SamplerConfig {
                    seed: Some(seed),
                    ..config.clone()
                });
                let id = s.sample_with_draft(&logits, &[], &[], draft).unwrap();
                *counts.entry(id).or_insert(0) += 1;
            }
            let stat = chi_square(&counts, &dist, n);
            assert!(
                stat < critical[dist.len() - 1],
                "draft {draft}, {config:?}: chi-square {stat:.1} over {counts:?} against {dist:?}"
            );
        }
    }
    let mut greedy = sampler(SamplerConfig::default());
    assert_eq!(greedy.sample_with_draft(&logits, &[], &[], 0).unwrap(), 0);
    assert_eq!(greedy.sample_with_draft(&logits, &[], &[], 3).unwrap(), 0);
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
    let s = sampler(SamplerConfig {
        repetition_penalty: 2.0,
        ..sampling(1.0)
    });
    let logits = [2.0f32, -2.0, 1.0, 4.0];
    // Prompt and output both count, each token once.
    let got = s.penalized(&logits, &[0, 1], &[1, 1]).unwrap();
    assert_eq!(got, [1.0, -4.0, 1.0, 4.0]);
    // Greedy decoding too: token 0 (2 -> 0.25) falls below token 2.
    let mut g = sampler(SamplerConfig {
        repetition_penalty: 8.0,
        ..SamplerConfig::default()
    });
    assert_eq!(g.sample(&[2.0, -2.0, 1.0], &[0], &[]).unwrap(), 2);
}

#[test]
fn presence_and_frequency_penalties_follow_openai() {
    let s = sampler(SamplerConfig {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..sampling(1.0)
    });
    let logits = [1.0f32, 1.0, 1.0, 1.0];
    // Prompt tokens do not count; token 2 was generated 3 times, 1 once.
    let got = s.penalized(&logits, &[0, 3], &[2, 1, 2, 2]).unwrap();
    assert_eq!(got, [1.0, 0.25, -0.25, 1.0]);
}

#[test]
fn history_out_of_range_is_an_error() {
    let s = sampler(sampling(1.0));
    let err = s.penalized(&[0.0; 4], &[9], &[]).unwrap_err().to_string();
    assert!(err.contains("token id 9"), "{err}");
}

#[test]
fn invalid_settings_are_refused() {
    for bad in [
        SamplerConfig {
            temperature: -1.0,
            ..SamplerConfig::default()
        },
        SamplerConfig {
            temperature: f32::NAN,
            ..SamplerConfig::default()
        },
        SamplerConfig {
            top_p: 0.0,
            ..SamplerConfig::default()
        },
        SamplerConfig {
            top_p: 1.5,
            ..SamplerConfig::default()
        },
        SamplerConfig {
            min_p: 2.0,
            ..SamplerConfig::default()
        },
        SamplerConfig {
            repetition_penalty: 0.0,
            ..SamplerConfig::default()
        },
        SamplerConfig {
            frequency_penalty: f32::INFINITY,
            ..SamplerConfig::default()
        },
    ] {
        assert!(Sampler::new(bad.clone()).is_err(), "{bad:?}");
    }
}

#[test]
fn generation_config_gives_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    // No file: transformers' defaults, i.e. greedy.
    assert_eq!(
        SamplerConfig::from_generation_config(dir.path()).unwrap(),
        SamplerConfig::default()
    );
    let write =
        |json: &str| std::fs::write(dir.path().join("generation_config.json"), json).unwrap();
    write(
        r#"{"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0, "repetition_penalty": 1.1, "eos_token_id": [1, 2]}"#,
    );
    let got = SamplerConfig::from_generation_config(dir.path()).unwrap();
    assert_eq!(
        got,
        SamplerConfig {
            temperature: 0.6,
            top_k: 20,
            top_p: 0.95,
            min_p: 0.0,
            repetition_penalty: 1.1,
            ..SamplerConfig::default()
        }
    );
    // Sampling without a temperature: 1, with transformers' top-k 50.
    write(r#"{"do_sample": true, "top_k": null}"#);
    let got = SamplerConfig::from_generation_config(dir.path()).unwrap();
    assert_eq!((got.temperature, got.top_k), (1.0, 50));
    // do_sample false: greedy whatever the temperature says.
    write(r#"{"temperature": 0.7, "presence_penalty": 1.5}"#);
    let got = SamplerConfig::from_generation_config(dir.path()).unwrap();
    assert!(got.is_greedy());
    assert_eq!(got.presence_penalty, 1.5);
    for bad in [
        r#"{"top_k": -1}"#,
        r#"{"top_p": "high"}"#,
        r#"{"do_sample": 1}"#,
        r#"{"top_p": 2}"#,
        "{",
    ] {
        write(bad);
        let err = SamplerConfig::from_generation_config(dir.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("generation_config.json"), "{bad}: {err}");
    }
}

#[test]
fn bundled_generation_config_samples() {
    let dir = crate::text::tests::bundled_dir();
    let got = SamplerConfig::from_generation_config(&dir).unwrap();
    assert!(
        !got.is_greedy() && got.top_k > 0 && got.top_p < 1.0,
        "{got:?}"
    );
}

fn pushes(stop: &mut StopCondition, pieces: &[&str]) -> (Vec<String>, Option<String>) {
    let mut out = Vec::new();
    for p in pieces {
        let step = stop.push(p);
        out.push(step.text);
        if step.stopped_by.is_some() {
            return (out, step.stopped_by);
        }
    }
    (out, None)
}

#[test]
fn a_stop_string_across_pieces_stops_and_is_not_emitted() {
    let mut stop = StopCondition::new(vec![], vec!["</s>".into()]).unwrap();
    let (out, by) = pushes(&mut stop, &["Hello <", "/", "s> never shown"]);
    assert_eq!(out, ["Hello ", "", ""]);
    assert_eq!(by.as_deref(), Some("</s>"));
}

#[test]
fn held_text_is_released_once_it_cannot_start_a_stop_string() {
    let mut stop = StopCondition::new(vec![], vec!["</s>".into()]).unwrap();
    let (out, by) = pushes(&mut stop, &["a <", "/", "b", " c"]);
    assert_eq!(out, ["a ", "", "</b", " c"]);
    assert_eq!(by, None);
    // At the end of generation the held text comes out.
    assert_eq!(stop.push("x </").text, "x ");
    assert_eq!(stop.finish(), "</");
}

#[test]
fn the_earliest_stop_string_wins() {
    let mut stop = StopCondition::new(vec![], vec!["World".into(), "lo W".into()]).unwrap();
    let (out, by) = pushes(&mut stop, &["Hel", "lo World"]);
    assert_eq!(out.concat(), "Hel");
    assert_eq!(by.as_deref(), Some("lo W"));
    // A stop string inside a single piece: text after it is dropped.
    let mut stop = StopCondition::new(vec![], vec!["\n\n".into()]).unwrap();
    let step = stop.push("One.\n\nTwo.");
    assert_eq!(
        (step.text.as_str(), step.stopped_by.as_deref()),
        ("One.", Some("\n\n"))
    );
}

#[test]
fn non_ascii_stop_strings_hold_whole_characters() {
    let mut stop = StopCondition::new(vec![], vec!["éé!".into()]).unwrap();
    let (out, by) = pushes(&mut stop, &["caf", "é", "é", "?"]);
    assert_eq!(out, ["caf", "", "", "éé?"]);
    assert_eq!(by, None);
}

#[test]
fn eos_ids_and_empty_stop_strings() {
    let stop = StopCondition::new(vec![2, 0], vec![]).unwrap();
    assert!(stop.is_eos(0) && stop.is_eos(2) && !stop.is_eos(1));
    assert!(StopCondition::new(vec![], vec![String::new()]).is_err());
}

#[test]
fn stop_strings_on_streamed_tokens() {
    // Real tokens: the stop string spans several of them and starts in
    // the middle of one piece.
    let tok = bundled_tokenizer();
    let text = "\"I am sure,\" said she. THE END of all.";
    let ids = tok.encode(text, false).unwrap();
    let mut dec = tok.stream_decoder(true);
    let mut stop = StopCondition::new(vec![], vec!["THE END".into()]).unwrap();
    let start = text.find("THE END").unwrap();
    let end = start + "THE END".len();
    let (mut decoded, mut shown, mut by, mut pieces_in_stop) =
        (String::new(), String::new(), None, 0);
    for &id in &ids {
        let piece = dec.step(id).unwrap();
        let at = decoded.len();
        if !piece.is_empty() && at < end && at + piece.len() > start {
            pieces_in_stop += 1;
        }
        decoded += &piece;
        let step = stop.push(&piece);
        shown += &step.text;
        if step.stopped_by.is_some() {
            by = step.stopped_by;
            break;
        }
    }
    assert_eq!(shown, "\"I am sure,\" said she. ");
    assert_eq!(by.as_deref(), Some("THE END"));
    assert!(pieces_in_stop >= 2, "the stop string should span tokens");
}
