//! billing's service: what `billing run` runs. Its handlers record paid
//! invoices and credit loyalty points once per event, however often the event
//! arrives; its second stream keeps each customer's credit limit in version
//! order; its topology, database, settings and checks at start are here too.
//!
//! The binary (`examples/billing/src/main.rs`) parses the command line and
//! runs this; `billing bench` and `billing chaos` drive it from
//! `examples/billing-rig`.

pub mod amount;
pub mod checkup;
pub mod config;
pub mod credit;
pub mod db;
pub mod handlers;
pub mod http;
pub mod scratch;
pub mod service;
pub mod stream;
