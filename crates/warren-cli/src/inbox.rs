//! `warren inbox`: retention of the inbox's claims.

use warren::retry::RetryPolicy;

use crate::CliError;
use crate::cli::InboxCommand;

pub(crate) async fn run_inbox<S: warren::store::Retention>(
    store: &S,
    cmd: InboxCommand,
) -> Result<(), CliError> {
    let InboxCommand::Purge {
        consumer,
        older_than,
        retry_tiers,
        max_attempts,
        replay_margin,
        force,
    } = cmd;
    let mut policy = RetryPolicy::new(retry_tiers);
    if let Some(n) = max_attempts {
        policy = policy.with_max_attempts(n);
    }
    policy
        .validate()
        .map_err(|e| CliError::Usage(e.to_string()))?;
    if older_than > warren_admin::MAX_RETENTION {
        return Err(CliError::Usage(format!(
            "--older-than {} is longer than the most warren accepts ({}d)",
            warren::retry::format_delay(older_than),
            warren_admin::MAX_RETENTION.as_secs() / 86_400
        )));
    }
    if let Err(why) = warren_admin::check_window(older_than, &policy, replay_margin) {
        if !force {
            return Err(CliError::Failed(why));
        }
        eprintln!("warren: --force: {why}");
    }
    let deleted = warren_admin::purge_inbox(store, &consumer, older_than)
        .await
        .map_err(|e| CliError::Failed(e.to_string()))?;
    println!(
        "deleted {deleted} inbox row(s) of {consumer:?} older than {}",
        warren::retry::format_delay(older_than)
    );
    Ok(())
}
