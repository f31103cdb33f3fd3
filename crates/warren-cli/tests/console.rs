//! `warren console` against the real broker and databases, over HTTP: logins
//! with operators' tokens, refusals (no login, another origin, no CSRF
//! token), escaping of hostile letters, masking, confirmation, audit, and a
//! careful replay of a group that applies each message once.

use std::time::Duration;

use warren::Consumer;
use warren::store::{DeadLetterStore, LetterFilter, LetterState};

use crate::console_support::*;
use crate::util::{Backend, Running, TestBroker, routes};

on_all_backends!(the_console_from_login_to_a_careful_replay);

async fn the_console_from_login_to_a_careful_replay<B: Backend>() {
    let db = B::create().await;
    let broker = TestBroker::new().await;
    let Staged {
        failed,
        letters,
        group,
        hostile,
        tokens,
        dir: _dir,
        ..
    } = staged(&db, &broker).await;
    let console = start_console(&db.url, &tokens).await;
    let addr = console.addr.as_str();

    // Nothing without a login: pages send to the login form, actions and
    // the progress feed are refused.
    let a = http(addr, "GET", "/", &[], "").await;
    assert_eq!(
        (a.status, a.headers.get("location").map(String::as_str)),
        (303, Some("/login"))
    );
    let a = http(addr, "GET", "/letters", &[], "").await;
    assert_eq!(a.status, 303);
    let a = http(
        addr,
        "POST",
        "/act",
        &[],
        &form(&[("action", "resolve-group"), ("group", "x")]),
    )
    .await;
    assert_eq!(a.status, 401);
    let a = http(
        addr,
        "POST",
        "/login",
        &[],
        &form(&[("token", "not-a-token-of-anyone")]),
    )
    .await;
    assert_eq!(a.status, 401);

    let alice = login(addr, ALICE).await;
    let auth = [("Cookie", alice.as_str())];
    let groups = http(addr, "GET", "/", &auth, "").await;
    assert_eq!(groups.status, 200);
    let csp = groups
        .headers
        .get("content-security-policy")
        .expect("a CSP");
    assert!(
        csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"),
        "{csp}"
    );
    assert!(
        groups.body.contains("4</span> unresolved"),
        "{}",
        groups.body
    );

    // The hostile letter renders as text, everywhere it shows.
    let store = db.store.clone();
    let list = http(addr, "GET", "/letters", &auth, "").await;
    let page = http(
        addr,
        "GET",
        &format!("/letters/{}", encode(&hostile.letter_id)),
        &auth,
        "",
    )
    .await;
    assert_eq!(page.status, 200);
    for body in [&groups.body, &list.body, &page.body] {
        assert!(
            !body.contains("<script>alert"),
            "a script from a letter ran: {body}"
        );
        assert!(
            !body.contains("<img src=x"),
            "an attribute broke out: {body}"
        );
        assert!(
            !body.contains("href=\"javascript:"),
            "a javascript: link: {body}"
        );
    }
    assert!(
        page.body
            .contains("&#60;script&#62;alert(&#39;payload&#39;)&#60;/script&#62;"),
        "shown as text: {}",
        page.body
    );
    // Not warren's record: it was never read, in any format.
    assert!(
        page.body
            .contains("<dt>Format</dt><dd>not read: refused before a format took it</dd>"),
        "{}",
        page.body
    );
    // Masked until asked for, and the asking is audited.
    assert!(
        !page.body.contains("4111111111111111"),
        "the card number is masked"
    );
    let revealed = http(
        addr,
        "GET",
        &format!("/letters/{}?reveal=1", encode(&hostile.letter_id)),
        &auth,
        "",
    )
    .await;
    assert!(revealed.body.contains("4111111111111111"));
    let audit = store.audit_log(50).await.unwrap();
    assert!(
        audit
            .iter()
            .any(|e| e.action == "view-masked" && e.operator == "alice"),
        "{audit:?}"
    );

    // Actions: refused from another origin and without the page's token;
    // confirmed before they run; audited under the operator's name.
    let csrf = csrf_of(&groups.body);
    let resolve = form(&[
        ("csrf", csrf.as_str()),
        ("action", "resolve-letter"),
        ("letter", hostile.letter_id.as_str()),
        ("confirmed", "yes"),
    ]);
    let evil = [
        ("Cookie", alice.as_str()),
        ("Origin", "http://evil.example"),
    ];
    assert_eq!(
        http(addr, "POST", "/act", &evil, &resolve).await.status,
        403
    );
    let cross = [("Cookie", alice.as_str()), ("Sec-Fetch-Site", "cross-site")];
    assert_eq!(
        http(addr, "POST", "/act", &cross, &resolve).await.status,
        403
    );
    let no_token = resolve.replace(&csrf, "0000");
    assert_eq!(
        http(addr, "POST", "/act", &auth, &no_token).await.status,
        403
    );
    let unconfirmed = resolve.replace("&confirmed=yes", "");
    let confirm = http(addr, "POST", "/act", &auth, &unconfirmed).await;
    assert_eq!(confirm.status, 200);
    assert!(confirm.body.contains("Mark letter"), "{}", confirm.body);
    let state = |id: String| {
        let store = store.clone();
        async move { store.dead_letter(&id).await.unwrap().unwrap().letter.state }
    };
    assert_eq!(
        state(hostile.letter_id.clone()).await,
        LetterState::Unresolved,
        "not before confirmed"
    );
    let done = http(addr, "POST", "/act", &auth, &resolve).await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(
        state(hostile.letter_id.clone()).await,
        LetterState::Resolved
    );

    // The handler is mended: a careful replay of the failed group from the
    // console applies each message once, and the run page follows it.
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<B>(),
    ));
    let bob = login(addr, BOB).await;
    let bob_auth = [("Cookie", bob.as_str())];
    let bob_csrf = csrf_of(&http(addr, "GET", "/", &bob_auth, "").await.body);

    // One letter first: edited and replayed from its page. Its history shows
    // the dead letter the journal recorded.
    let edited = letters
        .iter()
        .find(|l| failed.contains(&l.message_id))
        .unwrap();
    let letter_page = format!("/letters/{}", encode(&edited.letter_id));
    let before = http(addr, "GET", &letter_page, &bob_auth, "").await;
    assert!(before.body.contains(">dead-lettered<"), "{}", before.body);
    assert!(
        before.body.contains("<dt>Format</dt><dd>warren</dd>"),
        "{}",
        before.body
    );
    let edit = form(&[
        ("csrf", bob_csrf.as_str()),
        ("action", "edit-replay"),
        ("letter", edited.letter_id.as_str()),
        ("field", "operatorNote"),
        ("value", "checked by bob"),
        ("reason", "a note for the ledger"),
    ]);
    let confirm = http(addr, "POST", "/act", &bob_auth, &edit).await;
    assert!(
        confirm.body.contains("Set payload field operatorNote"),
        "{}",
        confirm.body
    );
    let edit_run = http(
        addr,
        "POST",
        "/act",
        &bob_auth,
        &format!("{edit}&confirmed=yes"),
    )
    .await;
    assert_eq!(edit_run.status, 303, "{}", edit_run.body);
    run_finishes(addr, &edit_run.headers["location"], &bob_auth, 1).await;
    let after = http(addr, "GET", &letter_page, &bob_auth, "").await;
    assert!(after.body.contains("Payload (edited)"), "{}", after.body);
    assert!(after.body.contains("checked by bob"), "{}", after.body);

    let replay = http(
        addr,
        "POST",
        "/act",
        &bob_auth,
        &form(&[
            ("csrf", bob_csrf.as_str()),
            ("action", "replay-group"),
            ("group", group.as_str()),
            ("reason", "config row restored"),
            ("confirmed", "yes"),
        ]),
    )
    .await;
    assert_eq!(replay.status, 303, "{}", replay.body);
    let run_page = replay.headers["location"].clone();
    assert!(run_page.starts_with("/runs/"), "{run_page}");
    run_finishes(addr, &run_page, &bob_auth, 2).await;
    assert!(running.settled(3, Duration::from_secs(60)).await);
    running.stop().await.unwrap();
    for id in &failed {
        assert_eq!(db.effects_for(id).await, 1, "{id} applied once");
    }
    let run = http(addr, "GET", &run_page, &bob_auth, "").await;
    assert!(run.body.contains("finished"), "{}", run.body);
    let audit = store.audit_log(50).await.unwrap();
    assert!(
        audit
            .iter()
            .any(|e| e.operator == "bob" && e.action.contains("replay")),
        "the audit names who replayed: {audit:?}"
    );
    assert!(
        audit
            .iter()
            .any(|e| e.operator == "alice" && e.action.contains("resolve")),
        "{audit:?}"
    );
    // The group is no longer among the unresolved.
    let after = http(addr, "GET", "/", &bob_auth, "").await;
    assert!(
        !after.body.contains(&format!(">{group}<")),
        "{}",
        after.body
    );

    drop(console);
    broker.cleanup().await;
    db.drop_db().await;
}

