//! Dead letters kept in the service's database: the rows, the filters that
//! find them, and the store capability that keeps them.

use std::future::Future;

use chrono::{DateTime, Utc};

use super::{Store, StoreError};

/// A dead letter as it is stored: what the ingester read off the dead-letter
/// queue, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewDeadLetter {
    /// The failure's id ([`letter_id`](crate::admin::letter_id)): storing the
    /// same letter twice keeps one.
    pub letter_id: String,
    /// The consumer that gave up on the message.
    pub consumer: String,
    /// The queue it was consumed from.
    pub queue: String,
    /// The AMQP message id ("" if it had none).
    pub message_id: String,
    /// The event type ("" if unknown).
    pub event_type: String,
    /// The correlation id ("" if none).
    pub correlation_id: String,
    /// The replay that sent the copy which failed ("" if none).
    pub replay_id: String,
    /// The dead-letter reason.
    pub reason: String,
    /// The error text.
    pub error: String,
    /// Attempts made.
    pub attempts: u32,
    /// The exchange the message was first published to.
    pub original_exchange: String,
    /// The routing key it was first published with.
    pub original_routing_key: String,
    /// When it first failed.
    pub first_failure: DateTime<Utc>,
    /// When it last failed.
    pub last_failure: DateTime<Utc>,
    /// What made it fail, as a group key: the same for letters that failed
    /// the same way (`warren_admin::fingerprint`).
    pub fingerprint: String,
    /// Every header, decoded as text: a JSON object.
    pub headers: String,
    /// The AMQP properties as they were dead-lettered, to publish a replay
    /// with: JSON.
    pub properties: String,
    /// The body, whole unless `body_truncated`.
    pub body: Vec<u8>,
    /// The body did not fit and was cut; the whole letter waits on the side
    /// queue.
    pub body_truncated: bool,
    /// The envelope's payload (redacted where configured), for searching by
    /// field: JSON, if the body held an envelope.
    pub payload: Option<String>,
    /// The payload fields whose values were replaced before storing,
    /// comma-separated ("" if none).
    pub redacted_fields: String,
    /// The entity of a strict-order message ("" if none): replays of one
    /// entity go out in version order.
    pub entity: String,
    /// Its version, if it has one.
    pub entity_version: Option<i64>,
}

/// Where a stored letter stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LetterState {
    /// Nobody has dealt with it yet.
    Unresolved,
    /// Sent back to its queue by a replay; its outcome is in the journal.
    Replayed,
    /// An operator marked it dealt with.
    Resolved,
}

impl LetterState {
    /// The name stored and printed.
    pub fn as_str(self) -> &'static str {
        match self {
            LetterState::Unresolved => "unresolved",
            LetterState::Replayed => "replayed",
            LetterState::Resolved => "resolved",
        }
    }

    /// The state a stored name stands for.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "unresolved" => Some(LetterState::Unresolved),
            "replayed" => Some(LetterState::Replayed),
            "resolved" => Some(LetterState::Resolved),
            _ => None,
        }
    }
}

/// A stored letter as listed: everything but its body, headers and
/// properties.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredDeadLetter {
    /// The failure's id.
    pub letter_id: String,
    /// The consumer that gave up on the message.
    pub consumer: String,
    /// The queue it was consumed from.
    pub queue: String,
    /// The AMQP message id ("" if it had none).
    pub message_id: String,
    /// The event type ("" if unknown).
    pub event_type: String,
    /// The correlation id ("" if none).
    pub correlation_id: String,
    /// The replay that sent the copy which failed ("" if none).
    pub replay_id: String,
    /// The dead-letter reason.
    pub reason: String,
    /// The error text.
    pub error: String,
    /// Attempts made.
    pub attempts: u32,
    /// The exchange the message was first published to.
    pub original_exchange: String,
    /// The routing key it was first published with.
    pub original_routing_key: String,
    /// When it first failed.
    pub first_failure: DateTime<Utc>,
    /// When it last failed.
    pub last_failure: DateTime<Utc>,
    /// The group it is in.
    pub group_key: String,
    /// Where it stands.
    pub state: LetterState,
    /// The body was cut to fit; the whole letter waits on the side queue.
    pub body_truncated: bool,
}

