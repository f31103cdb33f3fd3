//! The HTTP server: routes, the headers every response carries, and the
//! answers to refused requests.

use std::future::Future;
use std::sync::Arc;

use askama::Template;
use axum::Router;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use warren::store::{DeadLetterStore, Journal, SigningKey, StoreError};

use crate::ConsoleConfig;
use crate::auth::{Refusal, Sessions, Viewer, viewer};
use crate::tls::{ServerTls, TlsListener};
use crate::{actions, pages, search};

/// What the console needs of a store: the dead letters, the journal of
/// replayed copies, and the signing key replays sign with.
pub trait ConsoleStore:
    DeadLetterStore + Journal + SigningKey + Clone + Send + Sync + 'static
{
}
impl<S> ConsoleStore for S where
    S: DeadLetterStore + Journal + SigningKey + Clone + Send + Sync + 'static
{
}

/// Everything a request handler reaches.
pub(crate) struct App<S> {
    pub(crate) store: S,
    pub(crate) config: ConsoleConfig,
    pub(crate) sessions: Sessions,
    /// The replay runs this process is publishing now. A run the store says
    /// is running but that is not here was left by another process: the CLI,
    /// another console, or one that died mid-run.
    pub(crate) publishing: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl<S> App<S> {
    fn publishing(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.publishing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether this process is publishing `run_id` now.
    pub(crate) fn publishes(&self, run_id: &str) -> bool {
        self.publishing().contains(run_id)
    }

    /// Marks `run_id` as published by this process; false if it already was.
    pub(crate) fn take_run(&self, run_id: &str) -> bool {
        self.publishing().insert(run_id.to_owned())
    }

    /// This process no longer publishes `run_id`.
    pub(crate) fn release_run(&self, run_id: &str) {
        self.publishing().remove(run_id);
    }
}

pub(crate) type Shared<S> = Arc<App<S>>;

/// The console's script and styles, served from the binary: no third-party
/// code, no build step.
const SCRIPT: &str = include_str!("../assets/console.js");
const STYLE: &str = include_str!("../assets/console.css");

/// Only the console's own script and styles; no inline script, no frames,
/// forms post only to the console itself.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// A console bound to its address, not yet serving.
pub struct Console {
    listener: tokio::net::TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    config: ConsoleConfig,
}

impl Console {
    /// Checks the configuration (failing at once, saying what to fix, if it
    /// is not safe to serve) and binds its address.
    pub async fn bind(config: ConsoleConfig) -> Result<Self, String> {
        config.check()?;
        let tls = config.tls.as_ref().map(ServerTls::load).transpose()?;
        let listener = tokio::net::TcpListener::bind(config.bind)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", config.bind))?;
        Ok(Self {
            listener,
            tls,
            config,
        })
    }

    /// The address it listens on (the port chosen, if it was 0).
    pub fn local_addr(&self) -> Result<std::net::SocketAddr, String> {
        self.listener
            .local_addr()
            .map_err(|e| format!("cannot read the console's address: {e}"))
    }

    /// The console's address as a browser takes it: `https://` when it
    /// serves TLS itself.
    pub fn url(&self) -> Result<String, String> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        Ok(format!("{scheme}://{}/", self.local_addr()?))
    }

    /// Serves `store` until `shutdown` completes.
    pub async fn serve<S: ConsoleStore>(
        self,
        store: S,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), String> {
        let app = router(Arc::new(App {
            store,
            config: self.config,
            sessions: Sessions::new(),
            publishing: Default::default(),
        }));
        let served = match self.tls {
            Some(tls) => {
                let listener = TlsListener::new(self.listener, tls)
                    .map_err(|e| format!("cannot read the console's address: {e}"))?;
                axum::serve(listener, app)
                    .with_graceful_shutdown(shutdown)
                    .await
            }
            None => {
                axum::serve(self.listener, app)
                    .with_graceful_shutdown(shutdown)
                    .await
            }
        };
        served.map_err(|e| format!("the console stopped: {e}"))
    }
}

fn router<S: ConsoleStore>(app: Shared<S>) -> Router {
    Router::new()
        .route("/", get(pages::groups::<S>))
        .route("/letters", get(search::letters::<S>))
        .route("/letters/{id}", get(pages::letter::<S>))
        .route("/runs/{id}", get(pages::run::<S>))
        .route("/runs/{id}/progress", get(pages::run_progress::<S>))
        .route("/audit", get(pages::audit::<S>))
        .route("/login", get(pages::login_form).post(actions::login::<S>))
        .route("/logout", post(actions::logout::<S>))
        .route("/act", post(actions::act::<S>))
        .route(
            "/assets/console.js",
            get(|| async { asset(SCRIPT, "text/javascript") }),
        )
        .route(
            "/assets/console.css",
            get(|| async { asset(STYLE, "text/css") }),
        )
        .layer(axum::middleware::map_response(secure_headers))
        .with_state(app)
}

fn asset(body: &'static str, kind: &'static str) -> Response {
    ([(header::CONTENT_TYPE, kind)], body).into_response()
}

/// Headers on every response: the CSP, no sniffing, no framing, no caching
/// of pages that hold payment data, no referrer leaking letter ids to other
/// sites. (`same-origin`, not `no-referrer`: under `no-referrer` Chrome sends
/// `Origin: null` with the console's own forms, which then look forged.)
async fn secure_headers(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// A page rendered, or the error that stopped it. The templates escape
/// HTML; a control or bidirectional character from a message is shown as
/// `\u{..}` too, as the CLI prints it, so that no id can pass for another.
pub(crate) fn render(page: &impl Template) -> Response {
    match page.render() {
        Ok(html) => Html(warren_admin::printable_page(&html).into_owned()).into_response(),
        Err(e) => failure(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("cannot render: {e}"),
        ),
    }
}

/// The viewer of a page, or, for nobody yet, the answer that sends them to
/// the login form.
pub(crate) struct Page(pub(crate) Viewer);

impl<S: ConsoleStore> FromRequestParts<Shared<S>> for Page {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, app: &Shared<S>) -> Result<Self, Response> {
        viewer(&app.config, &app.sessions, &parts.headers)
            .map(Page)
            .map_err(|r| refused(r, true))
    }
}

/// Why a page or an action could not be answered: the database failed, or
/// the request named something that is not there.
#[derive(Debug)]
pub(crate) enum Failed {
    /// The store returned an error.
    Store(String),
    /// An answer other than success, with what to tell the operator.
    Status(StatusCode, String),
}

impl Failed {
    pub(crate) fn not_found(what: &str) -> Self {
        Self::Status(StatusCode::NOT_FOUND, format!("no {what} with this id"))
    }
}

/// A value that breaks its input rule: 400, naming the parameter and the
/// rule.
impl From<warren_admin::input::InputError> for Failed {
    fn from(e: warren_admin::input::InputError) -> Self {
        Self::Status(StatusCode::BAD_REQUEST, e.to_string())
    }
}

impl From<StoreError> for Failed {
    fn from(e: StoreError) -> Self {
        Self::Store(e.to_string())
    }
}

impl IntoResponse for Failed {
    fn into_response(self) -> Response {
        match self {
            Self::Store(e) => failure(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("the database: {e}"),
            ),
            Self::Status(status, text) => failure(status, &text),
        }
    }
}

/// A plain page saying what went wrong.
#[derive(Template)]
#[template(path = "message.html")]
struct Message<'a> {
    title: &'a str,
    text: &'a str,
}

pub(crate) fn failure(status: StatusCode, text: &str) -> Response {
    let title = status.canonical_reason().unwrap_or("Error");
    let mut response = render(&Message { title, text });
    *response.status_mut() = status;
    response
}

/// The answer to a refused request: a page asks to log in, an action is
/// refused outright.
pub(crate) fn refused(refusal: Refusal, page: bool) -> Response {
    match (refusal, page) {
        (Refusal::Unauthenticated, true) => Redirect::to("/login").into_response(),
        (Refusal::Unauthenticated, false) => failure(
            StatusCode::UNAUTHORIZED,
            "log in first: this console needs an operator's token",
        ),
        (Refusal::Forged, _) => failure(
            StatusCode::FORBIDDEN,
            "refused: the form did not come from this console's own page (another origin, or \
             no valid CSRF token). Reload the page and try again.",
        ),
    }
}
