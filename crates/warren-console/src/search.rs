//! Search: the form's filters, read and checked, and a page of letters.

use askama::Template;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use chrono::Utc;
use serde::{Deserialize, Serialize};
use warren::store::{LetterFilter, LetterState, PageAfter};
use warren_admin::input::{self, InputError};
use warren_admin::printable;

use crate::auth::Viewer;
use crate::server::{ConsoleStore, Failed, Page, Shared, render};
use crate::view::{age, time};

/// Letters on one page of a search.
const PAGE: u32 = 50;

/// A search as the form sends it, and as the next page's link repeats it:
/// every field optional, empty means unset.
#[derive(Debug, Default, Clone, Deserialize, Serialize)]
#[serde(default)]
pub(crate) struct Search {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) state: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) event_type: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) reason: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) group: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) since: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) until: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) message_id: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) correlation_id: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) field: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) value: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) after: String,
}

fn set(s: &str) -> Option<&str> {
    let s = s.trim();
    (!s.is_empty()).then_some(s)
}

/// `check` on the field named `name`, if it is set.
fn checked<T>(
    name: &str,
    raw: &str,
    check: fn(&str, &str) -> Result<T, InputError>,
) -> Result<Option<T>, InputError> {
    set(raw).map(|v| check(name, v)).transpose()
}

impl Search {
    /// The filter the form asks for, each field checked by its rule.
    fn filter(&self) -> Result<LetterFilter, String> {
        let state = match self.state.trim() {
            "" => LetterState::Unresolved,
            name => LetterState::from_name(name).ok_or_else(|| {
                format!(
                    "state: {} is not a state: unresolved, replayed or resolved",
                    printable(name)
                )
            })?,
        };
        let checked_filter = || -> Result<LetterFilter, InputError> {
            let payload_field = match (set(&self.field), set(&self.value)) {
                (Some(f), Some(v)) => Some((
                    input::field_path("field", f)?,
                    input::field_value("value", v)?,
                )),
                _ => None,
            };
            Ok(LetterFilter {
                state,
                event_type: checked("event_type", &self.event_type, input::text)?,
                reason: checked("reason", &self.reason, input::reason)?,
                group: checked("group", &self.group, input::group)?,
                since: checked("since", &self.since, input::time)?,
                until: checked("until", &self.until, input::time)?,
                message_id: checked("message_id", &self.message_id, input::message_id)?,
                correlation_id: checked("correlation_id", &self.correlation_id, input::text)?,
                payload_field,
                ..LetterFilter::default()
            })
        };
        if set(&self.field).is_some() != set(&self.value).is_some() {
            return Err("a payload search needs both a field and a value".into());
        }
        checked_filter().map_err(|e| e.to_string())
    }

    fn after(&self) -> Result<Option<PageAfter>, String> {
        checked("after", &self.after, input::cursor).map_err(|e| e.to_string())
    }

    /// The link to the same search, from `after` on.
    fn link_after(&self, after: &PageAfter) -> String {
        let next = Self {
            after: after.cursor(),
            ..self.clone()
        };
        format!(
            "/letters?{}",
            serde_urlencoded::to_string(&next).unwrap_or_default()
        )
    }
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
    search: Search,
    letters: Vec<LetterRow>,
    error: String,
    next: String,
}

/// Search, a page at a time, newest failure first.
pub(crate) async fn letters<S: ConsoleStore>(
    State(app): State<Shared<S>>,
    Page(viewer): Page,
    Query(search): Query<Search>,
) -> Result<Response, Failed> {
    let (filter, after) = match (search.filter(), search.after()) {
        (Ok(f), Ok(a)) => (f, a),
        (Err(error), _) | (_, Err(error)) => {
            let mut r = render(&LettersPage {
                viewer,
                search,
                letters: Vec::new(),
                error,
                next: String::new(),
            });
            *r.status_mut() = StatusCode::BAD_REQUEST;
            return Ok(r);
        }
    };
    let found = app
        .store
        .dead_letters(&filter, after.as_ref(), PAGE)
        .await?;
    let next = match found.last() {
        Some(last) if found.len() as u32 == PAGE => search.link_after(&PageAfter::after(last)),
        _ => String::new(),
    };
    let now = Utc::now();
    let letters = found
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
    Ok(render(&LettersPage {
        viewer,
        search,
        letters,
        error: String::new(),
        next,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_page_link_repeats_the_search_and_reads_back() {
        let search = Search {
            group: "a b&c".into(),
            field: "customerId".into(),
            value: "cus_1".into(),
            ..Search::default()
        };
        let after = PageAfter {
            last_failure: Utc::now(),
            letter_id: "0123456789abcdef0123456789abcdef".into(),
        };
        let link = search.link_after(&after);
        let query = link.strip_prefix("/letters?").unwrap();
        let back: Search = serde_urlencoded::from_str(query).unwrap();
        assert_eq!(back.group, "a b&c");
        assert_eq!(back.value, "cus_1");
        assert_eq!(
            back.after().unwrap().unwrap().letter_id,
            "0123456789abcdef0123456789abcdef"
        );
        assert!(!query.contains("state="), "unset fields stay out: {query}");
    }

    #[test]
    fn each_field_is_checked_by_its_rule_and_named() {
        let search = |f: fn(&mut Search)| {
            let mut s = Search::default();
            f(&mut s);
            s.filter()
        };
        assert!(search(|s| s.since = "2026-12-02T17:30".into()).is_ok());
        assert!(search(|s| s.since = " ".into()).unwrap().since.is_none());
        let refused = search(|s| s.since = "+10000-01-01".into()).unwrap_err();
        assert!(refused.starts_with("since: "), "{refused}");
        let refused = search(|s| s.group = "é".into()).unwrap_err();
        assert!(refused.starts_with("group: "), "{refused}");
        let refused = search(|s| s.message_id = "a\0b".into()).unwrap_err();
        assert!(refused.starts_with("message_id: "), "{refused}");
        let refused = search(|s| {
            s.field = "amount".into();
            s.value = "1e-20000".into();
        })
        .unwrap_err();
        assert!(refused.starts_with("value: "), "{refused}");
    }
}