/// A stored letter whole: as listed, with its headers, properties and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterRecord {
    /// What a listing shows.
    pub letter: StoredDeadLetter,
    /// Every header, decoded as text: a JSON object.
    pub headers: String,
    /// The AMQP properties as dead-lettered: JSON.
    pub properties: String,
    /// The body (cut if `letter.body_truncated`), as it failed.
    pub body: Vec<u8>,
    /// The last edit, if an operator edited the letter: a replay sends this
    /// body instead.
    pub edit: Option<LetterEdit>,
}

/// An operator's edit of a letter's body, kept beside the original.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LetterEdit {
    /// The edited body.
    pub body: Vec<u8>,
    /// Who edited it.
    pub by: String,
    /// Why.
    pub reason: String,
    /// When.
    pub at: DateTime<Utc>,
}

impl DeadLetterRecord {
    /// The body a replay sends: the edited one if there is one.
    pub fn body_to_send(&self) -> &[u8] {
        self.edit.as_ref().map_or(&self.body, |e| &e.body)
    }

    /// Each header's name and its value as text (a string as it is, any
    /// other value as JSON), in the stored order.
    pub fn header_texts(&self) -> Vec<(String, String)> {
        match serde_json::from_str::<serde_json::Value>(&self.headers) {
            Ok(serde_json::Value::Object(map)) => map
                .into_iter()
                .map(|(k, v)| {
                    let text = match v {
                        serde_json::Value::String(s) => s,
                        other => other.to_string(),
                    };
                    (k, text)
                })
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// One group of letters that failed the same way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterGroup {
    /// The group's key (a fingerprint, unless letters were moved into it).
    pub group_key: String,
    /// The reason of its letters.
    pub reason: String,
    /// The event type of its letters.
    pub event_type: String,
    /// Letters in it, in the states the filter asked for.
    pub count: u64,
    /// When its first letter first failed.
    pub first_seen: DateTime<Utc>,
    /// When its last letter last failed.
    pub last_seen: DateTime<Utc>,
    /// The error of one of its letters.
    pub sample_error: String,
}

/// Which stored letters a listing or a count takes. Every field narrows it;
/// the default takes every unresolved letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LetterFilter {
    /// Letters in this state (default: unresolved).
    pub state: LetterState,
    /// Of this consumer.
    pub consumer: Option<String>,
    /// Of this event type.
    pub event_type: Option<String>,
    /// Dead-lettered for this reason.
    pub reason: Option<String>,
    /// In this group.
    pub group: Option<String>,
    /// Last failed at or after this.
    pub since: Option<DateTime<Utc>>,
    /// Last failed before this.
    pub until: Option<DateTime<Utc>>,
    /// With this message id.
    pub message_id: Option<String>,
    /// With this correlation id.
    pub correlation_id: Option<String>,
    /// This one letter.
    pub letter_id: Option<String>,
    /// Whose payload has this top-level field with this value (compared as
    /// text, or as a number where the value reads as one).
    pub payload_field: Option<(String, String)>,
}

impl Default for LetterFilter {
    fn default() -> Self {
        Self {
            state: LetterState::Unresolved,
            consumer: None,
            event_type: None,
            reason: None,
            group: None,
            since: None,
            until: None,
            message_id: None,
            correlation_id: None,
            payload_field: None,
            letter_id: None,
        }
    }
}

impl LetterFilter {
    /// The filter that takes `letter` alone, in the state it is in.
    pub fn of_letter(letter: &StoredDeadLetter) -> Self {
        Self {
            state: letter.state,
            letter_id: Some(letter.letter_id.clone()),
            ..Self::default()
        }
    }

    /// The filter that takes a group's unresolved letters.
    pub fn of_group(group: &str) -> Self {
        Self {
            group: Some(group.to_owned()),
            ..Self::default()
        }
    }

