#![allow(unreachable_pub)]
//! The `warren` binary against the real broker and databases. The fixtures are
//! warren's own integration-test fixtures, shared by path rather than copied, so
//! that the CLI is tested against the same consumers the library's tests run.

#[macro_use]
#[path = "../../../tests/util.rs"]
// Only part of the shared fixtures serves the CLI's tests.
#[allow(dead_code)]
mod util;

mod cli;
