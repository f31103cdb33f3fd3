//! The pages: groups, search, one letter, a replay run, the audit log.

use askama::Template;
use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};
use serde::Deserialize;
use warren::store::{Actor, LetterFilter, LetterState, PageAfter};

use crate::auth::{Refusal, Viewer, viewer};
use crate::server::{ConsoleStore, Shared, failure, refused, render};
use crate::view::{age, headers, payload, time};

/// Letters on one page of a search.
pub(crate) const PAGE: u32 = 50;
/// Groups on the groups page.
const GROUPS: u32 = 200;

/// Who is asking, or why nobody may see the page yet.
fn who<S: ConsoleStore>(app: &Shared<S>, headers: &HeaderMap) -> Result<Viewer, Refusal> {
    viewer(&app.config, &app.sessions, headers)
}

fn store_failed(e: impl std::fmt::Display) -> Response {
    failure(
        StatusCode::SERVICE_UNAVAILABLE,
        &format!("the database: {e}"),
    )
}

/// One row of the groups page.
pub(crate) struct GroupRow {
    pub(crate) key: String,
    pub(crate) count: u64,
    pub(crate) first_seen: String,
    pub(crate) last_seen: String,
    pub(crate) age: String,
    pub(crate) event_type: String,
    pub(crate) reason: String,
    pub(crate) sample_error: String,
    pub(crate) muted: String,
}

#[derive(Template)]
#[template(path = "groups.html")]
struct GroupsPage {
    viewer: Viewer,
    unresolved: String,
    oldest: String,
    groups: Vec<GroupRow>,
    hidden: usize,
}

/// The groups of unresolved letters, the largest first; muted groups apart.
pub(crate) async fn groups<S: ConsoleStore>(
    State(app): State<Shared<S>>,
    headers: HeaderMap,
) -> Response {
    let viewer = match who(&app, &headers) {
        Ok(v) => v,
        Err(r) => return refused(r, true),
    };
    let now = Utc::now();
    let unresolved = LetterFilter::default();
    // The counts at the top come from the groups themselves: the store's
    // statistics would scan every letter again (measured at 100 000: 270 ms
    // on top of the groups' 94 ms).
    let (groups, mutes) = match tokio::try_join!(
        app.store.dead_letter_groups(&unresolved, GROUPS),
        app.store.group_mutes(),
    ) {
        Ok(found) => found,
        Err(e) => return store_failed(e),
    };
    let total: u64 = groups.iter().map(|g| g.count).sum();
    // Past the page's groups there may be more letters than counted.
    let more = if groups.len() as u32 == GROUPS {
        "+"
    } else {
        ""
    };
    let unresolved = format!("{total}{more}");
    let oldest = groups.iter().map(|g| g.first_seen).min();
    let rows: Vec<GroupRow> = groups
        .into_iter()
        .map(|g| {
            let muted = mutes
                .iter()
                .find(|m| m.group_key == g.group_key && m.holds(g.count, now))
                .map(|m| match m.until {
                    Some(until) => format!("muted until {}", time(until)),
                    None => "muted".to_owned(),
                })
                .unwrap_or_default();
            GroupRow {
                count: g.count,
                first_seen: time(g.first_seen),
                last_seen: time(g.last_seen),
                age: age(g.first_seen, now),
                event_type: g.event_type,
                reason: g.reason,
                sample_error: g.sample_error,
                muted,
                key: g.group_key,
            }
        })
        .collect();
    // The worst first: groups muted for now go after those that are not.
    let (mut loud, quiet): (Vec<GroupRow>, Vec<GroupRow>) =
        rows.into_iter().partition(|r| r.muted.is_empty());
    let hidden = quiet.len();
    loud.extend(quiet);
    render(&GroupsPage {
        viewer,
        unresolved,
        oldest: oldest.map(|t| age(t, now)).unwrap_or_else(|| "-".into()),
        groups: loud,
        hidden,
    })
}

/// A search as the form sends it: every field optional, empty means unset.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Search {
    #[serde(default)]
    state: String,
    #[serde(default)]
    event_type: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    group: String,
    #[serde(default)]
    since: String,
    #[serde(default)]
    until: String,
    #[serde(default)]
    message_id: String,
    #[serde(default)]
    correlation_id: String,
    #[serde(default)]
    field: String,
    #[serde(default)]
    value: String,
    #[serde(default)]
    after: String,
}

