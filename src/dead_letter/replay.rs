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

use super::queue::{in_version_order, replay_properties_of};
use crate::broker::{BrokerError, Publisher};
use crate::headers::{HEADER_REPLAY_ID, Signer};
use crate::store::{
    Actor, DeadLetterStore, LetterFilter, PendingReplay, ReplayCandidate, ReplayRun, SigningKey,
    StoreError,
};
use crate::version::GatedVersion;

/// The most letters one run takes.
pub const MAX_REPLAY_RUN: u32 = 1_000_000;

/// Letters read per step of a run.
const STEP: u32 = 500;

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
/// use warren::admin::Replayer;
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
}

impl<S: DeadLetterStore + SigningKey> Replayer<S> {
    /// A replayer publishing on `connection`, acting as `actor`.
    pub fn new(store: S, connection: Arc<Connection>, actor: Actor) -> Self {
        Self {
            store,
            connection,
            actor,
            pace: None,
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
            let cutoff =
                crate::retention::cutoff(window).unwrap_or(chrono::DateTime::<Utc>::MIN_UTC);
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
        if self.store.replay_run(run_id).await?.is_none() {
            return Err(ReplayError::UnknownRun(run_id.to_owned()));
        }
        let signer = Signer::new(&self.store.signing_key().await?);
        let publisher = Publisher::new(Arc::clone(&self.connection));
        let done = self
            .publish_all(run_id, &signer, &publisher, &mut progress)
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
        signer: &Signer,
        publisher: &Publisher,
        progress: &mut impl FnMut(&PendingReplay),
    ) -> Result<(), ReplayError> {
        let mut pace = self.pace.map(|p| {
            let mut i = tokio::time::interval(p);
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        });
        loop {
            let pending = self.store.pending_replays(run_id, STEP).await?;
            if pending.is_empty() {
                return Ok(());
            }
            for replay in &pending {
                if let Some(p) = pace.as_mut() {
                    p.tick().await;
                }
                self.publish_one(replay, signer, publisher).await?;
                self.store.replay_published(replay).await?;
                progress(replay);
            }
        }
    }

    async fn publish_one(
        &self,
        replay: &PendingReplay,
        signer: &Signer,
        publisher: &Publisher,
    ) -> Result<(), ReplayError> {
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
        publisher
            .publish_raw("", &record.letter.queue, &record.body, properties)
            .await?;
        Ok(())
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
