//! Unit tests of the DRA driver operand (dra_driver.rs).
