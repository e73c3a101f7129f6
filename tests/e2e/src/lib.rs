//! Support for end-to-end tests against the real control plane that `tests/cluster/up.sh`
//! starts: connecting, fake GPU nodes, the audit log, failure injection and waiting.
#![forbid(unsafe_code)]

pub mod audit;
pub mod chaos;
pub mod cluster;
pub mod container;
pub mod contract;
pub mod crd;
pub mod dra;
pub mod faults;
pub mod helm;
pub mod nfd;
pub mod nodes;
pub mod olm;
pub mod olm_catalog;
pub mod openshift;
pub mod operator;
pub mod procs;
pub mod procstat;
pub mod registry;
pub mod scrape;
pub mod session;
pub mod steady;
pub mod tools;
pub mod wait;

pub use cluster::{client, connect, kubectl};
