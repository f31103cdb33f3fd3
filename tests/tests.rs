#![allow(unreachable_pub)]
//! Integration tests against the real broker and databases. One binary, one file
//! per topic; every test gets its own queue names and its own database.

// The fixtures shared by warren's tests, the CLI's and the benches
// (crates/warren-test-support), as `crate::util::...`; `on_all_backends!`
// among its macros.
#[macro_use]
extern crate warren_test_support;
use warren_test_support as util;

mod batch_handlers;
mod batching;
#[cfg(feature = "failpoints")]
mod blame;
mod conflicts;
#[cfg(feature = "failpoints")]
mod crash;
mod dead_letter_scale;
mod dead_letters;
mod failures;
mod foreign;
mod frames;
mod hostile;
mod inbox;
#[cfg(feature = "testing")]
mod kit;
#[cfg(all(feature = "mysql", feature = "testing"))]
mod mysql;
mod ordering;
mod outages;
mod outbox;
mod partitions;
mod poison;
mod retries;
mod shutdown;
mod supervision;
mod tls;
mod trace;
