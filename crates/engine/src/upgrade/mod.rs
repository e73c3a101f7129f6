//! The driver upgrade of GPU nodes (pure): the state machine that moves one node from "upgrade
//! required" to "done", driven by the runtime's upgrade stage, and the pre-pull of the new
//! driver images that gates the first step, and the forecast of a rollout before it starts.

pub mod forecast;
#[cfg(test)]
mod forecast_tests;
pub mod machine;
#[cfg(test)]
mod machine_tests;
pub mod prepull;
#[cfg(test)]
mod prepull_tests;
