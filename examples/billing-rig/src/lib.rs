//! The drivers behind `billing bench` and `billing chaos`, kept out of the
//! reference service so that billing reads as a service: the benchmark
//! measures warren against baselines run in the same process, and the chaos
//! run puts several `billing run` processes under faults and checks the
//! invariants. Not published; the `billing` binary runs both.
// The drivers are the commands' bodies: their reports go to standard output.
#![allow(clippy::print_stdout, clippy::print_stderr)]

pub mod bench;
pub mod chaos;