fn set(s: &str) -> Option<String> {
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_owned())
}

/// A time from the search form: RFC 3339, a `datetime-local` value or a
/// date, read as UTC.
pub(crate) fn parse_time(s: &str) -> Result<Option<DateTime<Utc>>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(None);
    }
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(Some(t.with_timezone(&Utc)));
    }
    for format in ["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M"] {
        if let Ok(t) = NaiveDateTime::parse_from_str(s, format) {
            return Ok(Some(t.and_utc()));
        }
    }
    if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        return Ok(d.and_hms_opt(0, 0, 0).map(|t| t.and_utc()));
    }
    Err(format!(
        "{s:?} is not a time: use 2026-12-02, 2026-12-02T17:30 or RFC 3339 (UTC)"
    ))
}

impl Search {
    fn filter(&self) -> Result<LetterFilter, String> {
        let state = match self.state.trim() {
            "" => LetterState::Unresolved,
            name => LetterState::from_name(name).ok_or_else(|| {
                format!("{name:?} is not a state: unresolved, replayed or resolved")
            })?,
        };
        let payload_field = match (set(&self.field), set(&self.value)) {
            (Some(f), Some(v)) => Some((f, v)),
            (None, None) => None,
            _ => return Err("a payload search needs both a field and a value".into()),
        };
        Ok(LetterFilter {
            state,
            event_type: set(&self.event_type),
            reason: set(&self.reason),
            group: set(&self.group),
            since: parse_time(&self.since)?,
            until: parse_time(&self.until)?,
            message_id: set(&self.message_id),
            correlation_id: set(&self.correlation_id),
            payload_field,
            ..LetterFilter::default()
        })
    }

    fn after(&self) -> Result<Option<PageAfter>, String> {
        let Some(after) = set(&self.after) else {
            return Ok(None);
        };
        let bad = || "the page link is damaged: start the search again".to_owned();
        let (t, letter) = after.split_once(',').ok_or_else(bad)?;
        let last_failure = DateTime::parse_from_rfc3339(t)
            .map_err(|_| bad())?
            .with_timezone(&Utc);
        Ok(Some(PageAfter {
            last_failure,
            letter_id: letter.to_owned(),
        }))
    }

    /// The query string of the same search, from `after` on.
    fn query(&self, after: &str) -> String {
        let pairs = [
            ("state", &self.state),
            ("event_type", &self.event_type),
            ("reason", &self.reason),
            ("group", &self.group),
            ("since", &self.since),
            ("until", &self.until),
            ("message_id", &self.message_id),
            ("correlation_id", &self.correlation_id),
            ("field", &self.field),
            ("value", &self.value),
        ];
        let mut query: Vec<String> = pairs
            .iter()
            .filter(|(_, v)| !v.trim().is_empty())
            .map(|(k, v)| format!("{k}={}", encode(v)))
            .collect();
        query.push(format!("after={}", encode(after)));
        query.join("&")
    }
}

/// Percent-encodes a query value.
pub(crate) fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char);
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// One row of a search's results.
pub(crate) struct LetterRow {
    pub(crate) id: String,
    pub(crate) message_id: String,
    pub(crate) event_type: String,
    pub(crate) reason: String,
    pub(crate) error: String,
    pub(crate) attempts: u32,
    pub(crate) last_failure: String,
    pub(crate) age: String,
    pub(crate) state: &'static str,
}

#[derive(Template)]
#[template(path = "letters.html")]
struct LettersPage {
    viewer: Viewer,
    search: SearchForm,
    letters: Vec<LetterRow>,
    error: String,
    next: String,
}

/// The search form's values, to show them again.
pub(crate) struct SearchForm {
    pub(crate) state: String,
    pub(crate) event_type: String,
    pub(crate) reason: String,
    pub(crate) group: String,
    pub(crate) since: String,
    pub(crate) until: String,
    pub(crate) message_id: String,
    pub(crate) correlation_id: String,
    pub(crate) field: String,
    pub(crate) value: String,
}

