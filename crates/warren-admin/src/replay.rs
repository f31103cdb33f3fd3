//! Replay from the dead-letter store: the letters a filter takes when the
//! replay starts become a run, recorded before anything is published; each
//! goes back to its queue with a confirm, carrying a signed replay id
//! (`x-warren-replay-id`, `RUN.SEQ`), and is marked replayed once
//! confirmed. A run interrupted anywhere resumes where it stopped: a letter
//! published but not yet marked goes again under the same replay id, which
//! its consumer's inbox recognizes.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use lapin::types::AMQPValue;
use lapin::{BasicProperties, Connection};

use warren::__kit::{GatedVersion, Signer};
use warren::broker::{BatchItem, BrokerError, Publisher};
use warren::headers::HEADER_REPLAY_ID;
use warren::store::{
    Actor, DeadLetterStore, Journal, LetterFilter, PendingReplay, ReplayCandidate, ReplayRun,
    SigningKey, StoreError,
};

use crate::queue::{in_version_order, replay_properties_of};

/// The most letters one run takes.
pub const MAX_REPLAY_RUN: u32 = 1_000_000;

/// Letters read per step of a run.
const STEP: u32 = 500;

/// Letters published together, their confirms awaited at once, when no
/// rate is set.
const CHUNK: usize = 64;

/// Why a replay did not start, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The filter took no letter.
    #[error("no unresolved letter matches {0}")]
    NothingSelected(String),
    /// Some letters are older than the inbox remembers.
    #[error(
        "{count} of the {total} letters first failed before {cutoff} (the inbox retention window): \
         their inbox rows may be purged, so a replay could apply their effects twice. \
         Replay newer letters, or pass --force if you know none of them was applied"
    )]
    TooOld {
        /// Letters older than the window.
        count: usize,
        /// Letters selected.
        total: usize,
        /// The start of the window.
        cutoff: String,
    },
    /// Some letters were stored cut: only the side queue holds them whole.
    #[error(
        "{0} of the letters were stored cut (their body did not fit); replay them whole from the \
         side queue with `warren dlq`, and resolve them here"
    )]
    Cut(usize),
    /// No run has this id.
    #[error("no replay run {0:?}")]
    UnknownRun(String),
    /// A stored letter does not read back as one.
    #[error("letter {letter_id} cannot be replayed: {why}")]
    Unreadable {
        /// The letter.
        letter_id: String,
        /// What is wrong.
        why: String,
    },
    /// Careful replay: a copy of the run failed again.
    #[error(
        "stopped: the copy {replay_id} failed again ({outcome}: {detail}); nothing after it was replayed"
    )]
    FailedAgain {
        /// The copy.
        replay_id: String,
        /// `retried`, `parked` or `dead-lettered`.
        outcome: String,
        /// The error.
        detail: String,
    },
    /// Careful replay: no outcome was journaled for a copy in time.
    #[error(
        "stopped: outcome unknown: the consumer journaled nothing for the copy {replay_id} within          {waited:?}; is it running? Resume the run once it is"
    )]
    OutcomeUnknown {
        /// The copy.
        replay_id: String,
        /// How long the replay waited.
        waited: Duration,
    },
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The broker failed.
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

/// Replays stored dead letters to their queues.
///
/// ```no_run
/// # async fn demo(store: warren::PgStore, connection: std::sync::Arc<warren::lapin::Connection>) -> Result<(), Box<dyn std::error::Error>> {
/// use warren_admin::Replayer;
/// use warren::store::{Actor, LetterFilter};
///
/// let replayer = Replayer::new(store, connection, Actor::new("ana")).with_rate(50.0)?;
/// let filter = LetterFilter { group: Some("3f2a9c0d1e4b5a6f".into()), ..LetterFilter::default() };
/// let run = replayer.start(&filter, Some(std::time::Duration::from_secs(30 * 86_400)), false).await?;
/// let done = replayer.resume(&run.run_id, |_| {}).await?;
/// println!("replayed {} of {}", done.published, done.total);
/// # Ok(()) }
/// ```
pub struct Replayer<S> {
    store: S,
    connection: Arc<Connection>,
    actor: Actor,
    pace: Option<Duration>,
    careful: Option<Duration>,
}

