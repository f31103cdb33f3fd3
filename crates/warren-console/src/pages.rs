//! The pages: groups, one letter, a replay run, the audit log, the login
//! form. (Search is in `search`.)

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use serde::Deserialize;
use warren::store::{Actor, JournalEntry, LetterFilter};
use warren_admin::input;
use warren_admin::replays_with_outcomes;

use crate::auth::{Viewer, viewer};
use crate::server::{ConsoleStore, Failed, Page, Shared, refused, render};
use crate::view::{age, payload, time};

/// Groups on the groups page.
const GROUPS: u32 = 200;
/// Outcomes of one message shown on its letter's page, at most.
const HISTORY: u32 = 100;
/// Lines on the audit page.
const AUDIT_LINES: u32 = 200;

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
    Page(viewer): Page,
) -> Result<Response, Failed> {
    let now = Utc::now();
    let unresolved = LetterFilter::default();
    // The counts at the top come from the groups themselves: the store's
    // statistics would scan every letter again (measured at 100 000: 270 ms
    // on top of the groups' 94 ms).
    let (groups, mutes) = tokio::try_join!(
        app.store.dead_letter_groups(&unresolved, GROUPS),
        app.store.group_mutes(),
    )?;
    let total: u64 = groups.iter().map(|g| g.count).sum();
    // Past the page's groups there may be more letters than counted.
    let more = if groups.len() as u32 == GROUPS {
        "+"
    } else {
        ""
    };
    let oldest = groups.iter().map(|g| g.first_seen).min();
    let rows = groups.into_iter().map(|g| {
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
    });
    // The worst first: groups muted for now go after those that are not.
    let (mut loud, quiet): (Vec<GroupRow>, Vec<GroupRow>) = rows.partition(|r| r.muted.is_empty());
    let hidden = quiet.len();
    loud.extend(quiet);
    Ok(render(&GroupsPage {
        viewer,
        unresolved: format!("{total}{more}"),
        oldest: oldest.map(|t| age(t, now)).unwrap_or_else(|| "-".into()),
        groups: loud,
        hidden,
    }))
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

/// One journaled outcome of a letter's message.
pub(crate) struct HistoryRow {
    pub(crate) at: String,
    pub(crate) outcome: String,
    pub(crate) detail: String,
    pub(crate) replay_id: String,
}

#[derive(Template)]
#[template(path = "letter.html")]
struct LetterPage {
    viewer: Viewer,
    letter: warren::store::StoredDeadLetter,
    /// The format its consumer read it in; empty if it was refused before
    /// a format read it.
    format: String,
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

#[derive(Debug, Default, Deserialize)]
pub(crate) struct Reveal {
    #[serde(default)]
    reveal: String,
}

/// One letter whole: headers decoded, payload pretty-printed (masked fields
/// hidden unless revealed, which is audited), its failure, its edit, its
/// history, its replays and their journaled outcomes.
pub(crate) async fn letter<S: ConsoleStore>(
    State(app): State<Shared<S>>,
    Page(viewer): Page,
    Path(id): Path<String>,
    Query(reveal): Query<Reveal>,
) -> Result<Response, Failed> {
    let id = input::hex_id("letter", &id)?;
    let record = app
        .store
        .dead_letter(&id)
        .await?
        .ok_or_else(|| Failed::not_found("dead letter"))?;
    let revealed = reveal.reveal == "1" && !app.config.masked_fields.is_empty();
    if revealed {
        // Seeing masked data is an act of its own: it needs a name, and the
        // audit table keeps it.
        let operator = viewer.operator.as_deref().ok_or_else(|| {
            Failed::Status(
                StatusCode::FORBIDDEN,
                "masked fields are shown only to a named operator: log in with a token".into(),
            )
        })?;
        app.store
            .audit(
                &Actor::new(operator),
                "view-masked",
                &format!("letter={id}"),
                &app.config.masked_fields.join(","),
                false,
            )
            .await?;
    }
    let replays = replays_with_outcomes(&app.store, &id)
        .await?
        .into_iter()
        .map(|(r, journal)| {
            let outcome = journal
                .iter()
                .map(JournalEntry::described)
                .collect::<Vec<_>>()
                .join(", ");
            ReplayRow {
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
            }
        })
        .collect();
    // The failure history: every outcome the journal kept for this message
    // at this consumer (retries, dead letters, replays and their outcomes).
    let history = app
        .store
        .journal_of_message(&record.letter.consumer, &record.letter.message_id, HISTORY)
        .await?
        .into_iter()
        .map(|e| HistoryRow {
            at: time(e.at),
            outcome: e.outcome,
            detail: e.detail,
            replay_id: e.replay_id,
        })
        .collect();
    let (shown, masked) = payload(record.body_to_send(), &app.config.masked_fields, revealed);
    let headers = record.header_texts();
    let format = headers
        .iter()
        .find(|(name, _)| name == warren::headers::HEADER_FORMAT)
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let edit = record
        .edit
        .as_ref()
        .map(|e| (e.by.clone(), e.reason.clone(), time(e.at)));
    let l = record.letter;
    Ok(render(&LetterPage {
        viewer,
        state: l.state.as_str(),
        first_failure: time(l.first_failure),
        last_failure: time(l.last_failure),
        headers,
        format,
        payload: shown,
        masked,
        revealed,
        edit,
        replays,
        history,
        letter: l,
    }))
}

#[derive(Template)]
#[template(path = "run.html")]
struct RunPage {
    viewer: Viewer,
    run: warren::store::ReplayRun,
    started_at: String,
    /// This console is publishing it now.
    here: bool,
}

/// A replay run's progress, read from the database: it survives a reload,
/// and a restart of the console.
pub(crate) async fn run<S: ConsoleStore>(
    State(app): State<Shared<S>>,
    Page(viewer): Page,
    Path(id): Path<String>,
) -> Result<Response, Failed> {
    let id = input::hex_id("run", &id)?;
    let run = app
        .store
        .replay_run(&id)
        .await?
        .ok_or_else(|| Failed::not_found("replay run"))?;
    Ok(render(&RunPage {
        viewer,
        started_at: time(run.started_at),
        here: app.publishes(&run.run_id),
        run,
    }))
}

/// The same progress as JSON, for the page's script: refused outright,
/// not sent to the login form, without a login.
pub(crate) async fn run_progress<S: ConsoleStore>(
    State(app): State<Shared<S>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, Failed> {
    if let Err(r) = viewer(&app.config, &app.sessions, &headers) {
        return Ok(refused(r, false));
    }
    let id = input::hex_id("run", &id)?;
    let run = app
        .store
        .replay_run(&id)
        .await?
        .ok_or_else(|| Failed::not_found("replay run"))?;
    // The stop reason can quote a handler's error.
    let progress = serde_json::json!({
        "total": run.total,
        "published": run.published,
        "state": run.state,
        "stopReason": run.stop_reason,
    });
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        warren_admin::printable_json(&progress),
    )
        .into_response())
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
    Page(viewer): Page,
) -> Result<Response, Failed> {
    let entries = app.store.audit_log(AUDIT_LINES).await?;
    Ok(render(&AuditPage { viewer, entries }))
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
