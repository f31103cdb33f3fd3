//! The actions: each a POST from the console's own page, carrying its CSRF
//! token, confirmed on a page of its own, run through the same store calls
//! as the CLI and audited under the operator's name.

use std::sync::Arc;

use askama::Template;
use axum::Form;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use chrono::Utc;
use serde::Deserialize;
use warren::broker::close_connection;
use warren::lapin::Connection;
use warren::store::{Actor, DeadLetterRecord, LetterFilter, LetterState};
use warren_admin::input::{self, InputError};
use warren_admin::{
    DEFAULT_OUTCOME_TIMEOUT, Replayer, edit_letter, printable, purge_letters, set_payload_fields,
};

use crate::auth::{SESSION_COOKIE, SESSION_LIFETIME, Viewer, check_login, cookie, posted};
use crate::pages::LoginPage;
use crate::server::{ConsoleStore, Failed, Shared, failure, refused, render};
use crate::view::encode;

#[derive(Debug, Default, Deserialize)]
pub(crate) struct LoginForm {
    #[serde(default)]
    token: String,
}

/// Logs an operator in with their token: a session cookie, `HttpOnly` and
/// `SameSite=Strict`, so another site's form never carries it.
pub(crate) async fn login<S: ConsoleStore>(
    State(app): State<Shared<S>>,
    headers: HeaderMap,
    Form(form): Form<LoginForm>,
) -> Response {
    if let Err(r) = check_login(&app.config, &headers) {
        return refused(r, false);
    }
    let Some(tokens) = &app.config.tokens else {
        return failure(
            StatusCode::NOT_FOUND,
            "this console takes no tokens: it is open on loopback, or its proxy names the operator",
        );
    };
    let Some(operator) = tokens.operator(form.token.trim()) else {
        let mut r = render(&LoginPage {
            error: "no operator has this token".into(),
        });
        *r.status_mut() = StatusCode::UNAUTHORIZED;
        return r;
    };
    tracing::info!(operator = %operator, "operator logged in to the console");
    let id = app.sessions.start(operator);
    let secure = if app.config.over_tls() {
        "; Secure"
    } else {
        ""
    };
    let cookie = format!(
        "{SESSION_COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{secure}",
        SESSION_LIFETIME.as_secs()
    );
    let mut r = Redirect::to("/").into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct LogoutForm {
    #[serde(default)]
    csrf: String,
}

pub(crate) async fn logout<S: ConsoleStore>(
    State(app): State<Shared<S>>,
    headers: HeaderMap,
    Form(form): Form<LogoutForm>,
) -> Response {
    if let Err(r) = posted(&app.config, &app.sessions, &headers, &form.csrf) {
        return refused(r, false);
    }
    if let Some(id) = cookie(&headers, SESSION_COOKIE) {
        app.sessions.end(id);
    }
    let mut r = Redirect::to("/login").into_response();
    r.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static("warren_console=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"),
    );
    r
}

/// An action's form. Which fields count depends on `action`.
#[derive(Debug, Default, Clone, Deserialize)]
pub(crate) struct ActForm {
    #[serde(default)]
    pub(crate) csrf: String,
    #[serde(default)]
    pub(crate) action: String,
    #[serde(default)]
    pub(crate) letter: String,
    #[serde(default)]
    pub(crate) group: String,
    #[serde(default)]
    pub(crate) reason: String,
    #[serde(default)]
    pub(crate) hours: String,
    #[serde(default)]
    pub(crate) new_group: String,
    #[serde(default)]
    pub(crate) days: String,
    #[serde(default)]
    pub(crate) field: String,
    #[serde(default)]
    pub(crate) value: String,
    #[serde(default)]
    pub(crate) run: String,
    #[serde(default)]
    pub(crate) confirmed: String,
}

/// Every field the form sets, by its input rule, before anything is shown
/// or done: a refused form changes nothing.
fn check(form: &ActForm) -> Result<(), InputError> {
    let given = |v: &str| !v.trim().is_empty();
    if given(&form.letter) {
        input::hex_id("letter", &form.letter)?;
    }
    if given(&form.group) {
        input::group("group", &form.group)?;
    }
    if given(&form.new_group) {
        input::group("new_group", form.new_group.trim())?;
    }
    if given(&form.run) {
        input::hex_id("run", &form.run)?;
    }
    if given(&form.field) {
        input::field_path("field", form.field.trim())?;
    }
    input::field_value("value", &form.value)?;
    input::note("reason", form.reason.trim())?;
    Ok(())
}

