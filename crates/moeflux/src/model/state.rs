//! The saved form of a session's state:
//!
//! ```text
//! "MFXSTATE"        8 bytes, magic
//! version           u32
//! model fingerprint u64   (Model::fingerprint: the state only fits these weights)
//! header length     u32, then the JSON header (tokens, per-layer kinds, the
//!                   KV type)
//! payload           per layer, keys then values (attention) in the KV type's
//!                   encoding (`KvRows::write_bytes`; a latent cache: its f32
//!                   rows alone), or the convolution history then the
//!                   recurrent state (linear attention) in f32; then the last
//!                   logits in f32 if the header says so
//! checksum          u64 xxHash3-64 of everything before it
//! ```
//!
//! All integers and floats are little-endian. Version 1 had no KV type:
//! its caches are f32, and it loads into f32 sessions.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::Model;
use crate::backend::{Backend, HostDeltaNetState, HostKv, KvRows, KvType};
use crate::blocks::attention;
use crate::blocks::decoder::LayerState;
use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"MFXSTATE";
const VERSION: u32 = 2;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    tokens: Vec<u32>,
    /// Per layer: `"attention"` or `"linear"`.
    layers: Vec<String>,
    has_logits: bool,
    /// How the attention layers' keys and values are stored (`f32`,
    /// `bf16`, `q8`); absent in version 1, whose caches are f32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kv_type: Option<String>,
}

pub struct Loaded<B: Backend> {
    pub layers: Vec<LayerState<B>>,
    pub tokens: Vec<u32>,
    pub logits: Option<Vec<f32>>,
}

pub fn encode<B: Backend>(
    model: &Model<B>,
    kv: KvType,
    layers: &[LayerState<B>],
    tokens: &[u32],
    logits: Option<&[f32]>,
) -> Result<Vec<u8>> {
    let b = model.backend();
    let header = Header {
        tokens: tokens.to_vec(),
        layers: layers
            .iter()
            .map(|l| match l {
                LayerState::Attention(_) => "attention".to_string(),
                LayerState::DeltaNet(_) => "linear".to_string(),
            })
            .collect(),
        has_logits: logits.is_some(),
        kv_type: Some(kv.name().to_string()),
    };
    let header = serde_json::to_vec(&header).expect("header serializes");
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&model.fingerprint().to_le_bytes());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    let put =
        |out: &mut Vec<u8>, values: &[f32]| out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    for layer in layers {
        match layer {
            LayerState::Attention(cache) => {
                let host = b.kv_export(cache)?;
                host.keys.write_bytes(&mut out);
                host.values.write_bytes(&mut out);
            }
            LayerState::DeltaNet(state) => {
                let host = b.delta_net_export(state)?;
                put(&mut out, &host.conv);
                put(&mut out, &host.recurrent);
            }
        }
    }
    if let Some(logits) = logits {
        put(&mut out, logits);
    }
    let checksum = xxhash_rust::xxh3::xxh3_64(&out);
    out.extend_from_slice(&checksum.to_le_bytes());
    Ok(out)
}