/// How long a careful run resumed without a timeout of its own waits for a
/// copy's outcome.
pub const DEFAULT_OUTCOME_TIMEOUT: Duration = Duration::from_secs(60);

/// How often a careful replay looks for a failure among its copies.
const FAILURE_CHECK: Duration = Duration::from_secs(1);

/// What a copy's journaled outcome means to a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CopyOutcome {
    /// Applied: its effect committed.
    Applied,
    /// The inbox already held its message id: nothing was applied. After an
    /// edit, the edit did nothing.
    Duplicate,
    /// A newer version of its entity had applied: acked, not applied.
    Stale,
}

impl<S: DeadLetterStore + SigningKey + Journal> Replayer<S> {
    /// A replayer publishing on `connection`, acting as `actor`.
    pub fn new(store: S, connection: Arc<Connection>, actor: Actor) -> Self {
        Self {
            store,
            connection,
            actor,
            pace: None,
            careful: None,
        }
    }

    /// Careful replay: the run's first copy must be journaled `applied`
    /// (or `duplicate` or `stale`, which count as done) within `timeout`
    /// before any other goes; then the run stops at the first copy journaled
    /// as failed again. Without an outcome in time it stops with "outcome
    /// unknown", never guessing.
    pub fn careful(mut self, timeout: Duration) -> Self {
        self.careful = Some(timeout);
        self
    }