/// What an action does, in words for its confirmation page.
fn describe(form: &ActForm) -> Result<String, String> {
    let need = |v: &str, what: &str| {
        if v.trim().is_empty() {
            Err(format!("this action needs {what}"))
        } else {
            Ok(())
        }
    };
    Ok(match form.action.as_str() {
        "replay-letter" => {
            need(&form.letter, "a letter")?;
            format!("Replay letter {} to its queue.", form.letter)
        }
        "replay-group" => {
            need(&form.group, "a group")?;
            format!(
                "Replay every unresolved letter of group {} carefully: the first copy must \
                 apply before the rest go, and the run stops at the first copy that fails again.",
                form.group
            )
        }
        "edit-replay" => {
            need(&form.letter, "a letter")?;
            need(&form.field, "the payload field to set")?;
            need(&form.reason, "a reason, for the audit table")?;
            format!(
                "Set payload field {} of letter {} to {} (its original body is kept beside \
                 the edit), then replay it.",
                form.field, form.letter, form.value
            )
        }
        "resolve-letter" => {
            need(&form.letter, "a letter")?;
            format!("Mark letter {} resolved.", form.letter)
        }
        "resolve-group" => {
            need(&form.group, "a group")?;
            format!(
                "Mark every unresolved letter of group {} resolved.",
                form.group
            )
        }
        "mute" => {
            need(&form.group, "a group")?;
            match hours(form)? {
                Some(h) => format!("Mute group {} for {h} hour(s).", form.group),
                None => format!("Mute group {} until it is unmuted.", form.group),
            }
        }
        "unmute" => {
            need(&form.group, "a group")?;
            format!("Unmute group {}.", form.group)
        }
        "reclassify" => {
            need(&form.group, "a group")?;
            need(&form.new_group, "the group to move its letters to")?;
            format!(
                "Move the unresolved letters of group {} into group {}.",
                form.group, form.new_group
            )
        }
        "resume-run" => {
            need(&form.run, "a replay run")?;
            format!(
                "Resume replay run {} from this console: publish its letters not yet published \
                 (carefully, if it was started carefully). If another process is still publishing \
                 it, both publish the same copies, and the consumers' inbox applies each once.",
                form.run
            )
        }
        "purge-resolved" => format!(
            "Delete resolved letters resolved more than {} day(s) ago. This cannot be undone.",
            days(form)?
        ),
        other => return Err(format!("{other:?} is not an action")),
    })
}

fn hours(form: &ActForm) -> Result<Option<u32>, String> {
    match form.hours.trim() {
        "" => Ok(None),
        h => h
            .parse::<u32>()
            .ok()
            .filter(|h| (1..=24 * 366).contains(h))
            .map(Some)
            .ok_or_else(|| format!("{h:?} hours: give a whole number from 1 to 8784")),
    }
}

fn days(form: &ActForm) -> Result<u32, String> {
    form.days
        .trim()
        .parse::<u32>()
        .ok()
        .filter(|d| (1..=3650).contains(d))
        .ok_or_else(|| format!("{:?} days: give a whole number from 1 to 3650", form.days))
}

#[derive(Template)]
#[template(path = "confirm.html")]
struct ConfirmPage {
    viewer: Viewer,
    what: String,
    form: ActForm,
}

#[derive(Template)]
#[template(path = "done.html")]
struct DonePage {
    viewer: Viewer,
    text: String,
    back: String,
}