    /// The filter as `name=value` pairs, for the audit table and messages.
    pub fn describe(&self) -> String {
        let mut parts = vec![format!("state={}", self.state.as_str())];
        let named = [
            ("letter", &self.letter_id),
            ("consumer", &self.consumer),
            ("type", &self.event_type),
            ("reason", &self.reason),
            ("group", &self.group),
            ("message-id", &self.message_id),
            ("correlation-id", &self.correlation_id),
        ];
        for (name, value) in named {
            if let Some(v) = value {
                parts.push(format!("{name}={v}"));
            }
        }
        if let Some(t) = self.since {
            parts.push(format!("since={}", t.to_rfc3339()));
        }
        if let Some(t) = self.until {
            parts.push(format!("until={}", t.to_rfc3339()));
        }
        if let Some((field, value)) = &self.payload_field {
            parts.push(format!("payload.{field}={value}"));
        }
        parts.join(" ")
    }
}

/// Where a page of a listing starts: after this letter, in the listing's
/// order (newest failure first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageAfter {
    /// The last failure of the last letter of the previous page.
    pub last_failure: DateTime<Utc>,
    /// Its id.
    pub letter_id: String,
}

impl PageAfter {
    /// The page that follows `letter`, the last of a page.
    pub fn after(letter: &StoredDeadLetter) -> Self {
        Self {
            last_failure: letter.last_failure,
            letter_id: letter.letter_id.clone(),
        }
    }

    /// The cursor as text, `TIME,LETTER`: what the CLI prints for `--after`
    /// and the console puts in its next-page link.
    pub fn cursor(&self) -> String {
        format!(
            "{},{}",
            // Every digit the time has: a cursor cut to microseconds would
            // repeat or skip letters on a store that keeps nanoseconds.
            self.last_failure
                .to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
            self.letter_id
        )
    }

    /// Reads a cursor [`cursor`](Self::cursor) wrote; `None` if it is not one.
    pub fn from_cursor(text: &str) -> Option<Self> {
        let (time, letter) = text.split_once(',')?;
        let last_failure = DateTime::parse_from_rfc3339(time).ok()?.with_timezone(&Utc);
        Some(Self {
            last_failure,
            letter_id: letter.to_owned(),
        })
    }
}

/// Who changes stored letters, for the audit table: the operator name given,
/// and the OS user the command ran as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    /// The name the operator gave (`--operator`).
    pub operator: String,
    /// The OS user the command ran as.
    pub os_user: String,
}

impl Actor {
    /// `operator`, running as the current OS user (`$USER`, else `$LOGNAME`,
    /// else "unknown").
    pub fn new(operator: impl Into<String>) -> Self {
        let os_user = std::env::var("USER")
            .or_else(|_| std::env::var("LOGNAME"))
            .unwrap_or_else(|_| "unknown".to_owned());
        Self {
            operator: operator.into(),
            os_user,
        }
    }
}

/// One line of the audit table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEntry {
    /// When.
    pub at: DateTime<Utc>,
    /// The operator name given.
    pub operator: String,
    /// The OS user the command ran as.
    pub os_user: String,
    /// What was done: `resolve`, `reclassify`, `mute`, `unmute`, `purge`,
    /// `replay`, `edit`, `policy`.
    pub action: String,
    /// What it was done to: a letter id, a group, a filter.
    pub target: String,
    /// The rest: counts, reasons, values.
    pub detail: String,
    /// Done with `--force`, past a safety check.
    pub forced: bool,
}

/// A muted group: left out of the alerting metrics until `until`, or until
/// it grows by more than `grow_limit` letters, whichever comes first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupMute {
    /// The group.
    pub group_key: String,
    /// Muted until this time (`None`: no time limit).
    pub until: Option<DateTime<Utc>>,
    /// Muted until the group holds more than this many letters beyond
    /// `count_at_mute` (`None`: no growth limit).
    pub grow_limit: Option<u64>,
    /// Unresolved letters in the group when it was muted.
    pub count_at_mute: u64,
    /// Why.
    pub reason: String,
}

impl GroupMute {
    /// Whether the mute still holds for a group of `count` unresolved
    /// letters at `now`.
    pub fn holds(&self, count: u64, now: DateTime<Utc>) -> bool {
        self.until.is_none_or(|t| now < t)
            && self
                .grow_limit
                .is_none_or(|g| count <= self.count_at_mute.saturating_add(g))
    }
}

/// What the alerting metrics and a status line need, counted without
/// reading a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterStats {
    /// Unresolved letters in each group, the largest first.
    pub unresolved_by_group: Vec<(String, u64)>,
    /// When the oldest unresolved letter last failed.
    pub oldest_unresolved: Option<DateTime<Utc>>,
    /// Rows in the table, in every state.
    pub rows: u64,
    /// The table's size on disk with its indexes, where the database says.
    pub bytes: Option<u64>,
}