/// Search, a page at a time, newest failure first.
pub(crate) async fn letters<S: ConsoleStore>(
    State(app): State<Shared<S>>,
    headers: HeaderMap,
    Query(search): Query<Search>,
) -> Response {
    let viewer = match who(&app, &headers) {
        Ok(v) => v,
        Err(r) => return refused(r, true),
    };
    let now = Utc::now();
    let mut page = LettersPage {
        viewer,
        search: SearchForm {
            state: search.state.clone(),
            event_type: search.event_type.clone(),
            reason: search.reason.clone(),
            group: search.group.clone(),
            since: search.since.clone(),
            until: search.until.clone(),
            message_id: search.message_id.clone(),
            correlation_id: search.correlation_id.clone(),
            field: search.field.clone(),
            value: search.value.clone(),
        },
        letters: Vec::new(),
        error: String::new(),
        next: String::new(),
    };
    let (filter, after) = match (search.filter(), search.after()) {
        (Ok(f), Ok(a)) => (f, a),
        (Err(e), _) | (_, Err(e)) => {
            page.error = e;
            let mut r = render(&page);
            *r.status_mut() = StatusCode::BAD_REQUEST;
            return r;
        }
    };
    let found = match app.store.dead_letters(&filter, after.as_ref(), PAGE).await {
        Ok(found) => found,
        Err(e) => return store_failed(e),
    };
    if found.len() as u32 == PAGE
        && let Some(last) = found.last()
    {
        page.next = format!(
            "/letters?{}",
            search.query(&format!(
                "{},{}",
                last.last_failure.to_rfc3339(),
                last.letter_id
            ))
        );
    }
    page.letters = found
        .into_iter()
        .map(|l| LetterRow {
            age: age(l.last_failure, now),
            last_failure: time(l.last_failure),
            id: l.letter_id,
            message_id: l.message_id,
            event_type: l.event_type,
            reason: l.reason,
            error: l.error,
            attempts: l.attempts,
            state: l.state.as_str(),
        })
        .collect();
    render(&page)
}

/// One replay of a letter, with what its copy did.
pub(crate) struct ReplayRow {
    pub(crate) replay_id: String,
    pub(crate) run_id: String,
    pub(crate) by: String,
    pub(crate) at: String,
    pub(crate) edited: bool,
    pub(crate) published: String,
    pub(crate) outcome: String,
}

#[derive(Template)]
#[template(path = "letter.html")]
struct LetterPage {
    viewer: Viewer,
    letter: warren::store::StoredDeadLetter,
    state: &'static str,
    first_failure: String,
    last_failure: String,
    headers: Vec<(String, String)>,
    payload: String,
    masked: bool,
    revealed: bool,
    edit: Option<(String, String, String)>,
    replays: Vec<ReplayRow>,
    history: Vec<HistoryRow>,
}

/// Outcomes of one message shown on its letter's page, at most.
const HISTORY: u32 = 100;