/// The ways in besides a login, and the refusals a user meets: a proxy's
/// identity header, a bearer token, a request for another host name (DNS
/// rebinding), an edit where edits are switched off, and a replay while the
/// broker cannot be reached. What is refused changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_ways_in_and_refusals_change_only_what_they_may() {
    let db = <sqlx::Sqlite as Backend>::create().await;
    let broker = TestBroker::new().await;
    let Staged {
        failed,
        letters,
        tokens,
        dir: _dir,
        ..
    } = staged(&db, &broker).await;
    let letter = letters
        .iter()
        .find(|l| failed.contains(&l.message_id))
        .unwrap()
        .clone();
    let store = db.store.clone();
    let state = || async { store.dead_letter(&letter.letter_id).await.unwrap().unwrap() };

    // Behind a proxy that names the operator.
    let proxied = start_console_with(
        &db.url,
        &[
            "--behind-proxy",
            "test-proxy",
            "--identity-header",
            "X-Forwarded-User",
        ],
        &[],
    )
    .await;
    let addr = proxied.addr.as_str();
    assert_eq!(
        http(addr, "GET", "/", &[], "").await.status,
        303,
        "no header, no page"
    );
    let as_carol = [("X-Forwarded-User", "carol")];
    let page = http(addr, "GET", "/", &as_carol, "").await;
    assert_eq!(page.status, 200);
    assert!(page.body.contains("carol"), "{}", page.body);
    let mute = form(&[
        ("csrf", csrf_of(&page.body).as_str()),
        ("action", "mute"),
        ("group", letter.group_key.as_str()),
        ("reason", "known, fix on the way"),
        ("confirmed", "yes"),
    ]);
    assert_eq!(
        http(addr, "POST", "/act", &as_carol, &mute).await.status,
        200
    );
    let audit = store.audit_log(20).await.unwrap();
    assert!(
        audit
            .iter()
            .any(|e| e.operator == "carol" && e.action == "mute"),
        "{audit:?}"
    );
    drop(proxied);

    // Tokens, with a bearer token from a script, and replays to a broker that
    // is not there.
    let console = start_console_with(
        &db.url,
        &["--tokens", tokens.to_str().unwrap()],
        &[("AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f")],
    )
    .await;
    let addr = console.addr.as_str();
    let bearer = format!("Bearer {ALICE}");
    let as_alice = [("Authorization", bearer.as_str())];
    assert_eq!(http(addr, "GET", "/", &as_alice, "").await.status, 200);
    let wrong = [("Authorization", "Bearer not-a-token-of-anyone")];
    assert_eq!(http(addr, "POST", "/act", &wrong, "").await.status, 401);
    let rebound = [
        ("Authorization", bearer.as_str()),
        ("Host", "evil.example:8088"),
    ];
    let a = http(addr, "GET", "/", &rebound, "").await;
    assert_eq!(a.status, 403, "another host name is refused: {}", a.body);

    let replay = form(&[
        ("action", "replay-letter"),
        ("letter", letter.letter_id.as_str()),
        ("confirmed", "yes"),
    ]);
    let a = http(addr, "POST", "/act", &as_alice, &replay).await;
    assert_eq!(a.status, 409, "{}", a.body);
    assert!(
        a.body.contains("cannot connect to the broker"),
        "{}",
        a.body
    );
    let after = state().await;
    assert_eq!(
        after.letter.state,
        LetterState::Unresolved,
        "nothing replayed"
    );
    assert!(
        store
            .letter_replays(&letter.letter_id)
            .await
            .unwrap()
            .is_empty()
    );

    // Edits switched off for this database: the edit is refused, the body
    // stays as it was.
    let off = crate::cli::warren(&[
        "dead-letters",
        "--database-url",
        &db.url,
        "--operator",
        "alice",
        "policy",
        "--edit",
        "off",
    ])
    .await;
    assert!(
        off.status.success(),
        "{}",
        String::from_utf8_lossy(&off.stderr)
    );
    let edit = form(&[
        ("action", "edit-replay"),
        ("letter", letter.letter_id.as_str()),
        ("field", "operatorNote"),
        ("value", "x"),
        ("reason", "try"),
        ("confirmed", "yes"),
    ]);
    let a = http(addr, "POST", "/act", &as_alice, &edit).await;
    assert_eq!(a.status, 409, "{}", a.body);
    assert!(state().await.edit.is_none(), "no edit kept");

    drop(console);
    broker.cleanup().await;
    db.drop_db().await;
}

