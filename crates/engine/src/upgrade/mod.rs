//! The driver upgrade of GPU nodes (pure): the state machine that moves one node from "upgrade
//! required" to "done", driven by the runtime's upgrade stage.

pub mod machine;
#[cfg(test)]
mod machine_tests;