/// Every action: refused without a login, from another origin or without
/// the page's CSRF token; shown for confirmation first; then run and audited.
pub(crate) async fn act<S: ConsoleStore>(
    State(app): State<Shared<S>>,
    headers: HeaderMap,
    Form(form): Form<ActForm>,
) -> Response {
    let viewer = match posted(&app.config, &app.sessions, &headers, &form.csrf) {
        Ok(v) => v,
        Err(r) => return refused(r, false),
    };
    let Some(operator) = viewer.operator.clone() else {
        return failure(
            StatusCode::FORBIDDEN,
            "actions are audited under an operator's name: start the console with --tokens FILE, \
             or with --operator NAME on loopback",
        );
    };
    if let Err(e) = check(&form) {
        return Failed::from(e).into_response();
    }
    let what = match describe(&form) {
        Ok(w) => w,
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e),
    };
    if form.confirmed != "yes" {
        return render(&ConfirmPage { viewer, what, form });
    }
    let actor = Actor::new(operator);
    match perform(&app, &form, &actor).await {
        Ok(Done::Run(run_id)) => {
            Redirect::to(&format!("/runs/{}", encode(&run_id))).into_response()
        }
        Ok(Done::Said(text, back)) => render(&DonePage { viewer, text, back }),
        Err(failed) => failed.into_response(),
    }
}

/// An action the store or the broker refused, with why.
fn refusal(why: impl std::fmt::Display) -> Failed {
    // The text can quote a handler's error, which can quote a payload.
    Failed::Status(
        StatusCode::CONFLICT,
        printable(&why.to_string()).into_owned(),
    )
}

enum Done {
    /// A replay run started: its page.
    Run(String),
    /// What happened, and where to go next.
    Said(String, String),
}

/// The letter an action names, whole.
async fn record_of<S: ConsoleStore>(
    app: &Shared<S>,
    letter: &str,
) -> Result<DeadLetterRecord, Failed> {
    app.store
        .dead_letter(letter)
        .await?
        .ok_or_else(|| Failed::not_found("dead letter"))
}

async fn perform<S: ConsoleStore>(
    app: &Shared<S>,
    form: &ActForm,
    actor: &Actor,
) -> Result<Done, Failed> {
    let store = &app.store;
    let group = || LetterFilter::of_group(&form.group);
    match form.action.as_str() {
        "replay-letter" => {
            let record = record_of(app, &form.letter).await?;
            replay(app, &LetterFilter::of_letter(&record.letter), false, actor)
                .await
                .map(Done::Run)
        }
        "replay-group" => replay(app, &group(), true, actor).await.map(Done::Run),
        "edit-replay" => {
            let record = record_of(app, &form.letter).await?;
            let body = set_payload_fields(
                &record,
                &[(form.field.trim().to_owned(), form.value.clone())],
            )
            .map_err(refusal)?;
            edit_letter(store, &form.letter, &body, form.reason.trim(), actor)
                .await
                .map_err(refusal)?;
            replay(app, &LetterFilter::of_letter(&record.letter), false, actor)
                .await
                .map(Done::Run)
        }
        "resolve-letter" => {
            let record = record_of(app, &form.letter).await?;
            let n = store
                .resolve_dead_letters(&LetterFilter::of_letter(&record.letter), actor)
                .await?;
            Ok(Done::Said(
                format!("{n} letter(s) resolved."),
                format!("/letters/{}", encode(&form.letter)),
            ))
        }
        "resolve-group" => {
            let n = store.resolve_dead_letters(&group(), actor).await?;
            Ok(Done::Said(format!("{n} letter(s) resolved."), "/".into()))
        }
        "mute" => {
            let until = hours(form)
                .map_err(refusal)?
                .map(|h| Utc::now() + chrono::Duration::hours(i64::from(h)));
            store
                .mute_group(&form.group, until, None, form.reason.trim(), actor)
                .await?;
            Ok(Done::Said("Group muted.".into(), "/".into()))
        }
        "unmute" => {
            let text = if store.unmute_group(&form.group, actor).await? {
                "Group unmuted."
            } else {
                "The group was not muted."
            };
            Ok(Done::Said(text.into(), "/".into()))
        }
        "reclassify" => {
            let into = form.new_group.trim();
            let n = store.reclassify_dead_letters(&group(), into, actor).await?;
            Ok(Done::Said(
                format!("{n} letter(s) moved."),
                format!("/letters?group={}", encode(into)),
            ))
        }
        "resume-run" => resume(app, &form.run, actor).await.map(Done::Run),
        "purge-resolved" => {
            let days = days(form).map_err(refusal)?;
            let before = Utc::now() - chrono::Duration::days(i64::from(days));
            let total = purge_letters(store, LetterState::Resolved, before).await?;
            store
                .audit(
                    actor,
                    "purge",
                    "state=resolved",
                    &format!("older than {days} day(s): {total} deleted"),
                    false,
                )
                .await?;
            Ok(Done::Said(
                format!("{total} resolved letter(s) deleted."),
                "/".into(),
            ))
        }
        other => Err(refusal(format!("{other:?} is not an action"))),
    }
}