    /// Waits up to `timeout` for the outcome the consumer journals for the
    /// copy `replay_id`. A retried or parked copy is waited on until it
    /// applies or is dead-lettered.
    pub async fn outcome_of(
        &self,
        replay_id: &str,
        timeout: Duration,
    ) -> Result<CopyOutcome, ReplayError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let entries = self.store.journal_of_replay(replay_id).await?;
            for e in entries.iter().rev() {
                match e.outcome.as_str() {
                    "applied" => return Ok(CopyOutcome::Applied),
                    "duplicate" => return Ok(CopyOutcome::Duplicate),
                    "stale" => return Ok(CopyOutcome::Stale),
                    "dead-lettered" => {
                        return Err(ReplayError::FailedAgain {
                            replay_id: replay_id.to_owned(),
                            outcome: e.outcome.clone(),
                            detail: e.detail.clone(),
                        });
                    }
                    _ => {}
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ReplayError::OutcomeUnknown {
                    replay_id: replay_id.to_owned(),
                    waited: timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Publishes at most `per_second` letters a second.
    pub fn with_rate(mut self, per_second: f64) -> Result<Self, String> {
        if !(per_second.is_finite() && per_second > 0.0) {
            return Err(format!(
                "a replay rate must be a positive number per second, not {per_second}"
            ));
        }
        let period = Duration::from_secs_f64(1.0 / per_second);
        self.pace = (period >= Duration::from_micros(1)).then_some(period);
        Ok(self)
    }

    /// Starts a run of the unresolved letters `filter` takes now (later
    /// letters are not in it), in the order they failed, strict-order
    /// entities in version order. Refuses letters that first failed before
    /// `inbox_retention` ago unless `force` (audited as forced), and letters
    /// stored cut. Publishes nothing: [`resume`](Self::resume) does.
    pub async fn start(
        &self,
        filter: &LetterFilter,
        inbox_retention: Option<Duration>,
        force: bool,
    ) -> Result<ReplayRun, ReplayError> {
        let mut letters = self.store.replay_candidates(filter, MAX_REPLAY_RUN).await?;
        if letters.is_empty() {
            return Err(ReplayError::NothingSelected(filter.describe()));
        }
        let cut = letters.iter().filter(|l| l.body_truncated).count();
        if cut > 0 {
            return Err(ReplayError::Cut(cut));
        }
        let mut too_old = 0;
        if let Some(window) = inbox_retention {
            let cutoff = warren::admin::cutoff(window).unwrap_or(chrono::DateTime::<Utc>::MIN_UTC);
            too_old = letters.iter().filter(|l| l.first_failure < cutoff).count();
            if too_old > 0 && !force {
                return Err(ReplayError::TooOld {
                    count: too_old,
                    total: letters.len(),
                    cutoff: cutoff.to_rfc3339(),
                });
            }
        }
        letters
            .sort_by(|a, b| (a.first_failure, &a.letter_id).cmp(&(b.first_failure, &b.letter_id)));
        in_version_order(&mut letters, gated);
        let run_id = uuid::Uuid::now_v7().simple().to_string();
        self.store
            .create_replay_run(
                &run_id,
                &filter.describe(),
                &letters,
                self.careful.is_some(),
                &self.actor,
                too_old > 0,
            )
            .await?;
        self.store
            .replay_run(&run_id)
            .await?
            .ok_or(ReplayError::UnknownRun(run_id))
    }

    /// Publishes the run's letters not yet published, in order, each
    /// confirmed and then marked; calls `progress` after each. Ends the run
    /// as finished, or as stopped with the error that stopped it.
    pub async fn resume(
        &self,
        run_id: &str,
        mut progress: impl FnMut(&PendingReplay),
    ) -> Result<ReplayRun, ReplayError> {
        let Some(run) = self.store.replay_run(run_id).await? else {
            return Err(ReplayError::UnknownRun(run_id.to_owned()));
        };
        // A careful run stays careful when it is resumed.
        let careful = self
            .careful
            .or(run.careful.then_some(DEFAULT_OUTCOME_TIMEOUT));
        let signer = Signer::new(&self.store.signing_key().await?);
        let publisher = Publisher::new(Arc::clone(&self.connection));
        let done = self
            .publish_all(run_id, careful, &signer, &publisher, &mut progress)
            .await;
        publisher.close().await;
        let (state, reason) = match &done {
            Ok(()) => ("finished", String::new()),
            Err(e) => ("stopped", e.to_string()),
        };
        self.store.end_replay_run(run_id, state, &reason).await?;
        done?;
        self.store
            .replay_run(run_id)
            .await?
            .ok_or_else(|| ReplayError::UnknownRun(run_id.to_owned()))
    }

    async fn publish_all(
        &self,
        run_id: &str,
        careful: Option<Duration>,
        signer: &Signer,
        publisher: &Publisher,
        progress: &mut impl FnMut(&PendingReplay),
    ) -> Result<(), ReplayError> {
        let mut pace = self.pace.map(|p| {
            let mut i = tokio::time::interval(p);
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        });
        // Only failures journaled since this pass began stop it: resuming
        // after a stop is the operator's call on the failures before.
        let since = Utc::now();
        let careful_now = careful.is_some();
        if let Some(timeout) = careful {
            self.probe(run_id, timeout, signer, publisher, progress)
                .await?;
            self.no_failure_in(run_id, careful_now, since).await?;
        }
        let mut checked = tokio::time::Instant::now();
        loop {
            let pending = self.store.pending_replays(run_id, STEP).await?;
            if pending.is_empty() {
                return self.no_failure_in(run_id, careful_now, since).await;
            }
            // Unpaced, the confirms of a chunk are awaited together: one
            // round trip to the broker and one commit per chunk, not per
            // letter. Paced, one letter a tick.
            let chunk = if pace.is_some() { 1 } else { CHUNK };
            for replays in pending.chunks(chunk) {
                if let Some(p) = pace.as_mut() {
                    p.tick().await;
                }
                if checked.elapsed() >= FAILURE_CHECK {
                    self.no_failure_in(run_id, careful_now, since).await?;
                    checked = tokio::time::Instant::now();
                }
                self.publish_chunk(replays, signer, publisher, progress)
                    .await?;
            }
        }
    }

    /// Publishes `replays`, their confirms awaited together, and marks those
    /// confirmed (in one transaction); the first failure, if any, after.
    async fn publish_chunk(
        &self,
        replays: &[PendingReplay],
        signer: &Signer,
        publisher: &Publisher,
        progress: &mut impl FnMut(&PendingReplay),
    ) -> Result<(), ReplayError> {
        let mut copies = Vec::with_capacity(replays.len());
        for replay in replays {
            copies.push(self.copy_of(replay, signer).await?);
        }
        let items: Vec<BatchItem<'_>> = copies
            .iter()
            .map(|(queue, body, properties)| BatchItem {
                exchange: "",
                routing_key: queue,
                body,
                properties: properties.clone(),
            })
            .collect();
        let results = publisher.publish_batch(&items).await;
        let confirmed: Vec<PendingReplay> = replays
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_ok())
            .map(|(p, _)| p.clone())
            .collect();
        self.store.replays_published(&confirmed).await?;
        for p in &confirmed {
            progress(p);
        }
        match results.into_iter().find_map(Result::err) {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Careful replay's first step: the run's first copy is published (if
    /// it was not before an interruption) and its outcome awaited.
    async fn probe(
        &self,
        run_id: &str,
        timeout: Duration,
        signer: &Signer,
        publisher: &Publisher,
        progress: &mut impl FnMut(&PendingReplay),
    ) -> Result<(), ReplayError> {
        let first_id = format!("{run_id}.1");
        let pending = self.store.pending_replays(run_id, 1).await?;
        if let Some(first) = pending.first().filter(|p| p.seq == 1) {
            self.publish_chunk(std::slice::from_ref(first), signer, publisher, progress)
                .await?;
        }
        self.outcome_of(&first_id, timeout).await?;
        Ok(())
    }

    /// Careful replay: stops at the first copy of the run journaled as failed
    /// again. A plain replay goes on regardless.
    async fn no_failure_in(
        &self,
        run_id: &str,
        careful: bool,
        since: chrono::DateTime<Utc>,
    ) -> Result<(), ReplayError> {
        if !careful {
            return Ok(());
        }
        // The first copy's retries were judged by the probe, which waited
        // for its final outcome.
        let first_id = format!("{run_id}.1");
        let failures = self.store.journal_of_run(run_id, true, 100).await?;
        match failures
            .into_iter()
            .find(|e| e.replay_id != first_id && e.at >= since)
        {
            Some(e) => Err(ReplayError::FailedAgain {
                replay_id: e.replay_id,
                outcome: e.outcome,
                detail: e.detail,
            }),
            None => Ok(()),
        }
    }

    /// Where a letter's copy goes, its body and its properties.
    async fn copy_of(
        &self,
        replay: &PendingReplay,
        signer: &Signer,
    ) -> Result<(String, Vec<u8>, BasicProperties), ReplayError> {
        let unreadable = |why: String| ReplayError::Unreadable {
            letter_id: replay.letter_id.clone(),
            why,
        };
        let record = self
            .store
            .dead_letter(&replay.letter_id)
            .await?
            .ok_or_else(|| unreadable("it is no longer stored (purged?)".into()))?;
        let dead: BasicProperties = serde_json::from_str(&record.properties)
            .map_err(|e| unreadable(format!("its stored properties do not read: {e}")))?;
        let properties = replay_copy(&dead, &replay.replay_id, signer);
        let body = record.body_to_send().to_vec();
        Ok((record.letter.queue, body, properties))
    }
}

/// The properties of a replayed copy: as a broker-side replay makes them,
/// plus the replay id, signed.
fn replay_copy(dead: &BasicProperties, replay_id: &str, signer: &Signer) -> BasicProperties {
    let properties = replay_properties_of(dead, None);
    let mut headers = properties.headers().clone().unwrap_or_default();
    headers.insert(
        HEADER_REPLAY_ID.into(),
        AMQPValue::LongString(replay_id.into()),
    );
    let message_id = properties
        .message_id()
        .as_ref()
        .map(|s| s.to_string())
        .unwrap_or_default();
    signer.sign(&message_id, &mut headers);
    properties.with_headers(headers)
}

fn gated(letter: &ReplayCandidate) -> Option<GatedVersion> {
    if letter.entity.is_empty() {
        return None;
    }
    Some(GatedVersion {
        entity: letter.entity.clone(),
        version: letter.entity_version?,
    })
}
