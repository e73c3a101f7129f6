//! The GPU operator: turns one `ClusterPolicy` into the NVIDIA GPU software stack on every GPU node.
#![forbid(unsafe_code)]

pub mod api;
pub mod cli;
