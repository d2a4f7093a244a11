//! `moeflux inspect -m DIR`

use anyhow::Result;
use moeflux::config::{ExpertActivation, FeedForwardKind, LayerKind, LayerSpec, ScoreFunction};
use moeflux::format::{ModelDir, OpenOptions};
use moeflux::util::human_bytes;

use super::{KvTypeArg, ModelPath};
use moeflux::backend::KvType;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelPath,
    /// The KV cache type whose size the context line gives (f32 unless
    /// given; every type's size per layer is listed below it).
    #[arg(long, value_enum)]
    kv_type: Option<KvTypeArg>,
}

pub fn run(args: Args) -> Result<()> {
    let path = args.model.resolve(false)?.dir;
    let dir = ModelDir::open(
        &path,
        OpenOptions {
            verify_checksums: false,
            mtp_head: true,
        },
    )?;
    let m = dir.manifest();
    let c = dir.config();
    let a = &c.attention;
    println!("model          {}", path.display());
    println!(
        "architecture   {}{}",
        c.architecture.name(),
        if m.synthetic {
            " (synthetic: random weights)"
        } else {
            ""
        }
    );
    println!(
        "format         {} v{} by {}",
        m.format, m.version, m.producer
    );
    println!(
        "quantization   {} (group {})",
        m.quantization.name(),
        m.group_size
    );
    println!("vocab / hidden {} / {}", c.vocab_size, c.hidden_size);
    let mut extras = Vec::new();
    if a.output_gate {
        extras.push("output gate".to_string());
    }
    if a.qk_norm {
        extras.push("q/k norm".to_string());
    }
    match (a.qkv_bias, a.o_bias) {
        (true, true) => extras.push("q/k/v/o biases".to_string()),
        (true, false) => extras.push("q/k/v biases".to_string()),
        (false, true) => extras.push("o bias".to_string()),
        (false, false) => {}
    }
    if a.sinks {
        extras.push("sinks".to_string());
    }
    if let Some(w) = a.sliding_window {
        extras.push(format!("sliding window {w}"));
    }
    println!(
        "attention      {} heads, {} kv heads, head_dim {}, rotary {} (theta {}{}){}",
        a.num_heads,
        a.num_kv_heads,
        a.head_dim,
        a.rotary_dim,
        a.rope_theta,
        a.rope_yarn
            .map(|y| format!(
                ", YaRN x{} of {}, attention factor {:.4}",
                y.factor,
                y.original_max_position_embeddings,
                y.attention_factor()
            ))
            .unwrap_or_default(),
        extras.iter().map(|e| format!(", {e}")).collect::<String>()
    );
    if let Some(l) = &c.linear_attention {
        println!(
            "linear attn    Gated DeltaNet: {} key heads x {}, {} value heads x {}, conv {}",
            l.num_key_heads, l.key_head_dim, l.num_value_heads, l.value_head_dim, l.conv_kernel
        );
    }
    let moe = &c.moe;
    let r = &moe.router;
    println!(
        "experts        {} per MoE layer, top-{}, intermediate {}{}{}{}",
        moe.num_experts,
        r.top_k,
        moe.expert_intermediate_size,
        match moe.expert_activation {
            ExpertActivation::SwiGlu => String::new(),
            ExpertActivation::ClampedSwiGlu { limit, alpha } => {
                format!(", clamped SwiGLU (limit {limit}, alpha {alpha})")
            }
        },
        if moe.expert_bias { ", biases" } else { "" },
        moe.shared_expert
            .map(|s| format!(
                ", shared expert {}{}",
                s.intermediate_size,
                if s.gated { " (gated)" } else { "" }
            ))
            .unwrap_or_default()
    );
    println!(
        "router         {}{}{}{}{}{}",
        match r.score {
            ScoreFunction::Softmax => "softmax",
            ScoreFunction::Sigmoid => "sigmoid",
            ScoreFunction::SoftmaxOfChosen => "softmax of the chosen",
        },
        r.groups
            .map(|g| format!(", best {} of {} groups", g.keep, g.count))
            .unwrap_or_default(),
        if r.correction_bias {
            ", correction bias"
        } else {
            ""
        },
        if r.renormalize { ", renormalised" } else { "" },
        if moe.router_bias { ", logit bias" } else { "" },
        if r.scaling != 1.0 {
            format!(", scaled by {}", r.scaling)
        } else {
            String::new()
        },
    );
    let requested = args.kv_type.map(KvTypeArg::kv_type);
    let kv = c
        .kv_type(requested, KvType::F32)
        .map_err(|why| anyhow::anyhow!("--kv-type: {why}"))?;
    let windows = match c.kv_bytes_of_windows(kv) {
        0 => String::new(),
        bytes => format!(" + {} for the sliding windows", human_bytes(bytes)),
    };
    println!(
        "context        {} positions; KV cache {} per position in {kv}{windows}",
        c.max_position_embeddings,
        human_bytes(c.kv_bytes_per_position(kv))
    );
    let per_layer = match &c.mla {
        Some(m) => format!(
            "latent {} + rotary key {}, f32",
            m.kv_lora_rank, m.qk_rope_head_dim
        ),
        None => {
            let others: Vec<String> = [KvType::Bf16, KvType::Q8]
                .into_iter()
                .filter(|&t| c.kv_type(Some(t), KvType::F32).is_ok())
                .map(|t| format!("{t} {}", c.kv_bytes_per_position_and_layer(t)))
                .collect();
            format!("keys and values, f32; {}", others.join(", "))
        }
    };
    println!(
        "KV cache       {} bytes per position and attention layer ({per_layer})",
        c.kv_bytes_per_position_and_layer(KvType::F32),
    );
    if let Some(m) = &c.mla {
        println!(
            "latent attn    q rank {}, kv rank {}, qk {} + rotary {}, v {}, softmax scale {}",
            m.q_lora_rank
                .map_or_else(|| "none (q_proj)".into(), |r| r.to_string()),
            m.kv_lora_rank,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.softmax_scale
        );
    }
    println!("layers         {}", c.num_layers());
    let describe = |l: &LayerSpec| {
        let mixer = match l.kind {
            LayerKind::FullAttention if c.mla.is_some() => "latent attention (MLA)",
            LayerKind::FullAttention => "full attention",
            LayerKind::SlidingAttention => "sliding-window attention",
            LayerKind::LinearAttention => "linear attention (Gated DeltaNet)",
        };
        let ffn = match l.ffn {
            FeedForwardKind::Moe => "MoE",
            FeedForwardKind::Dense => "dense MLP",
        };
        format!("{mixer:<34} {ffn}")
    };
    for (i, l) in c.layers.iter().enumerate() {
        println!("  {i:>4}  {}", describe(l));
    }
    match (&c.mtp, c.mtp_layer()) {
        (Some(mtp), Some(i)) => {
            println!(
                "mtp head       multi-token prediction (--draft mtp): fc over [embedding; hidden], \
                 {}{}{}",
                if m.tensors.contains_key(moeflux::arch::names::MTP_LM_HEAD) {
                    "its own LM head"
                } else {
                    "the model's LM head"
                },
                if mtp.zero_first_embedding {
                    ", embedding zeroed at position 0"
                } else {
                    ""
                },
                if mtp.chain_normed {
                    ", chained after its norm"
                } else {
                    ", chained before its norm"
                }
            );
            println!("  {i:>4}  {}", describe(&mtp.layer));
        }
        _ => println!("mtp head       none (--draft mtp needs a checkpoint that ships one)"),
    }
    let per_expert = m.experts.first().map(|e| e.blob.nbytes).unwrap_or(0);
    println!(
        "dense bytes    {} ({})",
        m.dense_bytes(),
        human_bytes(m.dense_bytes())
    );
    println!(
        "expert bytes   {} ({})",
        m.expert_bytes(),
        human_bytes(m.expert_bytes())
    );
    println!(
        "bytes/expert   {} ({})",
        per_expert,
        human_bytes(per_expert)
    );
    Ok(())
}
