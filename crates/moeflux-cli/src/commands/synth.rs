//! `moeflux synth --preset NAME [--layers N] -o DIR`

use std::path::PathBuf;

use anyhow::Result;
use moeflux::convert::ConvertOptions;
use moeflux::synth::{PRESETS, preset, preset_config, synthesize};
use moeflux::util::human_bytes;

use super::convert::{ExpertQuant, Quant, precision_label, progress_bar};

#[derive(clap::Args)]
pub struct Args {
    /// Model shape to copy (see --list).
    #[arg(long, required_unless_present = "list")]
    preset: Option<String>,
    /// Keep only the first N layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Include the model's multi-token-prediction layer (for --draft mtp).
    #[arg(long)]
    mtp: bool,
    /// Weight precision of every matrix but the routed experts' (default
    /// q4; q8 when --expert-quant is q2 or q3).
    #[arg(long, value_enum)]
    quant: Option<Quant>,
    /// Precision of the routed experts (default: as --quant).
    #[arg(long, value_enum)]
    expert_quant: Option<ExpertQuant>,
    /// The model directory to create.
    #[arg(short = 'o', long = "output", required_unless_present = "list")]
    output: Option<PathBuf>,
    /// Replace the output directory if it exists.
    #[arg(long)]
    force: bool,
    /// List the presets.
    #[arg(long)]
    list: bool,
}

pub fn run(args: Args) -> Result<()> {
    if args.list {
        for p in PRESETS {
            println!("{:<20} {}", p.name, p.description);
        }
        return Ok(());
    }
    let (Some(name), Some(output)) = (args.preset, args.output) else {
        unreachable!("clap requires --preset and -o without --list")
    };
    let config = preset_config(preset(&name)?, args.layers, args.mtp)?;
    let interrupt = crate::interrupt::install()?;
    let quant = args.quant.map_or_else(
        || ExpertQuant::default_rest(args.expert_quant),
        Quant::dtype,
    );
    let options = ConvertOptions {
        quant,
        expert_quant: args.expert_quant.map(ExpertQuant::dtype),
        overwrite: args.force,
        cancel: Some(interrupt.flag().clone()),
    };
    interrupt.begin();
    let summary = synthesize(config, &output, &options, &progress_bar());
    interrupt.end();
    let summary = summary?;
    println!(
        "wrote synthetic {} ({}, {} layers{}, random weights) to {}: dense {}, experts {}",
        name,
        precision_label(quant, options.expert_quant),
        summary.config.num_layers(),
        match summary.config.mtp {
            Some(_) => " + a multi-token-prediction layer",
            None => "",
        },
        output.display(),
        human_bytes(summary.dense_bytes),
        human_bytes(summary.expert_bytes)
    );
    Ok(())
}