/// The state in `bytes`, into the layers of a session of `model` whose KV
/// caches store `kv`.
pub fn decode<B: Backend>(
    model: &Model<B>,
    kv: KvType,
    bytes: &[u8],
    source: &Path,
) -> Result<Loaded<B>> {
    let bad = |msg: String| Error::bad_file(source, msg);
    if bytes.len() < 32 || &bytes[..8] != MAGIC {
        return Err(bad("not a moeflux session state file".into()));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
    if !(1..=VERSION).contains(&version) {
        return Err(bad(format!(
            "state format version {version} is not supported (this moeflux reads versions 1 \
             to {VERSION})"
        )));
    }
    let (body, trailer) = bytes.split_at(bytes.len() - 8);
    let expected = u64::from_le_bytes(trailer.try_into().unwrap());
    let actual = xxhash_rust::xxh3::xxh3_64(body);
    if actual != expected {
        return Err(bad(
            "checksum mismatch: the state file is truncated or corrupt".into(),
        ));
    }
    let fingerprint = u64::from_le_bytes(body[12..20].try_into().unwrap());
    if fingerprint != model.fingerprint() {
        return Err(bad(format!(
            "was saved from a different model (fingerprint {fingerprint:016x}, this model is {:016x}); \
             load it with the model directory that produced it",
            model.fingerprint()
        )));
    }
    let header_len = u32::from_le_bytes(body[20..24].try_into().unwrap()) as usize;
    let header_bytes = body
        .get(24..24 + header_len)
        .ok_or_else(|| bad("header extends past the end of the file".into()))?;
    let header: Header =
        serde_json::from_slice(header_bytes).map_err(|e| bad(format!("malformed header: {e}")))?;
    let mut payload = Payload {
        bytes: &body[24 + header_len..],
        source,
    };
    let saved = match (&header.kv_type, version) {
        (None, 1) => KvType::F32,
        (None, _) => return Err(bad("the header names no KV type".into())),
        (Some(name), _) => name
            .parse::<KvType>()
            .map_err(|e| bad(format!("KV type of the header: {e}")))?,
    };
    if saved != kv {
        return Err(bad(format!(
            "was saved from a session with a {saved} KV cache, and this session's is {kv}: \
             load it into a session of KV type {saved} (--kv-type {saved}; \
             ModelOptions::kv_type or SessionOptions::kv_type)"
        )));
    }

    let cfg = model.config();
    if header.layers.len() != cfg.num_layers() {
        return Err(bad(format!(
            "describes {} layers, the model has {}",
            header.layers.len(),
            cfg.num_layers()
        )));
    }
    let b = model.backend();
    let positions = header.tokens.len();
    let mut layers = Vec::with_capacity(cfg.num_layers());
    for (i, (kind, fresh)) in header
        .layers
        .iter()
        .zip(model.new_layer_states(kv)?)
        .enumerate()
    {
        let state = match (kind.as_str(), fresh) {
            ("attention", LayerState::Attention(_)) => {
                // A sliding window's cache holds only its newest positions;
                // MLA's holds its latent as keys and no values.
                let shape = attention::shape(cfg, i);
                let (held, width) = (
                    shape.retained(positions),
                    shape.num_kv_heads * shape.head_dim,
                );
                let (rows, value_width) = match shape.latent {
                    true => (KvType::F32, 0),
                    false => (kv, width),
                };
                LayerState::Attention(b.kv_import(
                    shape,
                    HostKv {
                        first: positions - held,
                        keys: payload.take_rows(rows, held * width)?,
                        values: payload.take_rows(rows, held * value_width)?,
                    },
                )?)
            }
            ("linear", LayerState::DeltaNet(_)) => {
                let l = cfg
                    .linear_attention
                    .as_ref()
                    .expect("model has linear layers");
                LayerState::DeltaNet(b.delta_net_import(
                    l,
                    HostDeltaNetState {
                        conv: payload.take((l.conv_kernel - 1) * l.conv_dim())?,
                        recurrent:
                            payload.take(l.num_value_heads * l.key_head_dim * l.value_head_dim)?,
                    },
                )?)
            }
            (other, _) => {
                return Err(bad(format!(
                    "layer {i} is `{other}` in the state but not in the model"
                )));
            }
        };
        layers.push(state);
    }
    let logits = match header.has_logits {
        true => Some(payload.take(cfg.vocab_size)?),
        false => None,
    };
    if !payload.bytes.is_empty() {
        return Err(bad(format!(
            "{} unexpected bytes after the state",
            payload.bytes.len()
        )));
    }
    if let Some(&t) = header
        .tokens
        .iter()
        .find(|&&t| t as usize >= cfg.vocab_size)
    {
        return Err(bad(format!(
            "token id {t} is outside the model's vocabulary"
        )));
    }
    Ok(Loaded {
        layers,
        tokens: header.tokens,
        logits,
    })
}

struct Payload<'a> {
    bytes: &'a [u8],
    source: &'a Path,
}

impl Payload<'_> {
    /// `count` keys or values of type `kv`.
    fn take_rows(&mut self, kv: KvType, count: usize) -> Result<KvRows> {
        let (rows, rest) = KvRows::read_bytes(kv, count, self.bytes).ok_or_else(|| {
            Error::bad_file(self.source, "payload is shorter than its header describes")
        })?;
        self.bytes = rest;
        Ok(rows)
    }

    fn take(&mut self, count: usize) -> Result<Vec<f32>> {
        let n = count * 4;
        if self.bytes.len() < n {
            return Err(Error::bad_file(
                self.source,
                "payload is shorter than its header describes",
            ));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}
