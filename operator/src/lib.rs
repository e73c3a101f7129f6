//! The GPU operator: turns one `ClusterPolicy` into the NVIDIA GPU software stack on every GPU node.
//!
//! The design is in `docs/architecture.md` (the pipeline, the layout, and the numbered decisions
//! that comments cite as "decision N"); operand and config facts in `docs/operand-facts.md` and
//! `docs/config-facts.md`.
#![forbid(unsafe_code)]

pub mod cleanup;
pub mod cli;
pub mod client;
pub mod controller;
pub mod crd_upgrade;
pub mod health;
pub mod http;
pub mod leader;
pub mod metrics;
pub mod run;

// The pure stages, under the paths the runtime's modules and the tests name them by.
pub use gpu_operator_engine::{
    allocatable, api, by_model, facts, gpu_readiness, json_diff, model, node_pools, nodes,
    operands, render, sharing, takeover, teardown, validate, workload,
};
