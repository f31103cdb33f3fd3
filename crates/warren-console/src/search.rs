//! Search: the form's filters, read and checked, and a page of letters.

use askama::Template;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};
use serde::{Deserialize, Serialize};
use warren::store::{LetterFilter, LetterState, PageAfter};

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

fn set(s: &str) -> Option<String> {
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_owned())
}

/// A time from the search form: RFC 3339, a `datetime-local` value or a
/// date, read as UTC.
fn parse_time(s: &str) -> Result<Option<DateTime<Utc>>, String> {
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
        set(&self.after)
            .map(|cursor| {
                PageAfter::from_cursor(&cursor)
                    .ok_or_else(|| "the page link is damaged: start the search again".to_owned())
            })
            .transpose()
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
            letter_id: "L1".into(),
        };
        let link = search.link_after(&after);
        let query = link.strip_prefix("/letters?").unwrap();
        let back: Search = serde_urlencoded::from_str(query).unwrap();
        assert_eq!(back.group, "a b&c");
        assert_eq!(back.value, "cus_1");
        assert_eq!(back.after().unwrap().unwrap().letter_id, "L1");
        assert!(!query.contains("state="), "unset fields stay out: {query}");
    }

    #[test]
    fn times_read_as_the_form_sends_them() {
        assert!(parse_time("2026-12-02").unwrap().is_some());
        assert!(parse_time("2026-12-02T17:30").unwrap().is_some());
        assert!(parse_time("2026-12-02T17:30:00Z").unwrap().is_some());
        assert_eq!(parse_time(" ").unwrap(), None);
        assert!(parse_time("yesterday").unwrap_err().contains("not a time"));
    }
}
