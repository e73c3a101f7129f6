//! The GPU operator: turns one `ClusterPolicy` into the NVIDIA GPU software stack on every GPU node.
//!
//! The design is in `docs/architecture.md` (the pipeline, the layout, and the numbered decisions
//! that comments cite as "decision N"); operand and config facts in `docs/operand-facts.md` and
//! `docs/config-facts.md`.
#![forbid(unsafe_code)]

pub mod api;
pub mod cli;
pub mod client;
pub mod controller;
pub mod crd_upgrade;
pub mod facts;
pub mod health;
pub mod http;
pub mod json_diff;
pub mod leader;
pub mod metrics;
pub mod model;
pub mod node_pools;
pub mod nodes;
pub mod operands;
pub mod render;
pub mod run;
pub mod sharing;
pub mod validate;
