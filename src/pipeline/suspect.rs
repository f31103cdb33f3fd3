//! A suspect's solo run: a redelivery may be what killed the last process that
//! held it, so it runs with nothing else running in the process, and only a
//! death during such a run counts against it.

use super::{Decided, Pipeline, Ready};
use crate::disposition::{Applied, Disposition};
use crate::failure::DeadLetterReason;
use crate::handler::Call;
use crate::store::{Journal, SoloRuns, Store};

impl<S: Store + SoloRuns + Journal> Pipeline<S> {
    /// Waits until the suspect in `ready` (one delivery) can run with no other
    /// handler running in the process, records in its own committed
    /// transaction that it started alone, then applies it under the solo
    /// deadline, in a unit of work that forgets its solo runs when it commits.
    ///
    /// Only those records count toward the poison limit, on every queue type: a
    /// broker's delivery count grows for every message a dying process held, and
    /// a producer can forge the header on a first delivery.
    pub(super) async fn run_suspect(
        &self,
        ready: &[Ready],
        calls: Vec<Call<S::Db>>,
    ) -> Vec<Decided> {
        let [suspect] = ready else {
            unreachable!("a suspect runs as a batch of its own");
        };
        let meta = &suspect.meta;
        let attempt = suspect.admitted.history.attempt();
        // A suspect whose claim committed cannot have died in its handler:
        // it comes back because its ack was lost with its channel or its
        // process (after the commit, or held with the acks of a batch). It
        // settles as the duplicate it is, with no solo run, so that a crash
        // with a large prefetch does not make every committed delivery wait
        // its turn alone. (If this read fails, the solo run decides.)
        if let Ok(true) = self
            .store
            .claimed(&self.config.name, &meta.message_id)
            .await
        {
            return vec![(Disposition::Ack(Applied::Duplicate), None)];
        }
        self.telemetry.suspect_waiting(1.0);
        let alone = self.barrier.alone().await;
        self.telemetry.suspect_waiting(-1.0);
        let runs = match self
            .store
            .record_solo_run(&self.config.name, &meta.message_id)
            .await
        {
            Ok(runs) => runs,
            // Unrecorded, a run would be no evidence: the message goes back as a
            // fresh copy and intake pauses until the database answers.
            Err(e) => {
                let error = format!("cannot record the solo run: {e}");
                return vec![(Disposition::Return { error }, None)];
            }
        };
        let limit = self.config.retry.poison_limit();
        if runs > limit {
            let error = format!(
                "ran alone {limit} times and the process died each time without an \
                 outcome being recorded; the handler kills the process"
            );
            return vec![(
                Disposition::dead_letter(DeadLetterReason::Poison, error, attempt),
                None,
            )];
        }
        self.telemetry.solo_run();
        // A second or later solo run means the last one ended without an
        // outcome: the campaign measures how often that happens to healthy
        // messages from this line.
        tracing::info!(
            message_id = %meta.message_id,
            solo_run = runs,
            poison_limit = limit,
            "suspect runs alone"
        );
        let deadline = self.config.solo_timeout;
        let applied = tokio::time::timeout(deadline, self.apply(ready, calls, true)).await;
        drop(alone);
        applied.unwrap_or_else(|_| {
            // Dropping the run rolled its transaction back; the recorded run
            // stays, so a hung handler counts like a crash.
            let error = format!("ran alone for {deadline:?} without finishing; counted as a crash");
            vec![(Disposition::Requeue { error }, None)]
        })
    }
}
