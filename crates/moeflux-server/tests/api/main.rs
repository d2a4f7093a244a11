//! The server through its API, one test binary: HTTP and server-sent
//! events, the OpenAI clients (Rust and Python), the chat page in Chromium,
//! constrained output, drafting, and exactness against the library. One
//! binary links the server's dependency tree once instead of once per file;
//! the load test (`tests/load.rs`) keeps a process of its own, since it
//! measures that process's memory.

#[path = "../common/mod.rs"]
mod common;

mod chromium;
mod constrained;
mod drafting;
mod exactness;
mod http;
mod openai_python;
mod openai_rust;
