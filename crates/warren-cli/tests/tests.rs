#![allow(unreachable_pub)]
//! The `warren` binary against the real broker and databases. The fixtures are
//! warren's own integration-test fixtures (crates/warren-test-support), so
//! that the CLI is tested against the same consumers the library's tests run.

// The fixtures shared by warren's tests, the CLI's and the benches
// (crates/warren-test-support), as `crate::util::...`; `on_all_backends!`
// among its macros.
#[macro_use]
extern crate warren_test_support;
use warren_test_support as util;

mod cli;
mod console;
mod console_support;
mod console_tls;
mod dead_letters;
mod doctor;
mod guides;
mod input_rules;
mod trace;