/// The console refuses to serve where payloads would cross a network in the
/// clear, and says what to fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_loopback_the_console_needs_a_proxy_and_logins() {
    for (args, says) in [
        (vec!["--bind", "0.0.0.0:0"], "--behind-proxy"),
        (
            vec!["--bind", "0.0.0.0:0", "--behind-proxy", "nginx"],
            "authentication",
        ),
        (vec!["--identity-header", "X-User"], "--behind-proxy"),
    ] {
        let mut all = vec!["console", "--database-url", "sqlite://nowhere.db"];
        all.extend(args.iter().copied());
        let out = crate::cli::warren(&all).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "alice short\n").unwrap();
    let out = crate::cli::warren(&[
        "console",
        "--database-url",
        "sqlite://nowhere.db",
        "--tokens",
        tokens.to_str().unwrap(),
    ])
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("at least 16 characters"), "{stderr}");
}

/// A careful replay run whose process died before it published anything
/// (what a console or CLI killed mid-run leaves: the run "running" in the
/// database, nobody publishing it) is resumed from its page: the page says
/// no one here publishes it, the resume is confirmed and audited, and each
/// message is applied once. Then the database fails its queries: pages and
/// actions answer 503, and the console recovers with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_left_by_a_process_that_died_is_resumed_from_its_page() {
    let db = <sqlx::Postgres as Backend>::create().await;
    let broker = TestBroker::new().await;
    let Staged {
        failed,
        group,
        tokens,
        dir: _dir,
        ..
    } = staged(&db, &broker).await;
    let store = db.store.clone();
    // Started as the console would, then its process "died": nothing of it
    // is published.
    let orphan = warren_admin::Replayer::new(
        store.clone(),
        std::sync::Arc::clone(&broker.connection),
        warren::store::Actor::new("alice"),
    )
    .careful(Duration::from_secs(60))
    .start(&LetterFilter::of_group(&group), None, false)
    .await
    .unwrap();
    assert_eq!((orphan.state.as_str(), orphan.published), ("running", 0));
    let run_page = format!("/runs/{}", encode(&orphan.run_id));

    let console = start_console(&db.url, &tokens).await;
    let addr = console.addr.as_str();
    let bob = format!("Bearer {BOB}");
    let as_bob = [("Authorization", bob.as_str())];
    let page = http(addr, "GET", &run_page, &as_bob, "").await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(
        page.body.contains("id=\"not-here\"") && page.body.contains("resume-run"),
        "the page offers to resume a run no one here publishes: {}",
        page.body
    );
    let ask = |confirmed: &'static str| {
        form(&[
            ("action", "resume-run"),
            ("run", orphan.run_id.as_str()),
            ("confirmed", confirmed),
        ])
    };
    let confirm = http(addr, "POST", "/act", &as_bob, &ask("")).await;
    assert_eq!(confirm.status, 200, "{}", confirm.body);
    assert!(
        confirm.body.contains("Resume replay run") && confirm.body.contains("id=\"confirm\""),
        "{}",
        confirm.body
    );
    assert_eq!(
        store
            .replay_run(&orphan.run_id)
            .await
            .unwrap()
            .unwrap()
            .published,
        0,
        "nothing goes out before the confirmation"
    );

    let running = Running::start(Consumer::new(
        broker.config(),
        store.clone(),
        routes::<sqlx::Postgres>(),
    ));
    let resumed = http(addr, "POST", "/act", &as_bob, &ask("yes")).await;
    assert_eq!(resumed.status, 303, "{}", resumed.body);
    assert_eq!(resumed.headers["location"], run_page);
    run_finishes(addr, &run_page, &as_bob, 3).await;
    assert!(running.settled(3, Duration::from_secs(60)).await);
    running.stop().await.unwrap();
    for id in &failed {
        assert_eq!(db.effects_for(id).await, 1, "{id} applied once");
    }
    let audit = store.audit_log(20).await.unwrap();
    assert!(
        audit.iter().any(|e| e.operator == "bob"
            && e.action == "replay-resume"
            && e.target == orphan.run_id),
        "the resume is audited under bob: {audit:?}"
    );
    // Finished: nothing left to resume, and a resume is refused.
    let page = http(addr, "GET", &run_page, &as_bob, "").await;
    assert!(!page.body.contains("resume-run"), "{}", page.body);
    let again = http(addr, "POST", "/act", &as_bob, &ask("yes")).await;
    assert_eq!(again.status, 409, "{}", again.body);

    // A database that fails its queries: pages and actions say so (503)
    // and change nothing; once it answers again, so does the console.
    let pool = <sqlx::Postgres as Backend>::pool(&store);
    let rename = |from: &str, to: &str| format!("ALTER TABLE {from} RENAME TO {to}");
    sqlx::query(sqlx::AssertSqlSafe(rename(
        "warren_dead_letters",
        "warren_dead_letters_away",
    )))
    .execute(pool)
    .await
    .unwrap();
    let down = http(addr, "GET", "/", &as_bob, "").await;
    assert_eq!(down.status, 503, "{}", down.body);
    assert!(down.body.contains("the database"), "{}", down.body);
    let resolve = form(&[
        ("action", "resolve-group"),
        ("group", group.as_str()),
        ("confirmed", "yes"),
    ]);
    assert_eq!(
        http(addr, "POST", "/act", &as_bob, &resolve).await.status,
        503
    );
    sqlx::query(sqlx::AssertSqlSafe(rename(
        "warren_dead_letters_away",
        "warren_dead_letters",
    )))
    .execute(pool)
    .await
    .unwrap();
    let up = http(addr, "GET", "/", &as_bob, "").await;
    assert_eq!(up.status, 200, "{}", up.body);

    drop(console);
    broker.cleanup().await;
    db.drop_db().await;
}

