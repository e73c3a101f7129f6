//! The GPU operator's pure stages: what a pass computes from what it read (no IO).
//!
//! Nothing here holds a client or an async runtime: every function takes values and returns
//! values, so each stage is tested without a cluster. The runtime crate (`operator/`) reads the
//! cluster into [`facts::ClusterFacts`], runs these stages and writes what they decide.
//!
//! - [`validate`]: a `ClusterPolicy` to a [`model::ValidatedPolicy`], per operand;
//! - [`render`] and [`operands`]: the desired objects of every operand, with [`sharing`]'s
//!   checked device-plugin and MIG configs;
//! - [`nodes`] and [`node_pools`]: which labels, taints and pools GPU nodes should carry;
//! - [`plan`]: which rendered objects need a write (the zero-write rule);
//! - [`status`]: the policy's status from what was applied and observed;
//! - [`upgrade`]: the driver upgrade state machine of one node;
//! - [`teardown`]: what comes off a node when its policy is deleted.
#![forbid(unsafe_code)]

pub use gpu_operator_api as api;

pub mod allocatable;
pub mod by_model;
pub mod facts;
pub mod gpu_readiness;
pub mod json_diff;
pub mod model;
pub mod node_pools;
pub mod nodes;
pub mod operands;
pub mod plan;
#[cfg(test)]
mod plan_tests;
pub mod render;
pub mod sharing;
pub mod status;
pub mod takeover;
pub mod teardown;
pub mod upgrade;
pub mod validate;
pub mod workload;