/// A letter a replay may take, as chosen when the replay starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayCandidate {
    /// The letter.
    pub letter_id: String,
    /// Its consumer.
    pub consumer: String,
    /// Its message id.
    pub message_id: String,
    /// Its strict-order entity ("" if none).
    pub entity: String,
    /// Its version within the entity.
    pub entity_version: Option<i64>,
    /// When it first failed.
    pub first_failure: DateTime<Utc>,
    /// Its body was cut on storing: only the side queue holds it whole.
    pub body_truncated: bool,
    /// An operator edited its body.
    pub edited: bool,
}

/// A replay run: the letters chosen when it started, in the order they go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayRun {
    /// Its id, to resume it by.
    pub run_id: String,
    /// The filter that chose its letters, described.
    pub selection: String,
    /// Letters in it.
    pub total: u64,
    /// Letters published so far.
    pub published: u64,
    /// `running`, `finished` or `stopped`.
    pub state: String,
    /// Started as a careful replay: resumed carefully too.
    pub careful: bool,
    /// Why it stopped, if it did.
    pub stop_reason: String,
    /// The operator who started it.
    pub started_by: String,
    /// When.
    pub started_at: DateTime<Utc>,
}

/// One replay of a letter, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LetterReplay {
    /// The id its copy carried.
    pub replay_id: String,
    /// Its run.
    pub run_id: String,
    /// Who asked for it.
    pub requested_by: String,
    /// The OS user it ran as.
    pub os_user: String,
    /// It sent an edited body.
    pub edited: bool,
    /// When it was recorded.
    pub created_at: DateTime<Utc>,
    /// When the broker confirmed the copy (`None`: not published yet).
    pub published_at: Option<DateTime<Utc>>,
}

/// One letter of a run not yet published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingReplay {
    /// The id the copy carries (`x-warren-replay-id`).
    pub replay_id: String,
    /// The letter.
    pub letter_id: String,
    /// Its place in the run.
    pub seq: u64,
}

