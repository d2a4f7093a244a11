//! How often the router chose each expert over a text: measured by
//! `moeflux perplexity --routing-counts FILE`, read by
//! `--expert-placement FILE` so that several GPUs share the experts by
//! traffic, not only by number.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// Counts per MoE layer and expert, as written to and read from JSON.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RoutingCounts {
    /// Tokens the counts were taken over.
    pub tokens: u64,
    /// Per MoE layer (by index), how many tokens chose each expert.
    pub layers: BTreeMap<usize, Vec<u64>>,
}

impl RoutingCounts {
    /// The counts an [`crate::experts::ExpertStore::count_routing`] took
    /// over `tokens` tokens.
    pub fn new(tokens: u64, counts: HashMap<usize, Vec<u64>>) -> RoutingCounts {
        RoutingCounts {
            tokens,
            layers: counts.into_iter().collect(),
        }
    }

    /// Writes the counts as JSON (through a temporary file).
    pub fn write(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_vec_pretty(self).expect("counts serialise");
        crate::convert::write_atomic(path, &json)
    }

    /// Reads counts for `config`'s model, refusing counts of another
    /// model (a layer it does not route, or another number of experts).
    pub fn read(path: &Path, config: &ModelConfig) -> Result<RoutingCounts> {
        let option = "--expert-placement";
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, "reading", e))?;
        let counts: RoutingCounts = serde_json::from_slice(&bytes).map_err(|e| {
            Error::invalid(
                option,
                format!(
                    "{}: not routing counts ({e}); write them with `moeflux perplexity \
                     --routing-counts FILE`",
                    path.display()
                ),
            )
        })?;
        let moe_layers: Vec<usize> = config.expert_layers().collect();
        for (&layer, experts) in &counts.layers {
            if !moe_layers.contains(&layer) {
                return Err(Error::invalid(
                    option,
                    format!(
                        "{}: layer {layer} has no routed experts in this model: counts of \
                         another model?",
                        path.display()
                    ),
                ));
            }
            if experts.len() != config.moe.num_experts {
                return Err(Error::invalid(
                    option,
                    format!(
                        "{}: layer {layer} counts {} experts, the model has {}: counts of \
                         another model?",
                        path.display(),
                        experts.len(),
                        config.moe.num_experts
                    ),
                ));
            }
        }
        Ok(counts)
    }
}
