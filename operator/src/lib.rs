//! The GPU operator: turns one `ClusterPolicy` into the NVIDIA GPU software stack on every GPU node.
#![forbid(unsafe_code)]

pub mod api;
pub mod bundle;
pub mod cli;
pub mod controller;
pub mod crd_upgrade;
pub mod facts;
pub mod health;
pub mod http;
pub mod metrics;
pub mod nodes;
pub mod render;
pub mod run;
pub mod sharing;
pub mod validate;