/// One journaled outcome of a letter's message.
pub(crate) struct HistoryRow {
    pub(crate) at: String,
    pub(crate) outcome: String,
    pub(crate) detail: String,
    pub(crate) replay_id: String,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct Reveal {
    #[serde(default)]
    reveal: String,
}

/// One letter whole: headers decoded, payload pretty-printed (masked fields
/// hidden unless revealed, which is audited), its failure, its edit, its
/// replays and their journaled outcomes.
pub(crate) async fn letter<S: ConsoleStore>(
    State(app): State<Shared<S>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(reveal): Query<Reveal>,
) -> Response {
    let viewer = match who(&app, &headers) {
        Ok(v) => v,
        Err(r) => return refused(r, true),
    };
    let record = match app.store.dead_letter(&id).await {
        Ok(Some(r)) => r,
        Ok(None) => return failure(StatusCode::NOT_FOUND, "no dead letter with this id"),
        Err(e) => return store_failed(e),
    };
    let revealed = reveal.reveal == "1" && !app.config.masked_fields.is_empty();
    if revealed {
        // Seeing masked data is an act of its own: it needs a name, and the
        // audit table keeps it.
        let Some(operator) = &viewer.operator else {
            return failure(
                StatusCode::FORBIDDEN,
                "masked fields are shown only to a named operator: log in with a token",
            );
        };
        if let Err(e) = app
            .store
            .audit(
                &Actor::new(operator.as_str()),
                "view-masked",
                &format!("letter={id}"),
                &app.config.masked_fields.join(","),
                false,
            )
            .await
        {
            return store_failed(e);
        }
    }
    let replays = match app.store.letter_replays(&id).await {
        Ok(r) => r,
        Err(e) => return store_failed(e),
    };
    let mut rows = Vec::with_capacity(replays.len());
    for r in replays {
        let journal = match app.store.journal_of_replay(&r.replay_id).await {
            Ok(j) => j,
            Err(e) => return store_failed(e),
        };
        let outcome = journal
            .iter()
            .map(|e| match e.detail.as_str() {
                "" => e.outcome.clone(),
                d => format!("{} ({d})", e.outcome),
            })
            .collect::<Vec<_>>()
            .join(", ");
        rows.push(ReplayRow {
            by: r.requested_by,
            at: time(r.created_at),
            edited: r.edited,
            published: r.published_at.map(time).unwrap_or_else(|| "not yet".into()),
            outcome: if outcome.is_empty() {
                "none journaled yet".into()
            } else {
                outcome
            },
            replay_id: r.replay_id,
            run_id: r.run_id,
        });
    }
    // The failure history: every outcome the journal kept for this message
    // at this consumer (retries, dead letters, replays and their outcomes).
    let history = match app
        .store
        .journal_of_message(&record.letter.consumer, &record.letter.message_id, HISTORY)
        .await
    {
        Ok(entries) => entries
            .into_iter()
            .map(|e| HistoryRow {
                at: time(e.at),
                outcome: e.outcome,
                detail: e.detail,
                replay_id: e.replay_id,
            })
            .collect(),
        Err(e) => return store_failed(e),
    };
    let (shown, masked) = payload(record.body_to_send(), &app.config.masked_fields, revealed);
    let l = record.letter;
    render(&LetterPage {
        viewer,
        state: l.state.as_str(),
        first_failure: time(l.first_failure),
        last_failure: time(l.last_failure),
        headers: headers_of(&record.headers),
        payload: shown,
        masked,
        revealed,
        edit: record
            .edit
            .as_ref()
            .map(|e| (e.by.clone(), e.reason.clone(), time(e.at))),
        replays: rows,
        history,
        letter: l,
    })
}

fn headers_of(json: &str) -> Vec<(String, String)> {
    headers(json)
}

#[derive(Template)]
#[template(path = "run.html")]
struct RunPage {
    viewer: Viewer,
    run: warren::store::ReplayRun,
    started_at: String,
}

/// A replay run's progress, read from the database: it survives a reload,
/// and a restart of the console.
pub(crate) async fn run<S: ConsoleStore>(
    State(app): State<Shared<S>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let viewer = match who(&app, &headers) {
        Ok(v) => v,
        Err(r) => return refused(r, true),
    };
    match app.store.replay_run(&id).await {
        Ok(Some(run)) => render(&RunPage {
            viewer,
            started_at: time(run.started_at),
            run,
        }),
        Ok(None) => failure(StatusCode::NOT_FOUND, "no replay run with this id"),
        Err(e) => store_failed(e),
    }
}

/// The same progress as JSON, for the page's script.
pub(crate) async fn run_progress<S: ConsoleStore>(
    State(app): State<Shared<S>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(r) = viewer(&app.config, &app.sessions, &headers) {
        return refused(r, false);
    }
    match app.store.replay_run(&id).await {
        Ok(Some(run)) => Json(serde_json::json!({
            "total": run.total,
            "published": run.published,
            "state": run.state,
            "stopReason": run.stop_reason,
        }))
        .into_response(),
        Ok(None) => failure(StatusCode::NOT_FOUND, "no replay run with this id"),
        Err(e) => store_failed(e),
    }
}

#[derive(Template)]
#[template(path = "audit.html")]
struct AuditPage {
    viewer: Viewer,
    entries: Vec<warren::store::AuditEntry>,
}

/// The newest lines of the audit table.
pub(crate) async fn audit<S: ConsoleStore>(
    State(app): State<Shared<S>>,
    headers: HeaderMap,
) -> Response {
    let viewer = match who(&app, &headers) {
        Ok(v) => v,
        Err(r) => return refused(r, true),
    };
    match app.store.audit_log(200).await {
        Ok(entries) => render(&AuditPage { viewer, entries }),
        Err(e) => store_failed(e),
    }
}

#[derive(Template)]
#[template(path = "login.html")]
pub(crate) struct LoginPage {
    pub(crate) error: String,
}

/// The login form: an operator pastes their token.
pub(crate) async fn login_form() -> Response {
    render(&LoginPage {
        error: String::new(),
    })
}