store_trait! {
    /// Dead letters kept in the service's database: stored once per failure,
    /// grouped, listed and read.
    pub trait DeadLetterStore: Store {
        /// Stores `letter`; `false` if a letter with its id was stored before
        /// (the same failure, dead-lettered again), which changes nothing
        /// unless that letter was resolved or replayed and this failure is
        /// later: then it is opened again (unresolved, with the new failure's
        /// time and error), and the answer is `true`.
        fn store_dead_letter<'a>(
            &'a self,
            letter: &'a NewDeadLetter,
        ) -> impl Future<Output = Result<bool, StoreError>> + Send + 'a;

        /// The groups of the letters `filter` takes, the largest first, at most
        /// `limit`.
        fn dead_letter_groups<'a>(
            &'a self,
            filter: &'a LetterFilter,
            limit: u32,
        ) -> impl Future<Output = Result<Vec<DeadLetterGroup>, StoreError>> + Send + 'a;

        /// A page of the letters `filter` takes, newest failure first: at most
        /// `limit`, after `after` if given.
        fn dead_letters<'a>(
            &'a self,
            filter: &'a LetterFilter,
            after: Option<&'a PageAfter>,
            limit: u32,
        ) -> impl Future<Output = Result<Vec<StoredDeadLetter>, StoreError>> + Send + 'a;

        /// One letter whole, by id.
        fn dead_letter<'a>(
            &'a self,
            letter_id: &'a str,
        ) -> impl Future<Output = Result<Option<DeadLetterRecord>, StoreError>> + Send + 'a;

        /// Marks the letters `filter` takes as resolved, and audits it, in one
        /// transaction; how many changed.
        fn resolve_dead_letters<'a>(
            &'a self,
            filter: &'a LetterFilter,
            actor: &'a Actor,
        ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;

        /// Moves the letters `filter` takes into `group` (merging groups when
        /// the filter is a group), and audits it; how many moved.
        fn reclassify_dead_letters<'a>(
            &'a self,
            filter: &'a LetterFilter,
            group: &'a str,
            actor: &'a Actor,
        ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;

        /// Mutes a group (replacing an earlier mute of it), counting its
        /// unresolved letters now as `count_at_mute`, and audits it.
        fn mute_group<'a>(
            &'a self,
            group: &'a str,
            until: Option<DateTime<Utc>>,
            grow_limit: Option<u64>,
            reason: &'a str,
            actor: &'a Actor,
        ) -> impl Future<Output = Result<GroupMute, StoreError>> + Send + 'a;

        /// Lifts a group's mute, and audits it; `false` if it was not muted.
        fn unmute_group<'a>(
            &'a self,
            group: &'a str,
            actor: &'a Actor,
        ) -> impl Future<Output = Result<bool, StoreError>> + Send + 'a;

        /// Every mute, lifted by time or growth or not.
        fn group_mutes(&self) -> impl Future<Output = Result<Vec<GroupMute>, StoreError>> + Send + '_;

        /// Deletes up to `limit` letters in `state` whose state last changed
        /// before `before`; how many went. The caller loops, and audits.
        fn purge_dead_letters(
            &self,
            state: LetterState,
            before: DateTime<Utc>,
            limit: u32,
        ) -> impl Future<Output = Result<u64, StoreError>> + Send + '_;

        /// Writes one line to the audit table.
        fn audit<'a>(
            &'a self,
            actor: &'a Actor,
            action: &'a str,
            target: &'a str,
            detail: &'a str,
            forced: bool,
        ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

        /// The newest `limit` lines of the audit table, newest first.
        fn audit_log(&self, limit: u32) -> impl Future<Output = Result<Vec<AuditEntry>, StoreError>> + Send + '_;

        /// The letters `filter` takes, for a replay to choose from: at most
        /// `limit`, in no particular order.
        fn replay_candidates<'a>(
            &'a self,
            filter: &'a LetterFilter,
            limit: u32,
        ) -> impl Future<Output = Result<Vec<ReplayCandidate>, StoreError>> + Send + 'a;

        /// Records a run of `letters` (in the order given, replay ids
        /// `RUN.SEQ`), started by `actor`, and audits it, in one transaction.
        fn create_replay_run<'a>(
            &'a self,
            run_id: &'a str,
            selection: &'a str,
            letters: &'a [ReplayCandidate],
            careful: bool,
            actor: &'a Actor,
            forced: bool,
        ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

        /// A run, with how many of its letters went out.
        fn replay_run<'a>(
            &'a self,
            run_id: &'a str,
        ) -> impl Future<Output = Result<Option<ReplayRun>, StoreError>> + Send + 'a;

        /// The next `limit` letters of a run not yet published, in order.
        fn pending_replays<'a>(
            &'a self,
            run_id: &'a str,
            limit: u32,
        ) -> impl Future<Output = Result<Vec<PendingReplay>, StoreError>> + Send + 'a;

        /// The replays of one letter, oldest first.
        fn letter_replays<'a>(
            &'a self,
            letter_id: &'a str,
        ) -> impl Future<Output = Result<Vec<LetterReplay>, StoreError>> + Send + 'a;

        /// Records confirmed publishes: each replay row's time, and each letter
        /// replayed, in one transaction.
        fn replays_published<'a>(
            &'a self,
            replays: &'a [PendingReplay],
        ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

        /// Ends a run: `finished`, or `stopped` with why.
        fn end_replay_run<'a>(
            &'a self,
            run_id: &'a str,
            state: &'a str,
            reason: &'a str,
        ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

        /// Keeps `body` as the letter's edited body (its original stays), with
        /// who and why, and audits it with `detail`; `false` if no letter has
        /// the id.
        fn edit_dead_letter<'a>(
            &'a self,
            letter_id: &'a str,
            body: &'a [u8],
            reason: &'a str,
            detail: &'a str,
            actor: &'a Actor,
        ) -> impl Future<Output = Result<bool, StoreError>> + Send + 'a;

        /// Whether operators may edit letters here (`dead_letters.edit`;
        /// allowed unless switched off).
        fn edits_allowed(&self) -> impl Future<Output = Result<bool, StoreError>> + Send + '_;

        /// Allows or forbids edits for every process on this database, and
        /// audits it.
        fn allow_edits<'a>(
            &'a self,
            allowed: bool,
            actor: &'a Actor,
        ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

        /// Counts for alerting and status, without reading a body.
        fn dead_letter_stats(&self) -> impl Future<Output = Result<DeadLetterStats, StoreError>> + Send + '_;
    }
}
