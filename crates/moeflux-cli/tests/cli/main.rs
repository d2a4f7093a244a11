//! The command line as a user runs it, one test binary: bad input, data
//! safety, expert placement, `inspect` on latent attention, limits, MTP
//! drafts, how options are read, `serve`, saved state and text. Each
//! module runs the built `moeflux` executable; one binary compiles and
//! links their helpers once instead of once per file.

use assert_cmd::Command;

/// The built `moeflux` executable, as a command to run.
fn moeflux() -> Command {
    Command::cargo_bin("moeflux").unwrap()
}

mod bad_input;
mod data_safety;
mod expert_placement;
mod inspect_mla;
mod limits;
mod mtp;
mod options;
mod serve;
mod state;
mod text;
