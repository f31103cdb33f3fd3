#![allow(unreachable_pub)]
//! The `warren` binary against the real broker and databases. The fixtures are
//! warren's own integration-test fixtures, shared by path rather than copied, so
//! that the CLI is tested against the same consumers the library's tests run.

#[macro_use]
#[path = "../../../tests/support/mod.rs"]
// Only part of the shared fixtures serves the CLI's tests (none of the proxy, say,
// whose re-export would then count as an unused import).
#[allow(dead_code, unused_imports)]
mod util;

mod cli;
mod console;
mod console_support;
mod console_tls;
mod dead_letters;
mod doctor;
mod input_rules;
mod trace;