/// Starts a replay run of what `filter` takes (carefully, for a group) and
/// publishes it in the background; its page follows the run from the
/// database.
async fn replay<S: ConsoleStore>(
    app: &Shared<S>,
    filter: &LetterFilter,
    careful: bool,
    actor: &Actor,
) -> Result<String, Failed> {
    let connection = connect(app).await?;
    let mut replayer = Replayer::new(app.store.clone(), Arc::clone(&connection), actor.clone());
    if careful {
        replayer = replayer.careful(DEFAULT_OUTCOME_TIMEOUT);
    }
    let run = match replayer
        .start(filter, Some(app.config.inbox_retention), false)
        .await
    {
        Ok(run) => run,
        Err(e) => {
            close_connection(&connection, "done").await;
            return Err(refusal(e));
        }
    };
    publish_in_background(app, replayer, connection, run.run_id.clone());
    Ok(run.run_id)
}

/// Resumes a run this process is not publishing: stopped, or left running
/// by a process that went away. Audited, as the CLI's `--resume` is by the
/// letters' replays.
async fn resume<S: ConsoleStore>(
    app: &Shared<S>,
    run_id: &str,
    actor: &Actor,
) -> Result<String, Failed> {
    let run = app
        .store
        .replay_run(run_id)
        .await?
        .ok_or_else(|| Failed::not_found("replay run"))?;
    if run.state == "finished" {
        return Err(refusal(format!("replay run {run_id} has finished")));
    }
    // Checked and marked in one step, before connecting and auditing, so
    // that a second click (or a second operator) cannot start another
    // publisher of the same run here.
    if !app.take_run(run_id) {
        return Err(refusal(format!(
            "this console is publishing replay run {run_id} already"
        )));
    }
    let started = start_resume(app, &run, actor).await;
    if started.is_err() {
        app.release_run(run_id);
    }
    started
}

/// Audits the resume of `run` and publishes it in the background; the run
/// is already this console's.
async fn start_resume<S: ConsoleStore>(
    app: &Shared<S>,
    run: &warren::store::ReplayRun,
    actor: &Actor,
) -> Result<String, Failed> {
    let run_id = run.run_id.as_str();
    let connection = connect(app).await?;
    app.store
        .audit(
            actor,
            "replay-resume",
            run_id,
            &format!(
                "{} of {} published, {}{}",
                run.published,
                run.total,
                run.state,
                if run.stop_reason.is_empty() {
                    String::new()
                } else {
                    format!(": {}", run.stop_reason)
                }
            ),
            false,
        )
        .await?;
    let replayer = Replayer::new(app.store.clone(), Arc::clone(&connection), actor.clone());
    publish_in_background(app, replayer, connection, run.run_id.clone());
    Ok(run.run_id.clone())
}

/// The broker replays publish to, connected.
async fn connect<S: ConsoleStore>(app: &Shared<S>) -> Result<Arc<Connection>, Failed> {
    let Some(broker) = &app.config.broker else {
        return Err(refusal(
            "this console has no broker to replay to: start it with --amqp-url",
        ));
    };
    warren::broker::connect_with_tls(&broker.amqp_url, "warren console", &broker.tls)
        .await
        .map(Arc::new)
        .map_err(|e| refusal(format!("cannot connect to the broker: {e}")))
}

/// Publishes `run_id` in a task of its own, marked as this process's while
/// it goes.
fn publish_in_background<S: ConsoleStore>(
    app: &Shared<S>,
    replayer: Replayer<S>,
    connection: Arc<Connection>,
    run_id: String,
) {
    app.take_run(&run_id);
    let app = Arc::clone(app);
    tokio::spawn(async move {
        match replayer.resume(&run_id, |_| {}).await {
            Ok(done) => {
                tracing::info!(run = %done.run_id, published = done.published, "replay run finished");
            }
            Err(e) => tracing::warn!(run = %run_id, error = %e, "replay run stopped"),
        }
        close_connection(&connection, "done").await;
        app.release_run(&run_id);
    });
}