/// A login posted from another site would log the victim's browser in as
/// the attacker's operator: refused like every other form, whatever says
/// so (a foreign Origin, `Origin: null`, only `Sec-Fetch-Site`, a foreign
/// Host), with no session cookie. The console's own form logs in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_posted_from_another_site_is_refused() {
    let db = <sqlx::Sqlite as Backend>::create().await;
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("alice {ALICE}\n")).unwrap();
    let console = start_console(&db.url, &tokens).await;
    let addr = console.addr.as_str();
    let body = form(&[("token", ALICE)]);
    let origin = format!("http://{addr}");
    let forged: [&[(&str, &str)]; 5] = [
        &[
            ("Origin", "http://evil.example"),
            ("Sec-Fetch-Site", "cross-site"),
        ],
        &[("Origin", "http://evil.example")],
        &[("Origin", "null")],
        &[("Sec-Fetch-Site", "cross-site")],
        &[("Host", "evil.example"), ("Origin", "http://evil.example")],
    ];
    for headers in forged {
        let a = http(addr, "POST", "/login", headers, &body).await;
        assert_eq!(a.status, 403, "{headers:?}: {}", a.body);
        assert!(!a.headers.contains_key("set-cookie"), "{headers:?}");
    }
    let own: [&[(&str, &str)]; 2] = [
        &[
            ("Origin", origin.as_str()),
            ("Sec-Fetch-Site", "same-origin"),
        ],
        &[],
    ];
    for headers in own {
        let a = http(addr, "POST", "/login", headers, &body).await;
        assert_eq!(a.status, 303, "{headers:?}: {}", a.body);
        assert!(a.headers.contains_key("set-cookie"), "{headers:?}");
    }
    db.drop_db().await;
}
