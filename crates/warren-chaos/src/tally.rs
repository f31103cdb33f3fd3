//! What the fleet's logs say happened to each message.

use std::collections::BTreeMap;

/// Per-message outcomes read from the fleet's logs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogTally {
    /// `processing_result` values and how often each was logged.
    pub results: BTreeMap<String, u64>,
    /// Deliveries the broker marked redelivered.
    pub redelivered: u64,
    /// Suspects that started a solo run.
    pub solo_runs: u64,
    /// Solo runs of a message whose previous solo run ended without an outcome
    /// (the process died, or the run outlasted its deadline): evidence a
    /// healthy message can collect against itself when unrelated deaths fall
    /// inside its solo runs.
    pub solo_runs_after_a_death: u64,
    /// When the first and the last solo run started, as logged (RFC 3339):
    /// the span the quarantine lane was busy, where every solo run followed
    /// one event.
    pub solo_run_span: Option<(String, String)>,
    /// Times a consumer lost the broker and set out to reconnect.
    pub broker_lost: u64,
    /// Times a consumer started consuming (at start, and after each
    /// reconnection).
    pub consuming: u64,
}

impl LogTally {
    pub(crate) fn read(&mut self, line: &str) {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            return;
        };
        let fields = &v["fields"];
        if fields["message"] == "suspect runs alone" {
            self.solo_runs += 1;
            if let Some(at) = v["timestamp"].as_str() {
                let span = self
                    .solo_run_span
                    .get_or_insert_with(|| (at.to_owned(), at.to_owned()));
                // Lines of several processes come in any order.
                if at < span.0.as_str() {
                    span.0 = at.to_owned();
                }
                if at > span.1.as_str() {
                    span.1 = at.to_owned();
                }
            }
            if fields["solo_run"].as_u64().is_some_and(|n| n >= 2) {
                self.solo_runs_after_a_death += 1;
            }
            return;
        }
        match fields["message"].as_str() {
            Some("lost the broker; reconnecting") => {
                self.broker_lost += 1;
                return;
            }
            Some("consuming") => {
                self.consuming += 1;
                return;
            }
            Some("message processed") => {}
            _ => return,
        }
        if let Some(result) = fields["processing_result"].as_str() {
            *self.results.entry(result.to_owned()).or_default() += 1;
        }
        if fields["rabbitmq_redelivered"] == true {
            self.redelivered += 1;
        }
    }

    /// How often `result` was logged.
    pub fn count(&self, result: &str) -> u64 {
        self.results.get(result).copied().unwrap_or(0)
    }
}
