//! The checks `billing run` makes before it consumes: `warren doctor`'s
//! broker checks on both consumers (the invoice stream and the credit
//! stream), and its database checks. A failed broker or configuration check
//! refuses the start; the database's findings are warnings only, since a
//! restart during an incident must not fail on a backlog or a clock.

use std::time::Duration;

use warren_doctor::{
    BrokerAccess, Check, DatabaseExpectations, Status, check_consumers, check_database,
};

use crate::db::BillingDb;
use crate::handlers::CONSUMER;
use crate::service::{Names, Settings, consumer_config, credit_config};

/// Runs the checks and logs each finding; `Err` with the failures if a
/// broker or configuration check failed.
pub async fn at_start<B: BillingDb>(
    store: &B::S,
    amqp_url: &str,
    names: &Names,
    settings: &Settings,
    inbox_retention: Option<Duration>,
) -> Result<(), String> {
    let configs = [
        consumer_config(names, settings).map_err(|e| e.to_string())?,
        credit_config(names, settings).map_err(|e| e.to_string())?,
    ];
    let access = BrokerAccess {
        amqp_url: amqp_url.to_owned(),
        tls: settings.tls.clone(),
        management_url: settings.management_url.clone(),
        rabbitmqctl: settings.rabbitmqctl.clone(),
    };
    let broker = check_consumers(&configs, &access).await;
    let mut expect = DatabaseExpectations::new(CONSUMER);
    expect.inbox_retention = inbox_retention;
    let database = check_database(store, &expect).await;
    // On a first start nothing is declared yet, and billing declares it
    // all next: one line saying so, not a warning per queue.
    let undeclared = |c: &&Check| c.check == "queue-exists" && c.status == Status::Warn;
    let not_yet: Vec<&str> = broker
        .checks
        .iter()
        .filter(undeclared)
        .map(|c| c.subject.as_str())
        .collect();
    if !not_yet.is_empty() {
        tracing::info!(
            queues = not_yet.len(),
            first = not_yet[0],
            "queues not declared yet; billing declares them as its consumers start"
        );
    }
    for check in broker.checks.iter().filter(|c| !undeclared(c)) {
        log(check, check.status);
    }
    for check in &database {
        // Never a refusal: at most a warning.
        log(check, check.status.min(Status::Warn));
    }
    let failed: Vec<String> = broker
        .with_status(Status::Fail)
        .map(|c| format!("{} on {}: {}; fix: {}", c.check, c.subject, c.detail, c.fix))
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "refusing to start, {} check{} failed (`warren doctor` prints the whole report): {}",
            failed.len(),
            if failed.len() == 1 { "" } else { "s" },
            failed.join(" | ")
        ))
    }
}

fn log(check: &Check, status: Status) {
    let (name, subject, detail, fix) = (check.check, &check.subject, &check.detail, &check.fix);
    match status {
        Status::Fail => tracing::error!(check = name, %subject, %detail, %fix, "doctor: fail"),
        Status::Warn => tracing::warn!(check = name, %subject, %detail, %fix, "doctor: warn"),
        Status::Skip => tracing::info!(check = name, %subject, %detail, "doctor: skipped"),
        Status::Pass => tracing::debug!(check = name, %subject, %detail, "doctor: pass"),
    }
}
